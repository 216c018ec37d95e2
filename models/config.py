"""GPTConfig: every option of the GPT family in one dataclass, checked when it is made."""
from dataclasses import dataclass
from typing import Optional

from microtensor import ShapeError

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
MLPS = ("gelu", "gelu_tanh", "relu", "swiglu")


def check_choice(name, value, allowed):
    """ValueError listing the allowed values when `value` is not one of them."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         + ", ".join(repr(a) for a in allowed))


def check_heads(d_model, n_head, what="n_embd"):
    """The model width must split evenly into heads."""
    if n_head < 1:
        raise ValueError(f"n_head must be at least 1, got {n_head}")
    if d_model % n_head != 0:
        raise ShapeError(f"{what}={d_model} is not divisible by n_head={n_head}: every head "
                         f"needs the same width ({d_model} / {n_head} = {d_model / n_head:g})")


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True           # biases in Linears and LayerNorms (GPT-2 has them)
    norm: str = "layernorm"     # 'layernorm' | 'rmsnorm'
    prenorm: bool = True        # GPT-2 normalises before each sublayer; False = 2017 post-norm
    pos: str = "learned"        # 'learned' | 'sinusoidal' | 'rope' | 'none'
    mlp: str = "gelu"           # 'gelu' | 'gelu_tanh' (GPT-2's own) | 'relu' | 'swiglu'
    tie_weights: bool = True    # lm_head.weight is transformer.wte.weight
    residual: bool = True       # False drops the skip connections (to study why they matter)
    d_ff: Optional[int] = None  # MLP hidden width; None = 4 * n_embd (swiglu: 8/3 * n_embd)
    # what a Hugging Face GPT-2 config can set apart (models/pretrained.py reads them);
    # None keeps the one above or the layer's own default
    norm_eps: Optional[float] = None      # the norms' eps; None = LayerNorm's 1e-5, RMSNorm's own
    attn_dropout: Optional[float] = None  # on the attention weights; None = dropout
    embd_dropout: Optional[float] = None  # on the embeddings' sum; None = dropout

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_heads(self.n_embd, self.n_head)
        check_choice("norm", self.norm, NORMS)
        check_choice("pos", self.pos, POSITIONS)
        check_choice("mlp", self.mlp, MLPS)
        for name in ("dropout", "attn_dropout", "embd_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.norm_eps is not None and not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ShapeError(f"pos='rope' rotates pairs of dims, so the head size must be even; "
                             f"n_embd={self.n_embd} / n_head={self.n_head} = "
                             f"{self.n_embd // self.n_head}")

    @property
    def mlp_hidden(self):
        """The MLP's hidden width. SwiGLU has three matrices instead of two, so its
        default width is 2/3 of 4 * n_embd (rounded up to a multiple of 8), which keeps
        the parameter count close to the GELU MLP's."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return -(-(8 * self.n_embd // 3) // 8) * 8
        return 4 * self.n_embd

    @classmethod
    def gpt2(cls, **overrides):
        """GPT-2 small, 124M parameters."""
        return cls(**{**dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                             n_embd=768), **overrides})

    @classmethod
    def char_small(cls, vocab_size, **overrides):
        """A character model that trains in a couple of minutes on a 2-core CPU
        (about 0.8M parameters plus the embedding)."""
        return cls(**{**dict(vocab_size=vocab_size, block_size=64, n_layer=4, n_head=4,
                             n_embd=128, dropout=0.0), **overrides})
