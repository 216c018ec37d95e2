"""Multi-head attention: self or cross, causal or not, optional RoPE and KV cache."""
import numpy as np

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F

from models.config import check_heads
from models.positional import RotaryEmbedding


class KVCache:
    """The keys and values a MultiHeadAttention has seen so far, for generation.

    Self-attention writes the new tokens' k and v into buffers made once for `capacity`
    positions (GPT.generate passes block_size; without one, a full buffer is doubled)
    and attends to views of the filled part: a generated token copies its own k and v
    in, never the whole cache (concatenating it each step copied every cached position,
    in every layer, for every token). Cross-attention projects the (fixed) context once
    and reuses it. `length` is the number of cached positions, which is also the
    position of the next token (RoPE's offset).
    """

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.k = None  # (B, nh, T_cached, hs): a view of the buffer below
        self.v = None  # (B, nh, T_cached, hs)
        self._k_buf = self._v_buf = None   # (B, nh, capacity, hs) arrays

    @property
    def length(self):
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        """Add the new positions' keys and values; return all of them."""
        if mt.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # a graph through the cache (differentiating a decode): concatenate, so each
            # step's k and v stay inputs of the graph
            if self.k is not None:
                k = mt.cat([self.k, k], dim=2)  # (B, nh, T_cached + T, hs)
                v = mt.cat([self.v, v], dim=2)
            self.k, self.v = k, v
            self._k_buf = self._v_buf = None
            return k, v
        start, end = self.length, self.length + k.shape[2]
        k_new, v_new = k.numpy(), v.numpy()                # (B, nh, T, hs), views
        buf = self._k_buf
        if (buf is None or end > buf.shape[2] or buf.dtype != k_new.dtype
                or buf.shape[:2] != k_new.shape[:2] or buf.shape[3] != k_new.shape[3]):
            self._grow(k_new, v_new, start, end)
        self._k_buf[:, :, start:end] = k_new
        self._v_buf[:, :, start:end] = v_new
        self.k = mt.from_numpy(self._k_buf[:, :, :end])   # (B, nh, T_cached + T, hs), a view
        self.v = mt.from_numpy(self._v_buf[:, :, :end])
        return self.k, self.v

    def _grow(self, k_new, v_new, start, end):
        """New buffers of capacity positions (or twice the old, or what end needs), the
        cached positions copied over."""
        old = self._k_buf
        size = max(end, self.capacity or 0, 2 * old.shape[2] if old is not None else 0)
        B, nh, _, hs = k_new.shape
        k_buf = np.empty((B, nh, size, hs), k_new.dtype)
        v_buf = np.empty((B, nh, size, v_new.shape[3]), v_new.dtype)
        if start:
            k_buf[:, :, :start] = self.k.numpy()
            v_buf[:, :, :start] = self.v.numpy()
        self._k_buf, self._v_buf = k_buf, v_buf

    def reset(self):
        """Forget the cached positions. The buffers are dropped too: a view handed out
        before (an earlier step's k) never sees later writes."""
        self.k = self.v = None
        self._k_buf = self._v_buf = None


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
