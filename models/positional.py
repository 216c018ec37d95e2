"""Three ways to tell attention where a token is.

  LearnedPositionalEmbedding    a trained row per position, added to the input (GPT-2)
  SinusoidalPositionalEncoding  a fixed table of sines and cosines, added (2017)
  RotaryEmbedding               rotate q and k by a position-dependent angle (RoPE)
"""
import math

import numpy as np

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F
from microtensor import ShapeError


def _check_length(T, max_len, what):
    if T > max_len:
        raise ShapeError(f"cannot take a sequence of length {T}: {what} only covers "
                         f"{max_len} positions")


class LearnedPositionalEmbedding(nn.Module):
    """y = x + W[offset : offset + T];  W is (max_len, d_model), one trained row per position."""

    def __init__(self, max_len, d_model):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(mt.zeros(max_len, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x, offset=0):
        T = x.shape[-2]
        _check_length(offset + T, self.max_len, f"the learned position table ({self.max_len} rows)")
        return x + self.weight[offset:offset + T]  # (B, T, C) + (T, C)


def sinusoid_table(max_len, d_model):
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)),  PE[pos, 2i+1] = cos(pos / 10000^(2i/d))."""
    position = np.arange(max_len, dtype=np.float64)[:, None]                 # (max_len, 1)
    inv_freq = np.exp(np.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))  # (ceil(d/2),)
    angle = position * inv_freq                                              # (max_len, ceil(d/2))
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, :d_model // 2])  # an odd d_model has one cos column fewer
    return pe.astype(np.float32)


class SinusoidalPositionalEncoding(nn.Module):
    """y = dropout(x + PE[offset : offset + T]); the fixed table PE is the buffer `pe`."""

    def __init__(self, d_model, max_len=5000, dropout=0.0):
        super().__init__()
        self.max_len = max_len
        self.register_buffer("pe", mt.from_numpy(sinusoid_table(max_len, d_model)))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, offset=0):
        T = x.shape[-2]
        _check_length(offset + T, self.max_len, f"the sinusoid table (max_len={self.max_len})")
        return self.drop(x + self.pe[offset:offset + T])  # (B, T, C) + (T, C)


# ---- rotary embeddings ---------------------------------------------------------------
#
# RoPE treats the head dims as d/2 pairs (x_i, x_{i+d/2}) and rotates pair i at position
# t by the angle t * base^(-2i/d). A dot product of two rotated vectors then depends only
# on the distance between their positions. The rotation is one op with its own backward
# rule, F.rotary_embedding (microtensor/nn/rope.py); this module builds its tables.

class RotaryEmbedding(nn.Module):
    """y = rope(x, offset): rotate each position t of x (..., T, head_dim) by (offset + t) * freq."""

    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        if head_dim % 2:
            raise ShapeError(f"RotaryEmbedding rotates pairs of dims, so head_dim must be even, "
                             f"got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        # NOTE: plain numpy arrays, not buffers: the tables are derived from (head_dim,
        # base), grow on demand and do not belong in a checkpoint.
        self._angle = np.zeros((0, head_dim))
        self._tables_by_dtype = {}

    def _tables(self, length, dtype):
        """cos and sin tables (n, head_dim) with n >= length, in `dtype`."""
        if self._angle.shape[0] < length:
            n = max(length, 2 * self._angle.shape[0])
            inv_freq = self.base ** (-np.arange(0, self.head_dim, 2) / self.head_dim)  # (hd/2,)
            angle = np.arange(n)[:, None] * inv_freq                                  # (n, hd/2)
            self._angle = np.concatenate([angle, angle], axis=1)                      # (n, hd)
            self._tables_by_dtype = {}
        if dtype not in self._tables_by_dtype:
            self._tables_by_dtype[dtype] = (np.cos(self._angle).astype(dtype),
                                            np.sin(self._angle).astype(dtype))
        return self._tables_by_dtype[dtype]

    def forward(self, x, offset=0):
        T, hd = x.shape[-2], x.shape[-1]
        if hd != self.head_dim:
            raise ShapeError(f"RotaryEmbedding(head_dim={self.head_dim}) got an input whose last "
                             f"dim is {hd} (shape {x.shape})")
        cos, sin = self._tables(offset + T, x.dtype)
        cos, sin = cos[offset:offset + T], sin[offset:offset + T]  # (T, hd), broadcast over leading dims
        return F.rotary_embedding(x, cos, sin)
