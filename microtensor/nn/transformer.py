"""torch's Transformer modules: nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
nn.TransformerEncoder, nn.TransformerDecoder and nn.Transformer, with torch's submodule
names (self_attn, multihead_attn, linear1, dropout, linear2, norm1..3, dropout1..3,
layers.N, encoder, decoder), so that a torch state_dict loads and gives torch's outputs
and gradients.

    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128,
                                       batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    h = encoder(x, src_key_padding_mask=pad)              # (B, T, 64)

Each layer is post-norm, x = norm(x + sublayer(x)) (the 2017 paper), or pre-norm with
norm_first=True, x = x + sublayer(norm(x)) (GPT-2's). Attention inside runs on the fused
kernel (MultiheadAttention with need_weights=False). torch's inference fast paths (its
fused encoder layer, nested tensors for padding) are not here: microtensor always takes
the path torch takes while training, and a padded position's output is computed like any
other (torch's nested fast path writes zeros there).
"""
import copy

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor
from microtensor.nn import functional as F
from microtensor.nn import init
from microtensor.nn.containers import ModuleList
from microtensor.nn.layers import Linear, Dropout, ReLU, GELU
from microtensor.nn.normalization import LayerNorm
from microtensor.nn.module import Module
from microtensor.nn.multihead_attention import MultiheadAttention, canonical_mask
from microtensor.ops.creation_extra import _check_device

__all__ = ["Transformer", "TransformerEncoder", "TransformerDecoder",
           "TransformerEncoderLayer", "TransformerDecoderLayer"]


def _generate_square_subsequent_mask(sz, device=None, dtype=None):
    """(sz, sz) float mask: 0 on and below the diagonal, -inf above (query i sees keys 0..i)."""
    _check_device(device)
    return _core.triu(_core.full((sz, sz), float("-inf"), dtype=dtype), diagonal=1)


def _activation(activation):
    """'relu' / 'gelu' -> F.relu / F.gelu; a callable (a function or a Module) as it is."""
    if isinstance(activation, str):
        if activation == "relu":
            return F.relu
        if activation == "gelu":
            return F.gelu
        raise ValueError(f"activation should be relu/gelu, not {activation}")
    if not callable(activation):
        raise TypeError(f"activation should be 'relu', 'gelu' or a callable, got "
                        f"{type(activation).__name__}")
    return activation


def _relu_or_gelu(activation):
    """torch's activation_relu_or_gelu flag: 1 for relu, 2 for gelu, 0 for anything else."""
    if activation is F.relu or isinstance(activation, ReLU):
        return 1
    if activation is F.gelu or isinstance(activation, GELU):
        return 2
    return 0


def _get_seq_len(src, batch_first):
    """The sequence length of (T, E), (T, B, E) or (B, T, E)."""
    if src.ndim == 2:
        return src.shape[0]
    return src.shape[1 if batch_first else 0]


def _detect_is_causal_mask(mask, is_causal=None, size=None):
    """is_causal=None: whether mask is exactly the causal mask of `size` (torch's rule, so
    that a causal mask runs on the kernel's own causal path); True/False: as given."""
    make_causal = is_causal is True
    if is_causal is None and mask is not None:
        sz = size if size is not None else mask.shape[-2]
        m = mask._data if isinstance(mask, Tensor) else np.asarray(mask)
        if m.dtype == np.bool_:
            causal = np.triu(np.ones((sz, sz), dtype=bool), 1)
        else:
            causal = np.triu(np.full((sz, sz), -np.inf, dtype=m.dtype), 1)
        make_causal = m.shape == causal.shape and bool(np.array_equal(m, causal))
    return make_causal


def _get_clones(module, n):
    return ModuleList([copy.deepcopy(module) for _ in range(n)])


