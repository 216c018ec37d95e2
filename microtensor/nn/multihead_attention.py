"""nn.MultiheadAttention: torch's module, with torch's parameter names, so that a torch
state_dict loads and gives torch's outputs and gradients.

    mha = nn.MultiheadAttention(embed_dim=64, num_heads=4, batch_first=True)
    out, weights = mha(x, x, x)                           # (B, T, 64), (B, T, T)
    out, _ = mha(x, x, x, need_weights=False)             # the fused attention kernel

The steps are torch's multi_head_attention_forward, on the public ops:
  1. project:  q = query @ Wq^T + bq, k = key @ Wk^T + bk, v = value @ Wv^T + bv, with
     Wq, Wk, Wv the three row blocks of in_proj_weight (or q/k/v_proj_weight when kdim or
     vdim differ from embed_dim);
  2. add_bias_kv / add_zero_attn: one more key and value (a learned one, a zero one);
  3. split heads: (B, T, E) -> (B, nh, T, hs);
  4. attend: softmax(q @ k^T / sqrt(hs) + mask) @ v: with need_weights=False this is
     F.scaled_dot_product_attention (one fused node); with need_weights=True the weights
     are computed explicitly (as torch does), since they are returned;
  5. merge heads and project out: out_proj.

Masks follow torch's MultiheadAttention, which is the opposite of F.scaled_dot_product_attention
for bool masks: True means NOT allowed to attend. A float mask is added to the scores.
attn_mask is (L, S) or (B * num_heads, L, S); key_padding_mask is (B, S) (True = a pad
key to ignore). is_causal is a hint that needs attn_mask too: with need_weights=False and no
key_padding_mask it replaces the mask with the kernel's own causal one.
"""
import math

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, ShapeError
from microtensor.nn import functional as F
from microtensor.nn import init
from microtensor.nn.functional import DtypeError
from microtensor.nn.layers import Linear, _parameter, _size
from microtensor.nn.module import Module
from microtensor.ops.creation_extra import _check_device

__all__ = ["MultiheadAttention", "canonical_mask"]


def canonical_mask(mask, name, dtype):
    """mask as an additive float mask of `dtype` (0 = attend, -inf = masked), or None:
    a bool mask's True entries become -inf (torch's F._canonical_mask); a float mask is
    kept (cast to dtype), so a learned float mask still takes its gradient."""
    if mask is None:
        return None
    if isinstance(mask, np.ndarray):
        mask = _core.from_numpy(mask)
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a Tensor (bool or float), got {type(mask).__name__}")
    if mask.dtype == np.bool_:
        return _core.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))
    if not mask.is_floating_point():
        raise DtypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    return mask if mask.dtype == dtype else mask.to(dtype)


