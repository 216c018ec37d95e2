"""F.scaled_dot_product_attention: one fused node over blocks of query rows, with a
bool or float mask (broadcast over batch dims without being expanded), is_causal,
dropout and a custom scale; the Backward node sits right above the forward function.
The kernels are read from `_kernels.attention` at call time: microtensor/ops/_kernels.py holds
the build chosen at import (and a test may swap it there).
"""
import math

import numpy as np

import microtensor.core._core as _core
from microtensor.kernels import _fused_attention
from microtensor.autograd.graph_rules import FusedNode
from microtensor.ops.activations import softmax
from microtensor.core._core import Tensor, wrap, needs_graph, attach, ShapeError
from microtensor.ops import _kernels
from microtensor.ops.index import repeat_interleave
from microtensor.ops._functional_common import (
    DtypeError, declare_saved, _float_array, _same_dtype, _threads,
    _wants_grad,
)


# ---- attention -------------------------------------------------------------------

# Query rows per block (one (block, Tk) buffer of scores per thread). Small blocks trim
# more of the causal triangle; larger ones make fewer, more efficient gemms. Measured at
# T = 64 and 256: 64 rows is best with is_causal, 128 without.
_ATTENTION_BLOCK_CAUSAL = 64
_ATTENTION_BLOCK = 128


def _attention_mask(attn_mask, Tq, Tk, dtype):
    """attn_mask as an additive float array (0 = attend, -inf = masked), at least 2-D."""
    m = attn_mask._data if isinstance(attn_mask, Tensor) else np.asarray(attn_mask)
    if m.dtype == np.bool_:
        m = np.where(m, dtype.type(0), dtype.type(-np.inf))
    elif m.dtype.kind == "f":
        m = m.astype(dtype, copy=False)
    else:
        raise DtypeError(f"scaled_dot_product_attention: attn_mask must be bool (True = attend) "
                        f"or float (added to the scores), got dtype {m.dtype}")
    if m.ndim < 2:
        m = m.reshape((1,) * (2 - m.ndim) + m.shape)
    if m.shape[-2] not in (1, Tq) or m.shape[-1] not in (1, Tk):
        raise ShapeError(f"scaled_dot_product_attention: attn_mask shape {m.shape} cannot be "
                         f"broadcast to the scores' shape (..., {Tq}, {Tk})")
    return m


def _mask_slabs(m, batch, Tq, Tk):
    """An additive mask broadcastable to batch + (Tq, Tk) as contiguous slabs (NM, Tq, Tk)
    plus the slab index of each flattened batch entry (BH,), without expanding the mask
    over batch dims it is broadcast along (a (B, 1, 1, Tk) padding mask stays B slabs)."""
    mb = m.shape[:-2]
    if len(mb) > len(batch) or np.broadcast_shapes(mb, batch) != tuple(batch):
        raise ShapeError(f"scaled_dot_product_attention: attn_mask shape {m.shape} cannot be "
                         f"broadcast to the scores' shape {tuple(batch) + (Tq, Tk)}")
    slabs = np.ascontiguousarray(np.broadcast_to(m, mb + (Tq, Tk))).reshape(-1, Tq, Tk)
    mb = (1,) * (len(batch) - len(mb)) + mb
    index = np.broadcast_to(np.arange(slabs.shape[0], dtype=np.int64).reshape(mb), batch)
    return slabs, np.ascontiguousarray(index).reshape(-1)


def _pairs(a, batch, T, d):
    """a (..., T, d), broadcast to batch + (T, d), as the kernels' (B1, B2, T, d) operand:
    a view where one exists (the last batch dim is B2, the others fold into B1), read at
    its strides, so the heads of a (B, T, 3C) projection are read where they lie. A copy
    only where the rows are not whole, ordered, non-overlapping runs of d elements (the
    kernels' rule: the step of a last dim of one element is never read)."""
    if a.shape != batch + (T, d):
        a = np.broadcast_to(a, batch + (T, d))
    b2 = batch[-1] if batch else 1
    a4 = a.reshape((math.prod(batch[:-1]), b2, T, d))     # a view unless the batch dims cannot fold
    item = a4.itemsize
    if (d > 1 and a4.strides[3] != item) or (
            T > 1 and (a4.strides[2] % item or a4.strides[2] < d * item)):
        a4 = np.ascontiguousarray(a4)
    return a4