class TransformerEncoderLayer(Module):
    """post-norm: x = norm1(x + sa(x)); x = norm2(x + ff(x))
    pre-norm (norm_first): x = x + sa(norm1(x)); x = x + ff(norm2(x))
    with sa = dropout1(self_attn(x, x, x)), ff = dropout2(linear2(dropout(act(linear1(x)))))."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True,
                 device=None, dtype=None):
        super().__init__()
        _check_device(device)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, dtype=dtype)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        activation = _activation(activation)
        self.activation_relu_or_gelu = _relu_or_gelu(activation)
        self.activation = activation          # a Module activation is a submodule, as in torch

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        """src (T, B, E), (B, T, E) with batch_first, or (T, E); the same shape out."""
        src_key_padding_mask = canonical_mask(src_key_padding_mask, "src_key_padding_mask",
                                              src.dtype)
        src_mask = canonical_mask(src_mask, "src_mask", src.dtype)
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerDecoderLayer(Module):
    """post-norm: x = norm1(x + sa(x)); x = norm2(x + ca(x, memory)); x = norm3(x + ff(x))
    pre-norm (norm_first): x = x + sa(norm1(x)); x = x + ca(norm2(x), memory); x = x + ff(norm3(x))
    with ca = dropout2(multihead_attn(x, memory, memory)) the cross-attention."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True,
                 device=None, dtype=None):
        super().__init__()
        _check_device(device)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout,
                                            batch_first=batch_first, bias=bias, dtype=dtype)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout,
                                                 batch_first=batch_first, bias=bias, dtype=dtype)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, dtype=dtype)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        """tgt (T, B, E), memory (S, B, E) ((B, T, E), (B, S, E) with batch_first); the
        shape of tgt out."""
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask,
                                    memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                               memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           is_causal=is_causal, need_weights=False)[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal=False):
        x = self.multihead_attn(x, mem, mem, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, is_causal=is_causal,
                                need_weights=False)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)


class TransformerEncoder(Module):
    """num_layers deep copies of encoder_layer (layers.0, layers.1, ...), applied in
    turn, then `norm` if given. enable_nested_tensor and mask_check are accepted and kept
    for torch's code; they choose torch's inference fast path, which microtensor has not."""

    def __init__(self, encoder_layer, num_layers, norm=None, enable_nested_tensor=True,
                 mask_check=True):
        super().__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = False
        self.mask_check = mask_check

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        """is_causal=None: detected (mask is exactly the causal mask); True: a hint that
        mask is causal (the layers then use the kernel's causal path)."""
        src_key_padding_mask = canonical_mask(src_key_padding_mask, "src_key_padding_mask",
                                              src.dtype)
        mask = canonical_mask(mask, "mask", src.dtype)
        batch_first = self.layers[0].self_attn.batch_first
        is_causal = _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, is_causal=is_causal,
                         src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            output = self.norm(output)
        return output


class TransformerDecoder(Module):
    """num_layers deep copies of decoder_layer (layers.0, layers.1, ...), applied in
    turn to tgt with the same memory, then `norm` if given."""

    def __init__(self, decoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        output = tgt
        seq_len = _get_seq_len(tgt, self.layers[0].self_attn.batch_first)
        tgt_is_causal = _detect_is_causal_mask(tgt_mask, tgt_is_causal, seq_len)
        for mod in self.layers:
            output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                         tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask,
                         tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
        if self.norm is not None:
            output = self.norm(output)
        return output


class Transformer(Module):
    """The encoder-decoder of "Attention Is All You Need": memory = encoder(src),
    out = decoder(tgt, memory), each a stack of layers with a final LayerNorm. Every
    parameter with more than one dim starts xavier_uniform_ (torch's _reset_parameters)."""

    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 dim_feedforward=2048, dropout=0.1, activation=F.relu, custom_encoder=None,
                 custom_decoder=None, layer_norm_eps=1e-5, batch_first=False, norm_first=False,
                 bias=True, device=None, dtype=None):
        super().__init__()
        _check_device(device)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            encoder_layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
                                                    activation, layer_norm_eps, batch_first,
                                                    norm_first, bias, dtype=dtype)
            encoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
            self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, encoder_norm)
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            decoder_layer = TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout,
                                                    activation, layer_norm_eps, batch_first,
                                                    norm_first, bias, dtype=dtype)
            decoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype)
            self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, decoder_norm)
        self._reset_parameters()
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None,
                memory_is_causal=False):
        """src (S, B, E), tgt (T, B, E) ((B, S, E), (B, T, E) with batch_first, or
        unbatched (S, E), (T, E)) -> (T, B, E) (tgt's shape)."""
        is_batched = src.ndim == 3
        if is_batched and src.shape[0 if self.batch_first else 1] != \
                tgt.shape[0 if self.batch_first else 1]:
            raise _core.ShapeError(f"Transformer: the batch number of src and tgt must be equal, "
                                   f"got shapes {src.shape} and {tgt.shape} "
                                   f"(batch_first={self.batch_first})")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise _core.ShapeError(f"Transformer: the feature number of src and tgt must be equal "
                                   f"to d_model={self.d_model}, got shapes {src.shape} and "
                                   f"{tgt.shape}")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz, device=None, dtype=None):
        """(sz, sz) float mask, -inf above the diagonal and 0 elsewhere: query i sees keys
        0..i (torch's; the default dtype when dtype is None)."""
        return _generate_square_subsequent_mask(sz, device=device, dtype=dtype)

    def _reset_parameters(self):
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)
