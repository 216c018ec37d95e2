"""One Transformer layer: attention then MLP, each wrapped in a norm and a residual."""
from microtensor import nn

from models.attention import MultiHeadAttention
from models.config import check_choice, NORMS, MLPS
from models.feedforward import FeedForward


def make_norm(kind, d_model, bias=True, eps=None):
    """LayerNorm or RMSNorm of width d_model; eps=None keeps the layer's own default."""
    check_choice("norm", kind, NORMS)
    options = {} if eps is None else dict(eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(d_model, bias=bias, **options)
    return nn.RMSNorm(d_model, **options)


class TransformerBlock(nn.Module):
    """pre-norm:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))          (GPT-2)
    post-norm: x = ln_1(x + attn(x));   x = ln_2(x + mlp(x))          (2017)

    With cross_attention=True (a decoder layer) a third sublayer attends to `context`
    between the two: x = x + cross_attn(ln_cross(x), context) (or its post-norm form).
    residual=False drops the `x +` of every sublayer, to study what the skips buy.
    attn_dropout (None = dropout) is the dropout on the attention weights; norm_eps
    (None = the norm's default) the norms' eps.
    """

    def __init__(self, d_model, n_head, d_ff=None, causal=True, norm="layernorm",
                 prenorm=True, residual=True, bias=True, dropout=0.0, activation="gelu",
                 rope=False, cross_attention=False, attn_dropout=None, norm_eps=None):
        super().__init__()
        check_choice("activation", activation, MLPS)
        self.prenorm, self.residual = prenorm, residual
        self.ln_1 = make_norm(norm, d_model, bias, norm_eps)
        self.attn = MultiHeadAttention(d_model, n_head, causal=causal, bias=bias,
                                       dropout=dropout, rope=rope, attn_dropout=attn_dropout)
        if cross_attention:
            self.ln_cross = make_norm(norm, d_model, bias, norm_eps)
            self.cross_attn = MultiHeadAttention(d_model, n_head, causal=False, bias=bias,
                                                 dropout=dropout, attn_dropout=attn_dropout)
        else:
            self.ln_cross = self.cross_attn = None
        self.ln_2 = make_norm(norm, d_model, bias, norm_eps)
        self.mlp = FeedForward(d_model, 4 * d_model if d_ff is None else d_ff, activation,
                               bias=bias, dropout=dropout)

    def _sublayer(self, x, norm, fn):
        if self.prenorm:
            out = fn(norm(x))
            return x + out if self.residual else out
        return norm(x + fn(x) if self.residual else fn(x))

    def forward(self, x, mask=None, kv_cache=None, context=None, context_mask=None,
                cross_kv_cache=None):
        x = self._sublayer(x, self.ln_1, lambda h: self.attn(h, mask=mask, kv_cache=kv_cache))
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this block has cross-attention: pass context=")
            x = self._sublayer(x, self.ln_cross, lambda h: self.cross_attn(
                h, context=context, mask=context_mask, kv_cache=cross_kv_cache))
        return self._sublayer(x, self.ln_2, self.mlp)