def _zeros_as(a, fill=True):
    """Zeros of a (B1, B2, T, d) operand's shape, laid out as it lies: its first three
    dims in the order of their strides, each row contiguous (a head of a (B, T, nh, hs)
    array gets a gradient of that layout). fill=False: uninitialised, for an array the
    kernel writes whole."""
    order = sorted(range(3), key=lambda i: -abs(a.strides[i]))
    z = (np.zeros if fill else np.empty)(tuple(a.shape[i] for i in order) + (a.shape[3],), a.dtype)
    if order == [0, 1, 2]:
        return z
    return z.transpose((order.index(0), order.index(1), order.index(2), 3))   # order's inverse


def _output(batch, T, d, dtype):
    """(out as batch + (T, d), out as (B1, B2, T, d)). With two batch dims (B, nh) the
    output lies as (B, T, nh, d), as torch's: `y.transpose(1, 2)` is then (B, T, nh * d)
    in order, and the model's `.contiguous()` copies nothing."""
    b2 = batch[-1] if batch else 1
    if len(batch) == 2:
        out = np.empty((batch[0], T, b2, d), dtype).transpose(0, 2, 1, 3)
        return out, out
    out = np.empty(batch + (T, d), dtype)
    return out, out.reshape((math.prod(batch[:-1]), b2, T, d))