class MultiheadAttention(Module):
    """out = concat(head_1, ..., head_nh) @ W_o^T + b_o,
    head_i = softmax(q_i @ k_i^T / sqrt(hs) + mask) @ v_i   (torch's nn.MultiheadAttention)

    Parameters (torch's names): in_proj_weight (3E, E) and in_proj_bias (3E,), or
    q_proj_weight (E, E), k_proj_weight (E, kdim), v_proj_weight (E, vdim) when kdim or
    vdim differ from embed_dim; bias_k, bias_v (1, 1, E) with add_bias_kv; out_proj
    (a Linear E -> E). Initialised as torch: xavier_uniform_ projections, zero biases,
    xavier_normal_ bias_k / bias_v."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        super().__init__()
        _check_device(device)
        embed_dim, num_heads = _size(embed_dim, "embed_dim"), _size(num_heads, "num_heads")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise ShapeError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
                             f"and num_heads={num_heads}")
        if isinstance(dropout, bool) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout}")
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else _size(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else _size(vdim, "vdim")
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        # registered in torch's order, so state_dict() lists the keys as torch does
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = _parameter((embed_dim, embed_dim), dtype)
            self.k_proj_weight = _parameter((embed_dim, self.kdim), dtype)
            self.v_proj_weight = _parameter((embed_dim, self.vdim), dtype)
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = _parameter((3 * embed_dim, embed_dim), dtype)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = _parameter((3 * embed_dim,), dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype)
        if add_bias_kv:
            self.bias_k = _parameter((1, 1, embed_dim), dtype)
            self.bias_v = _parameter((1, 1, embed_dim), dtype)
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    # -- forward --------------------------------------------------------------------------
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """(attn_output, attn_weights or None).

        query (L, B, E), key (S, B, kdim), value (S, B, vdim) ((B, L, E) ... with
        batch_first), or unbatched (L, E), (S, kdim), (S, vdim). attn_output has query's
        shape; attn_weights (B, L, S) averaged over heads, (B, nh, L, S) with
        average_attn_weights=False ((L, S) / (nh, L, S) unbatched)."""
        batched, B, L, S = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        E, nh, hs = self.embed_dim, self.num_heads, self.head_dim
        dtype = query.dtype
        key_padding_mask = canonical_mask(key_padding_mask, "key_padding_mask", dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                               "Transformer module method `generate_square_subsequent_mask` to "
                               "create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None                  # the kernel's own causal mask stands for it
        else:
            attn_mask = canonical_mask(attn_mask, "attn_mask", dtype)
            if key_padding_mask is not None:
                is_causal = False             # the merged mask is no longer causal

        # self-attention (query is key is value) projects once; decided before any reshape
        same_kv = key is value
        same_qk = same_kv and query is key
        if batched:
            batch_first = self.batch_first
        else:                                 # one sequence: (T, E) -> (1, T, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            batch_first = True
        seq = 1 if batch_first else 0         # the sequence dim of (B, T, E) or (T, B, E)
        q, k, v = self._in_projection(query, key, value, same_qk, same_kv)

        extra = 0                             # keys added after the S given ones
        if self.bias_k is not None:
            shape = (B, 1, E) if batch_first else (1, B, E)
            k = _core.cat([k, self.bias_k.expand(*shape)], seq)
            v = _core.cat([v, self.bias_v.expand(*shape)], seq)
            extra += 1
        if self.add_zero_attn:
            zeros = _core.zeros((B, 1, E) if batch_first else (1, B, E), dtype=dtype)
            k, v = _core.cat([k, zeros], seq), _core.cat([v, zeros], seq)
            extra += 1
        q, k, v = (self._heads(t, batch_first) for t in (q, k, v))     # (B, nh, T, hs)
        mask = self._merge_masks(attn_mask, key_padding_mask, B, L, S, extra)
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            # the weights are returned, so they are computed as torch does: explicitly
            scores = _core.matmul(q * math.sqrt(1.0 / hs), k.transpose(-2, -1))   # (B, nh, L, S')
            if mask is not None:
                scores = scores + mask
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, dropout_p)
            o = _core.matmul(weights, v)                                      # (B, nh, L, hs)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                               is_causal=is_causal)        # (B, nh, L, hs)
            weights = None

        # merge heads: the kernel's output lies as (B, L, nh, hs), so batch first is a view
        if batch_first:
            o = o.transpose(1, 2).reshape(B, L, E)
        else:
            o = o.permute(2, 0, 1, 3).reshape(L, B, E)
        # torch calls F.linear with out_proj's tensors (not out_proj itself: no hooks run)
        out = F.linear(o, self.out_proj.weight, self.out_proj.bias)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)                                  # (B, L, S')
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _in_projection(self, query, key, value, same_qk, same_kv):
        """q, k, v, each (B, T, E) or (T, B, E) as its input lies (torch's
        _in_projection_packed / _in_projection)."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight                                        # (3E, E)
            if same_qk:                                                    # self-attention
                qkv = F.linear(query, w, b)                                # (.., 3E)
                return qkv[..., :E], qkv[..., E:2 * E], qkv[..., 2 * E:]
            if same_kv:                                                    # encoder-decoder
                kv = F.linear(key, w[E:], None if b is None else b[E:])    # (.., 2E)
                return F.linear(query, w[:E], bq), kv[..., :E], kv[..., E:]
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _heads(self, t, batch_first):
        """(B, T, E) or (T, B, E) -> (B, nh, T, hs), a view where one exists."""
        nh, hs = self.num_heads, self.head_dim
        if batch_first:
            B, T = t.shape[0], t.shape[1]
            return t.reshape(B, T, nh, hs).transpose(1, 2)
        T, B = t.shape[0], t.shape[1]
        return t.reshape(T, B, nh, hs).permute(1, 2, 0, 3)

    def _merge_masks(self, attn_mask, key_padding_mask, B, L, S, extra):
        """One additive mask broadcastable to (B, nh, L, S + extra), or None: attn_mask
        (L, S) or (B * nh, L, S) plus key_padding_mask (B, S) as (B, 1, 1, S), each padded
        with `extra` zero columns for the keys add_bias_kv / add_zero_attn appended."""
        mask = None
        if attn_mask is not None:
            if attn_mask.ndim == 3:
                attn_mask = attn_mask.reshape(B, self.num_heads, L, S)
            mask = F.pad(attn_mask, (0, extra)) if extra else attn_mask
        if key_padding_mask is not None:
            pad = key_padding_mask.reshape(B, 1, 1, S)
            pad = F.pad(pad, (0, extra)) if extra else pad
            mask = pad if mask is None else mask + pad
        return mask

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask):
        """(batched, B, L, S), or a ShapeError naming what does not fit (torch's
        _mha_shape_check and the size checks of multi_head_attention_forward)."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"MultiheadAttention: {name} must be a Tensor, got "
                                f"{type(t).__name__}")
        nd = query.ndim
        if nd not in (2, 3):
            raise ShapeError(f"MultiheadAttention: query should be unbatched 2-D or batched 3-D, "
                             f"got a {nd}-D query of shape {query.shape}")
        what = "batched (3-D)" if nd == 3 else "unbatched (2-D)"
        if key.ndim != nd or value.ndim != nd:
            raise ShapeError(f"MultiheadAttention: for {what} query, key and value must be {nd}-D, "
                             f"got shapes {key.shape} and {value.shape}")
        if key_padding_mask is not None and key_padding_mask.ndim != nd - 1:
            raise ShapeError(f"MultiheadAttention: for {what} query, key_padding_mask must be None "
                             f"or {nd - 1}-D, got shape {key_padding_mask.shape}")
        if attn_mask is not None and attn_mask.ndim not in (2, 3):
            raise ShapeError(f"MultiheadAttention: attn_mask must be None, 2-D or 3-D, got shape "
                             f"{attn_mask.shape}")
        seq = (1 if self.batch_first else 0) if nd == 3 else 0
        L, S = query.shape[seq], key.shape[seq]
        B = query.shape[1 - seq] if nd == 3 else 1
        if query.shape[-1] != self.embed_dim:
            raise ShapeError(f"MultiheadAttention: was expecting embedding dimension of "
                             f"{self.embed_dim}, but got query of shape {query.shape}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ShapeError(f"MultiheadAttention: key and value must end in kdim={self.kdim} and "
                             f"vdim={self.vdim}, got shapes {key.shape} and {value.shape}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ShapeError(f"MultiheadAttention: key's sequence and batch dims {key.shape[:-1]} "
                             f"do not match value's {value.shape[:-1]}")
        if nd == 3 and key.shape[1 - seq] != B:
            raise ShapeError(f"MultiheadAttention: query {query.shape} and key {key.shape} have "
                             f"different batch sizes (batch_first={self.batch_first})")
        if attn_mask is not None:
            want = (L, S) if attn_mask.ndim == 2 else (B * self.num_heads, L, S)
            if tuple(attn_mask.shape) != want:
                raise ShapeError(f"MultiheadAttention: the shape of the {attn_mask.ndim}-D attn_mask "
                                 f"is {tuple(attn_mask.shape)}, but should be {want}")
        if key_padding_mask is not None:
            want = (B, S) if nd == 3 else (S,)
            if tuple(key_padding_mask.shape) != want:
                raise ShapeError(f"MultiheadAttention: key_padding_mask has shape "
                                 f"{tuple(key_padding_mask.shape)}, but should be {want} "
                                 "(batch, source length)")
        return nd == 3, B, L, S
