"""Multi-head attention: self or cross, causal or not, optional RoPE and KV cache."""
import numpy as np

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F

from models.config import check_heads
from models.positional import RotaryEmbedding


class KVCache:
    """The keys and values a MultiHeadAttention has seen so far, for generation.

    Self-attention appends the new tokens' k and v on every call; cross-attention
    projects the (fixed) context once and reuses it. `length` is the number of cached
    positions, which is also the position of the next token (RoPE's offset).
    """

    def __init__(self):
        self.k = None  # (B, nh, T_cached, hs)
        self.v = None  # (B, nh, T_cached, hs)

    @property
    def length(self):
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        """Add the new positions' keys and values; return all of them."""
        if self.k is not None:
            k = mt.cat([self.k, k], dim=2)  # (B, nh, T_cached + T, hs)
            v = mt.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v

    def reset(self):
        self.k = self.v = None


def causal_mask_with_past(T, T_past):
    """(T, T_past + T) bool: new query i may see every cached key and the new keys up to i."""
    return mt.from_numpy(np.tri(T, T_past + T, T_past, dtype=bool))


class MultiHeadAttention(nn.Module):
    """y = c_proj(concat_h softmax(q_h k_h^T / sqrt(hs) + mask) v_h);  q, k, v from one c_attn.

    Self-attention: q, k, v = c_attn(x).split. Cross-attention (`context` given): q from x,
    k and v from `context`, using the same c_attn weight split by rows.
    `mask` is boolean, True where a query may attend, broadcastable to (B, nh, T, S)
    (a padding mask over keys is (B, 1, 1, S)).
    `dropout` drops from the output (and from the attention weights unless
    `attn_dropout` gives those a rate of their own, as GPT-2's attn_pdrop does).
    """

    def __init__(self, d_model, n_head, causal=False, bias=True, dropout=0.0, rope=False,
                 attn_dropout=None):
        super().__init__()
        check_heads(d_model, n_head, "d_model")
        self.d_model, self.n_head, self.head_size = d_model, n_head, d_model // n_head
        self.causal = causal
        self.dropout = dropout if attn_dropout is None else attn_dropout  # on the weights
        # q, k, v projections for all heads fused into one matmul
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.rope = RotaryEmbedding(self.head_size) if rope else None

    def _heads(self, t, B, T):
        """(B, T, C) -> (B, nh, T, hs)"""
        return t.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)

    def forward(self, x, context=None, mask=None, kv_cache=None):
        for name, t in (("x", x), ("context", context)):
            if t is not None and (t.ndim != 3 or t.shape[-1] != self.d_model):
                raise mt.ShapeError(f"MultiHeadAttention(d_model={self.d_model}) expects {name} "
                                    f"of shape (B, T, {self.d_model}), got {tuple(t.shape)}")
        B, T, C = x.shape
        offset = 0 if kv_cache is None else kv_cache.length  # position of x's first token
        if context is None:
            q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
            q, k, v = self._heads(q, B, T), self._heads(k, B, T), self._heads(v, B, T)
            if self.rope is not None:
                q, k = self.rope(q, offset), self.rope(k, offset)
            if kv_cache is not None:
                k, v = kv_cache.append(k, v)  # (B, nh, offset + T, hs)
        else:
            if self.rope is not None:
                raise ValueError("rope=True is for self-attention; make the cross-attention "
                                 "module with rope=False")
            q = self._heads(F.linear(x, self.c_attn.weight[:C],
                                     None if self.c_attn.bias is None else self.c_attn.bias[:C]), B, T)
            if kv_cache is not None and kv_cache.k is not None:
                k, v = kv_cache.k, kv_cache.v  # the context was projected on the first call
            else:
                S = context.shape[1]
                kv = F.linear(context, self.c_attn.weight[C:],
                              None if self.c_attn.bias is None else self.c_attn.bias[C:])
                k, v = kv.split(C, dim=2)  # 2 x (B, S, C)
                k, v = self._heads(k, B, S), self._heads(v, B, S)  # (B, nh, S, hs)
                if kv_cache is not None:
                    kv_cache.k, kv_cache.v = k, v

        is_causal = False
        if self.causal and context is None:
            if offset == 0 and mask is None:
                is_causal = True  # the fast path: the attention kernel masks by itself
            elif T > 1 or mask is not None:
                causal = causal_mask_with_past(T, offset)  # (T, offset + T)
                mask = causal if mask is None else mask & causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))