class AttentionBackward(FusedNode):
    """o = P @ v,  P = softmax(scale * q @ k^T + mask);
    dv = P^T @ g,  dP = g @ v^T,  dS = P * (dP - rowsum(dP * P)),
    dq = scale * dS @ k,  dk = scale * dS^T @ q,  dmask = dS   (kernel: attention_backward)"""

    def backward(self, g):
        q, k, v = self.q, self.k, self.v       # (B1, B2, Tq, hs), (B1, B2, Tk, hs), (B1, B2, Tk, hv)
        # each gradient laid out as its input lies (a head of (B, T, nh, hs) stays one), so
        # that the transpose and view before the attention give it back with no copy;
        # dq is written whole by the kernel (= dS @ k, row block by row block) when it runs
        runs = bool(self.BH * q.shape[2] * v.shape[3] and k.shape[2])
        dq, dk, dv = _zeros_as(q, fill=not runs or q.shape[3] == 0), _zeros_as(k), _zeros_as(v)
        want_dmask = len(self.inputs) > 3 and _wants_grad(self, 3)
        # NOTE: the mask's gradient is the whole (BH, Tq, Tk) matrix of dS; it exists only
        # when a float mask requires grad (a learned bias), never on the usual path
        dmask = np.zeros((self.BH, q.shape[2], k.shape[2]), q.dtype) if want_dmask else None
        self.into(g, dq, dk, dv, dmask)
        # each in the broadcast batch shape: the engine sums it to its input's own shape
        grads = [d.reshape(self.batch + d.shape[2:]) for d in (dq, dk, dv)]
        if len(self.inputs) > 3:                         # (BH, Tq, Tk) -> batch + (Tq, Tk)
            grads.append(dmask.reshape(self.batch + dmask.shape[1:]) if want_dmask else None)
        return tuple(grads)

    def into(self, g, dq, dk, dv, dmask=None):
        """The kernel: dq (zeros where it does not run), dk and dv (zeros) take the
        gradients for the upstream g, each array at its own strides."""
        q, k, v = self.q, self.k, self.v
        Tq, Tk, hv = q.shape[2], k.shape[2], v.shape[3]
        g = np.asarray(g)
        if g.dtype != q.dtype:
            g = g.astype(q.dtype)
        dout = _pairs(g, self.batch, Tq, hv)             # read at its strides, as q, k, v
        if not (dout.size and Tk):
            return
        scale, dq_k, dk_k = self.scale, dq, dk
        if q.shape[3] == 0:                              # empty dot products (see forward):
            q = np.zeros(q.shape[:3] + (1,), q.dtype)       # one zero column, scale 0,
            k = np.zeros(k.shape[:3] + (1,), k.dtype)       # dq and dk stay empty
            scale, dq_k, dk_k = 0.0, np.zeros_like(q), np.zeros_like(k)
        _kernels.attention.attention_backward(dq_k, dk_k, dv, dout, q, k, v, self.rowmax,
                                              self.logsum, self.slabs, self.index, self.has_mask,
                                              self.is_causal, scale,
                                              self.dropout_p, self.seed, self.block,
                                              min(_threads(self.BH * Tq * Tk * q.shape[3]),
                                                  self.BH), dmask)

    def composite(self, q, k, v, live_mask=None):
        """(from primitives) o = dropout(softmax(scale * q @ k^T + mask)) @ v"""
        batch, Tq, Tk = self.batch, self.q.shape[2], self.k.shape[2]
        dtype = self.q.dtype
        mask = None
        if self.has_mask and not (len(self.inputs) > 3 and self.inputs[3] is not None):
            mask = self.slabs[self.index].reshape(batch + (Tq, Tk))           # additive, constant
        keep = None
        if self.dropout_p > 0:
            keep = np.empty((self.BH, Tq, Tk), dtype=dtype)
            # the same counter-based draws in every build of the kernels
            _fused_attention.attention_dropout_mask(keep, self.seed, self.dropout_p)
            keep = keep.reshape(batch + (Tq, Tk))
        causal = np.tril(np.ones((Tq, Tk), dtype=bool)) if self.is_causal else None

        scores = _core.mul(_core.matmul(q, _core.transpose(k, -1, -2)), self.scale)   # (..., Tq, Tk)
        if live_mask is not None:
            scores = _core.add(scores, live_mask)
        elif mask is not None:
            scores = _core.add(scores, mask)
        if causal is not None:
            scores = _core.where(causal, scores, -np.inf)
        # a row with every key masked outputs zeros (the kernel's rule): give softmax a
        # finite row there and zero its output, so no NaN reaches any derivative
        dead = np.all(np.isneginf(scores._data), axis=-1, keepdims=True)
        if dead.any():
            scores = _core.where(dead, 0.0, scores)
        p = softmax(scores, -1)
        if dead.any():
            p = _core.where(dead, 0.0, p)
        if keep is not None:
            p = _core.mul(p, keep)
        return _core.matmul(p, v)


declare_saved(AttentionBackward, 0, 1, 2, 3)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """o = softmax(q @ k^T * scale + mask) @ v   (q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv))

    attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
    (..., Tq, Tk). is_causal: query i sees keys 0..i (top-left aligned, as torch).
    scale defaults to 1/sqrt(hs). A row with every key masked outputs zeros.
    enable_gqa: grouped-query attention, key and value with fewer heads (dim -3) than
    query, each kv head serving Hq / Hkv query heads in a row (torch's repeat_interleave)."""
    if enable_gqa:
        grouped = _grouped_query_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale)
        if grouped is not None:
            return grouped
    q = _float_array(query, "scaled_dot_product_attention query")
    k = _float_array(key, "scaled_dot_product_attention key")
    v = _float_array(value, "scaled_dot_product_attention value")
    _same_dtype("scaled_dot_product_attention", query=q, key=k, value=v)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ShapeError(f"scaled_dot_product_attention: query, key and value need at least 2 "
                         f"dims (..., T, head_dim), got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {q.shape}, key {k.shape} and value "
                         f"{v.shape} do not fit (q and k must share head_dim, k and v the "
                         "sequence length)")
    try:
        batch = q.shape[:-2]
        if k.shape[:-2] != batch or v.shape[:-2] != batch:
            batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ShapeError(f"scaled_dot_product_attention: batch dims of query {q.shape}, key "
                         f"{k.shape} and value {v.shape} cannot be broadcast together (key "
                         f"and value with fewer heads than query: enable_gqa=True)") from None
    if isinstance(dropout_p, bool) or not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if is_causal and attn_mask is not None:
        # torch raises RuntimeError here too
        raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask should not be "
                           "set when is_causal=True (pass one or the other, not both)")
    Tq, Tk, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = (1.0 / math.sqrt(hs) if hs else math.inf) if scale is None else float(scale)
    if attn_mask is not None:
        m2 = _attention_mask(attn_mask, Tq, Tk, q.dtype)
        slabs, index = _mask_slabs(m2, batch, Tq, Tk)
    else:
        slabs, index = np.zeros((1, 1, 1), q.dtype), np.zeros(1, np.int64)
    mask_input = isinstance(attn_mask, Tensor) and attn_mask.dtype != np.bool_
    inputs = (query, key, value, attn_mask) if mask_input else (query, key, value)
    out, node = _attend(q, k, v, tuple(batch), slabs, index, attn_mask is not None,
                        float(dropout_p), bool(is_causal), scale,
                        AttentionBackward if needs_graph(inputs) else None)
    out = wrap(out)
    if node is not None:
        # a float mask tensor is an input: it may take a gradient, and its slabs may be
        # views of it that backward reads (a bool mask is turned into a private array)
        attach(out, node, inputs)
    return out


def _grouped_query_attention(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """enable_gqa: query (..., Hq, Tq, hs) against key (..., Hk, Tk, hs) and value
    (..., Hv, Tk, hv), Hk and Hv dividing Hq; None where every head count is Hq (the
    plain call). Query head h reads key head h // (Hq / Hk), as torch's math backend,
    which repeat_interleaves key and value. Here, with Hk == Hv, nothing is repeated:
    the query heads are viewed as (..., Hk, group, Tq, hs) and key and value as
    (..., Hk, 1, Tk, hs), so each kv head is broadcast over its group of query heads
    (read where it lies; its gradient summed over the group, as a broadcast's is)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a Tensor, got "
                            f"{type(t).__name__}")
        if t.ndim < 3:
            raise IndexError(f"scaled_dot_product_attention: enable_gqa=True groups the heads "
                             f"at dim -3, but {name} has shape {tuple(t.shape)} (dimension out "
                             f"of range: expected at least 3 dims)")
    Hq, Hk, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if Hk == Hq and Hv == Hq:
        return None
    if Hk == 0 or Hv == 0 or Hq % Hk or Hq % Hv:
        raise ShapeError(f"scaled_dot_product_attention: number of heads in key ({Hk}) and "
                         f"value ({Hv}) must divide the number of heads in query ({Hq}) "
                         f"(enable_gqa=True; shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)})")
    if Hk != Hv:             # torch's own way: each repeated to Hq heads (copies)
        key = key if Hk == Hq else repeat_interleave(key, Hq // Hk, -3)
        value = value if Hv == Hq else repeat_interleave(value, Hq // Hv, -3)
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                            is_causal, scale)
    group = Hq // Hk
    lead = tuple(query.shape[:-3])
    q = _core.reshape(query, *lead, Hk, group, *query.shape[-2:])   # (..., Hk, group, Tq, hs)
    k = _core.unsqueeze(key, -3)                                   # (..., Hk, 1, Tk, hs)
    v = _core.unsqueeze(value, -3)                                 # (..., Hk, 1, Tk, hv)
    mask = attn_mask
    if mask is not None:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else np.shape(mask)
        if len(shape) >= 3 and shape[-3] in (1, Hq):       # its head dim split the same way
            split = (Hk, group) if shape[-3] == Hq else (1, 1)
            target = shape[:-3] + split + shape[-2:]
            mask = (_core.reshape(mask, *target) if isinstance(mask, Tensor)
                    else np.reshape(np.asarray(mask), target))
    out = scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale)
    return _core.reshape(out, *out.shape[:-4], Hq, *out.shape[-2:])  # (..., Hq, Tq, hv)


def _attend(q, k, v, batch, slabs, index, has_mask, dropout_p, is_causal, scale, node_type):
    """The forward kernel on checked arrays q (*batch, Tq, hs), k (*batch, Tk, hs), v
    (*batch, Tk, hv) (views of them where they are not), its mask as slabs: (out array,
    a node_type node holding what backward reads, or None when node_type is None)."""
    Tq, hs = q.shape[-2], q.shape[-1]
    Tk, hv = k.shape[-2], v.shape[-1]
    BH = math.prod(batch)
    q3, k3, v3 = _pairs(q, batch, Tq, hs), _pairs(k, batch, Tk, hs), _pairs(v, batch, Tk, hv)
    out, out3 = _output(batch, Tq, hv, q.dtype)           # (..., Tq, hv), (B1, B2, Tq, hv)
    rowmax = np.empty((BH, Tq), q.dtype)                  # each row's log-sum-exp as the
    logsum = np.empty((BH, Tq), q.dtype)                  # pair (max, log-sum), never added
    seed = int(_core.default_generator().integers(0, 2 ** 63)) if dropout_p > 0 else 0
    block = _ATTENTION_BLOCK_CAUSAL if is_causal else _ATTENTION_BLOCK
    if out3.size == 0 or Tk == 0:
        out3[...] = 0                                    # nothing to attend to
        rowmax[...] = 0
        logsum[...] = np.inf
    elif hs == 0:
        # an empty dot product: every score is 0 (plus the mask), as torch computes it;
        # the kernel runs on one zero column with scale 0 (no 0 * inf from 1/sqrt(0))
        _kernels.attention.attention_forward(out3, rowmax, logsum, np.zeros(q3.shape[:3] + (1,), q.dtype),
                                     np.zeros(k3.shape[:3] + (1,), q.dtype), v3, slabs, index,
                                     has_mask, is_causal, 0.0, dropout_p, seed, block, 1)
    else:
        _kernels.attention.attention_forward(out3, rowmax, logsum, q3, k3, v3, slabs, index,
                                     has_mask, is_causal, scale, dropout_p, seed, block,
                                     min(_threads(BH * Tq * Tk * hs), BH))
    if node_type is None:
        return out, None
    node = node_type()
    node.q, node.k, node.v = q3, k3, v3
    node.rowmax, node.logsum = rowmax, logsum
    node.slabs, node.index, node.has_mask = slabs, index, has_mask
    node.is_causal, node.scale, node.dropout_p, node.seed = is_causal, scale, dropout_p, seed
    node.batch, node.BH, node.block = batch, BH, block
    return out, node


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

_core.register_op("scaled_dot_product_attention", scaled_dot_product_attention, kind="fused", scope="F")


# ---- attention on views of one tensor: mt.compile's fused record -------------------------

def _view(flat, spec):
    """The view (offset in elements, shape, strides in bytes) of a flat array; numpy checks
    that it lies inside the array (ValueError otherwise)."""
    offset, shape, strides = spec
    return np.ndarray(shape, flat.dtype, buffer=flat, offset=offset * flat.itemsize,
                      strides=strides)


def _view_of(flat, spec, name, shape):
    """_view, its errors naming the view and the input."""
    try:
        return _view(flat, spec)
    except (ValueError, TypeError) as e:
        raise type(e)(f"attention_on_views: {name} as (offset, shape, strides) = {spec!r} is "
                      f"not a view inside the input of shape {shape} ({e})") from None


def _owner(a):
    """The array that owns a view's memory."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class ViewsAttentionBackward(AttentionBackward):
    """o = attention(q, k, v) for q, k, v views of one tensor x;  dx = dq, dk and dv,
    each written by the kernel where its view of x lies, zeros elsewhere
    (kernel: attention_backward)"""

    def backward(self, g):
        dtype = self.q.dtype
        dx = np.zeros(self.x_shape, dtype)
        flat = dx.reshape(-1)
        dq, dk, dv = (_pairs(_view(flat, spec), self.batch, spec[1][-2], spec[1][-1])
                      for spec in self.views)
        if self.out_layout is not None:        # the output was handed out as its whole buffer
            shape, strides = self.out_layout
            g = np.ascontiguousarray(g, dtype=dtype).reshape(-1)
            g = np.ndarray(shape, dtype, buffer=g, strides=strides)
        self.into(g, dq, dk, dv)
        return (dx,)

    def composite(self, x):
        """(from primitives) the calls the fused one stands for, on x"""
        return self.chain(x)


declare_saved(ViewsAttentionBackward, 0)


def attention_on_views(x, views, chain, out_as=None, dropout_p=0.0, is_causal=False, scale=None):
    """F.scaled_dot_product_attention(q, k, v) (no mask) for q, k, v that are views of
    one C-contiguous tensor x: `views` gives each as (offset in elements, shape, strides
    in bytes), the heads of a (B, T, 3C) projection read where they lie; `chain(x)` is
    the same result computed by the ops it stands for (the composite). The gradient of
    x is written by the kernel in one buffer: no slices, no copies, no additions.
    out_as: a shape to hand the output out as, its whole buffer reshaped ((B, T, nh * hv)
    for (B, nh) heads: the `transpose(1, 2).contiguous().view(B, T, C)` after attention),
    or None for the (..., Tq, hv) view F.scaled_dot_product_attention returns."""
    xd = _float_array(x, "attention_on_views input")
    if not xd.flags.c_contiguous:
        raise ValueError(f"attention_on_views: the input must be C-contiguous, got strides "
                         f"{xd.strides} for shape {xd.shape}")
    flat = xd.reshape(-1)
    q, k, v = (_view_of(flat, spec, name, xd.shape) for spec, name in zip(views, "qkv"))
    if not (q.ndim >= 2 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]):
        raise ShapeError(f"attention_on_views: views of shapes {q.shape}, {k.shape}, {v.shape} "
                         "are not q, k and v of one attention")
    if isinstance(dropout_p, bool) or not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    hs = q.shape[-1]
    scale = (1.0 / math.sqrt(hs) if hs else math.inf) if scale is None else float(scale)
    slabs, index = np.zeros((1, 1, 1), xd.dtype), np.zeros(1, np.int64)
    node_type = ViewsAttentionBackward if needs_graph((x,)) else None
    out, node = _attend(q, k, v, q.shape[:-2], slabs, index, False, float(dropout_p),
                        bool(is_causal), scale, node_type)
    result, layout = out, None
    if out_as is not None:
        root = out if out.base is None else out.base
        if root.base is not None or root.size != out.size or not root.flags.c_contiguous:
            raise ShapeError(f"attention_on_views: the output {out.shape} is not the whole of "
                             f"one buffer, so it cannot be handed out as {out_as}")
        result, layout = root.reshape(out_as), (out.shape, out.strides)
    result = wrap(result)
    if node is not None:
        if any(_owner(a) is not _owner(xd) for a in (node.q, node.k, node.v)):
            # backward writes the gradients where the kernel reads the views
            raise ShapeError(f"attention_on_views: views of shapes {q.shape}, {k.shape}, "
                             f"{v.shape} and strides {q.strides}, {k.strides}, {v.strides} "
                             "are not rows the kernels read in place")
        node.x_shape, node.views, node.chain, node.out_layout = xd.shape, views, chain, layout
        attach(result, node, (x,))
    return result
