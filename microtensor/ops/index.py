"""PyTorch's indexing, rearranging and sorting functions.

Most are compositions of the core's differentiable primitives (getitem, cat, expand,
permute, reshape), so their gradients come from rules that are already checked:
gather is an advanced index, repeat an expand plus a reshape. Scatter writes into a
copy and flip copies (as torch's), so each has its own small node.
"""
import builtins

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, Node, wrap, needs_graph, attach, register_ops
from microtensor.autograd.graph_rules import _wants, add_at as _add_at, DifferentiableRule
from microtensor.ops._common import _tensor, _dim, _dims, _array, declare_saved

# (values, indices), readable as .values / .indices, like torch.return_types
ValuesIndices = _core.MaxResult


# ---- gather / scatter ------------------------------------------------------------------

def _index_array(index, op):
    if isinstance(index, Tensor):
        index = index._data
    index = np.asarray(index)
    if index.dtype.kind not in "iu":
        raise TypeError(f"{op}(): Expected dtype int64 for index, got {index.dtype}")
    return index.astype(np.int64)          # a copy: later changes to the tensor do not leak in


def _along_dim_key(index, dim, size, op):
    """The advanced-index key that picks x[..., index[i, j, k], ...] along `dim`:
    index along `dim`, aranges on the other axes (torch's gather/scatter addressing)."""
    if index.size and (index.min() < -size or index.max() >= size):
        bad = index[(index < -size) | (index >= size)].flat[0]
        raise IndexError(f"{op}(): index {bad} is out of bounds for dimension {dim} with "
                         f"size {size}")
    key = []
    for axis, n in enumerate(index.shape):
        if axis == dim:
            key.append(index)
        else:
            shape = [1] * index.ndim
            shape[axis] = n
            key.append(np.arange(n).reshape(shape))
    return tuple(key)


def _check_index_shape(x_shape, index, dim, op, other=None):
    if index.ndim != len(x_shape) and not (index.ndim <= 1 and len(x_shape) <= 1):
        raise RuntimeError(f"{op}(): Index tensor must have the same number of dimensions as "
                           f"input tensor (index {index.shape}, input {x_shape})")
    for axis, n in enumerate(index.shape):
        if axis != dim and n > x_shape[axis]:
            raise RuntimeError(f"{op}(): Size does not match at dimension {axis}: index has "
                               f"size {n}, input has {x_shape[axis]} (index {index.shape}, "
                               f"input {x_shape})")
        if other is not None and n > other[axis]:
            raise RuntimeError(f"{op}(): index {index.shape} is larger than src {other} at "
                               f"dimension {axis}")


def gather(input, dim, index, sparse_grad=False):
    """out[i][j][k] = input[index[i][j][k]][j][k] (dim=0); out has index's shape."""
    t = _tensor(input, "gather")
    idx = _index_array(index, "gather")
    if t._data.ndim == 0:
        return _core.reshape(gather(_core.reshape(t, 1), 0, idx.reshape(-1)), *idx.shape)
    d = _dim(dim, t._data.ndim, "gather")
    _check_index_shape(t._data.shape, idx, d, "gather")
    return _core.getitem(t, _along_dim_key(idx, d, t._data.shape[d], "gather"))


def take_along_dim(input, indices, dim=None):
    """numpy's take_along_axis: indices broadcast against input except along `dim`."""
    t = _tensor(input, "take_along_dim")
    idx = _index_array(indices, "take_along_dim")
    if dim is None:
        return gather(_core.reshape(t, -1), 0, idx.reshape(-1))
    d = _dim(dim, t._data.ndim, "take_along_dim")
    if idx.ndim != t._data.ndim:
        raise RuntimeError(f"take_along_dim(): input and indices should have the same number "
                           f"of dimensions, but got {t._data.ndim} and {idx.ndim}")
    shape_x, shape_i = list(t._data.shape), list(idx.shape)
    shape_x[d] = shape_i[d] = 1
    try:
        common = list(np.broadcast_shapes(tuple(shape_x), tuple(shape_i)))
    except ValueError:
        raise _core.ShapeError(f"take_along_dim(): shapes {t._data.shape} and {idx.shape} "
                               "cannot be broadcast outside dim") from None
    x_target, i_target = list(common), list(common)
    x_target[d], i_target[d] = t._data.shape[d], idx.shape[d]
    if tuple(x_target) != t._data.shape:
        t = _core.expand(t, *x_target)
    return gather(t, d, np.broadcast_to(idx, tuple(i_target)))


def take(input, index):
    """input.flatten()[index], in index's shape."""
    t = _tensor(input, "take")
    idx = _index_array(index, "take")
    n = t._data.size
    return _core.getitem(_core.reshape(t, -1), _along_dim_key(idx.reshape(-1), 0, n, "take")
                         ).reshape(*idx.shape)


class ScatterBackward(DifferentiableRule):
    """y = x;  y[key] = src[src_key] (or += for scatter_add)
    dx = g (zero on the overwritten places for scatter),  dsrc[src_key] = g[key]"""

    def create_graph(self, g):
        """y = x;  y[key] = src[src_key] (or +=);  dx = g (0 where overwritten),  dsrc = g[key]"""
        dx = dsrc = None
        if _wants(self, 0):
            dx = g
            if not self.add:
                overwritten = np.zeros(tuple(g.shape), dtype=bool)
                overwritten[self.key] = True
                dx = _core.where(overwritten, 0.0, g)
        if _wants(self, 1):
            dsrc = _add_at(_core.getitem(g, self.key), self.src_key, self.src_shape, False)
        return (dx, dsrc)


declare_saved(ScatterBackward)              # keys are owned copies; no values needed


def _scatter(op, input, dim, index, src, add):
    t = _tensor(input, op)
    idx = _index_array(index, op)
    d = _dim(dim, t._data.ndim, op)
    src_is_tensor = isinstance(src, Tensor)
    src_array = src._data if src_is_tensor else np.asarray(src, dtype=t._data.dtype)
    _check_index_shape(t._data.shape, idx, d, op, src_array.shape if src_array.ndim else None)
    key = _along_dim_key(idx, d, t._data.shape[d], op)
    src_key = tuple(np.arange(n).reshape([n if a == i else 1 for a in range(idx.ndim)])
                    for i, n in enumerate(idx.shape))
    values = src_array[src_key] if src_array.ndim else src_array
    y = np.array(t._data, copy=True)
    if add:
        np.add.at(y, key, values)
    else:
        y[key] = values
    out = wrap(y)
    inputs = (t, src if src_is_tensor else None)
    if needs_graph(inputs):
        node = ScatterBackward()
        node.key, node.src_key, node.add = key, src_key, add
        node.src_shape = src_array.shape
        attach(out, node, inputs)
    return out


def scatter(input, dim, index, src=None, value=None, reduce=None):
    """A copy of input with out[index[i][j]][j] = src[i][j] (dim=0); `value` for a scalar."""
    if reduce is not None:
        if reduce != "add":
            raise NotImplementedError(f"scatter(reduce={reduce!r}): only 'add' is supported")
        return scatter_add(input, dim, index, src if src is not None else value)
    if (src is None) == (value is None):
        raise TypeError("scatter() needs exactly one of src and value")
    return _scatter("scatter", input, dim, index, value if src is None else src, add=False)


def scatter_add(input, dim, index, src):
    """A copy of input with out[index[i][j]][j] += src[i][j] (dim=0); repeats accumulate."""
    return _scatter("scatter_add", input, dim, index, src, add=True)


def _index_along(index, dim, shape, op):
    """index (1-D, one entry per slice along dim) spread to `shape`: the scatter index of
    index_add / index_fill."""
    idx = _index_array(index, op).reshape(-1)
    if len(idx) != shape[dim]:
        raise RuntimeError(f"{op}(): index has {len(idx)} entries but the source has "
                           f"{shape[dim]} slices along dim {dim}")
    view = [1] * len(shape)
    view[dim] = len(idx)
    return np.broadcast_to(idx.reshape(view), shape)


def index_add(input, dim, index, source, alpha=1):
    """out = input, then out[..., index[i], ...] += alpha * source[..., i, ...] along dim"""
    t = _tensor(input, "index_add")
    d = _dim(dim, t._data.ndim, "index_add")
    src = _core.mul(source, alpha) if alpha != 1 else source
    return scatter_add(t, d, _index_along(index, d, tuple(src.shape), "index_add"), src)


def index_fill(input, dim, index, value):
    """out = input with every slice index[i] along dim set to value"""
    t = _tensor(input, "index_fill")
    d = _dim(dim, t._data.ndim, "index_fill")
    idx = _index_array(index, "index_fill").reshape(-1)
    mask = np.zeros(t._data.shape[d], dtype=bool)
    mask[idx] = True
    view = [1] * t._data.ndim
    view[d] = len(mask)
    return _core.masked_fill(t, wrap(mask.reshape(view)), value)


def masked_select(input, mask):
    """The elements of input where mask is True (both broadcast), as a 1-D tensor."""
    _core.capture_read(input, "mt.masked_select (a shape read from the values)")
    t = _tensor(input, "masked_select")
    m = _array(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"masked_select: expected a bool mask, got {m.dtype}")
    shape = np.broadcast_shapes(t._data.shape, m.shape)
    if shape != t._data.shape:
        t = _core.expand(t, *shape)
    return _core.getitem(t, np.broadcast_to(m, shape).copy())


# ---- sorting ---------------------------------------------------------------------------

def _argsort(a, d, descending):
    """Stable argsort along d; descending keeps equal elements in their original order
    and puts NaN first (torch's order), ascending puts NaN last."""
    if not descending:
        return np.argsort(a, axis=d, kind="stable")
    n = a.shape[d]
    reversed_order = np.argsort(np.flip(a, d), axis=d, kind="stable")
    return (n - 1 - np.flip(reversed_order, d)).astype(np.int64)


def sort(input, dim=-1, descending=False, stable=False):
    """(values, indices) sorted along dim; values carry the gradient (a gather)."""
    t = _tensor(input, "sort")
    if t._data.ndim == 0:
        return ValuesIndices(t, wrap(np.zeros((), np.int64)))
    d = _dim(dim, t._data.ndim, "sort")
    idx = _argsort(t._data, d, descending).astype(np.int64)
    return ValuesIndices(gather(t, d, idx), wrap(idx))


def argsort(input, dim=-1, descending=False, stable=False):
    return sort(input, dim, descending, stable).indices


def msort(input):
    return sort(input, 0).values


def topk(input, k, dim=-1, largest=True, sorted=True):
    """(values, indices) of the k largest (or smallest) elements along dim."""
    t = _tensor(input, "topk")
    d = _dim(dim, t._data.ndim, "topk")
    n = t._data.shape[d] if t._data.ndim else 1
    k = int(k)
    if not 0 <= k <= n:
        raise RuntimeError(f"topk(): selected index k={k} out of range for dimension {d} of "
                           f"size {n}")
    if t._data.ndim == 0:
        return ValuesIndices(t, wrap(np.zeros((), np.int64)))
    idx = _argsort(t._data, d, descending=largest)
    idx = np.take(idx, np.arange(k), axis=d).astype(np.int64)
    return ValuesIndices(gather(t, d, idx), wrap(idx))


def kthvalue(input, k, dim=-1, keepdim=False):
    """(values, indices) of the k-th smallest element along dim (k counts from 1)."""
    t = _tensor(input, "kthvalue")
    d = _dim(dim, t._data.ndim, "kthvalue")
    n = t._data.shape[d] if t._data.ndim else 1
    if not 1 <= k <= n:
        raise RuntimeError(f"kthvalue(): selected number k={k} out of range for dimension {d}")
    values, indices = topk(t, k, d, largest=False)
    values = _core.contiguous(narrow(values, d, k - 1, 1))      # new memory, as torch
    indices = indices._data.take([k - 1], axis=d)
    if not keepdim:
        values, indices = _core.squeeze(values, d), indices.squeeze(d)
    return ValuesIndices(values, wrap(indices))


# ---- rearranging -----------------------------------------------------------------------

class FlipBackward(DifferentiableRule):
    """y = x.flip(dims);  dx = g.flip(dims)"""

    def create_graph(self, g):
        """y = x.flip(dims);  dx = g.flip(dims)"""
        return (flip(g, list(self.dims)),)


declare_saved(FlipBackward)


def flip(input, *dims, **kwargs):
    """Reverse the order along dims: a list, the dims as arguments (t.flip(0, 2)), or the
    keyword dims= (torch.flip(x, dims=[0])). A copy in the input's layout, as torch's
    (never a view with negative strides)."""
    t = _tensor(input, "flip")
    if kwargs:
        if set(kwargs) != {"dims"} or dims:
            raise TypeError(f"flip() got an unexpected argument: give dims as a list, as "
                            f"arguments or as dims=, once (got {sorted(kwargs)} and {dims})")
        dims = (kwargs["dims"],)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = _dims(list(dims), t._data.ndim, "flip")
    # astype(copy=True) keeps the input's order of dims in memory, with positive steps
    out = wrap(np.flip(t._data, dims).astype(t._data.dtype, copy=True))
    if needs_graph((t,)):
        node = FlipBackward()
        node.dims = dims
        attach(out, node, (t,))
    return out


def _new_memory(out, input):
    """`out`, or a contiguous copy of it where it shares the input's memory: for the ops
    torch always copies (roll, repeat, rot90) where a shortcut here (a shift of 0, one
    repeat) would hand back the input or a view of it."""
    if not np.may_share_memory(out._data, input._data):
        return out
    return out.clone() if out._data.flags.c_contiguous else _core.contiguous(out)


def fliplr(input):
    if _tensor(input, "fliplr").ndim < 2:
        raise RuntimeError("fliplr(): input must be at least 2-D")
    return flip(input, [1])


def flipud(input):
    if _tensor(input, "flipud").ndim < 1:
        raise RuntimeError("flipud(): input must be at least 1-D")
    return flip(input, [0])


def roll(input, shifts, dims=None):
    """Elements shifted along dims, wrapping around (two slices and a cat per dim)."""
    t = _tensor(input, "roll")
    if dims is None:
        if isinstance(shifts, (list, tuple)):
            if len(shifts) != 1:
                raise RuntimeError("roll(): with dims=None, shifts must be a single int")
            shifts = shifts[0]
        return _core.reshape(roll(_core.reshape(t, -1), shifts, 0), *t._data.shape)
    shifts = list(shifts) if isinstance(shifts, (list, tuple)) else [shifts]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if len(shifts) != len(dims):
        raise RuntimeError(f"roll(): shifts and dims must align, got {len(shifts)} shifts and "
                           f"{len(dims)} dims")
    out = t
    for shift, dim in zip(shifts, dims):
        d = _dim(dim, t._data.ndim, "roll")
        n = t._data.shape[d]
        s = int(shift) % n if n else 0
        if s == 0:
            continue
        head = (slice(None),) * d
        out = _core.cat([_core.getitem(out, head + (slice(n - s, None),)),
                         _core.getitem(out, head + (slice(0, n - s),))], d)
    return _new_memory(out, t)            # a copy even when nothing moved, as torch


def repeat(input, *sizes):
    """Tensor.repeat (numpy's tile): each dim repeated sizes[i] times, as whole blocks."""
    t = _tensor(input, "repeat")
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = tuple(sizes[0])
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < t._data.ndim:
        raise RuntimeError(f"repeat(): Number of dimensions of repeat dims {sizes} can not be "
                           f"smaller than number of dimensions of tensor ({t._data.ndim})")
    if builtins.any(s < 0 for s in sizes):
        raise ValueError(f"repeat(): repeats must be non-negative, got {sizes}")
    shape = (1,) * (len(sizes) - t._data.ndim) + t._data.shape
    # (1, s0, 1, s1, ...) -> expand (r0, s0, r1, s1, ...) -> (r0*s0, r1*s1, ...)
    interleaved = [v for s in shape for v in (1, s)]
    expanded = [v for r, s in zip(sizes, shape) for v in (r, s)]
    x = _core.expand(_core.reshape(t, *interleaved), *expanded)
    return _new_memory(_core.reshape(x, *[r * s for r, s in zip(sizes, shape)]), t)


def tile(input, *dims, **kwargs):
    """Repeat the whole tensor dims times (leading ones added as needed): tile(x, (2, 3)),
    t.tile(2, 3) or tile(x, dims=(2, 3))."""
    t = _tensor(input, "tile")
    if kwargs:
        if set(kwargs) != {"dims"} or dims:
            raise TypeError(f"tile() got an unexpected argument: give dims as a tuple, as "
                            f"arguments or as dims=, once (got {sorted(kwargs)} and {dims})")
        dims = (kwargs["dims"],)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = tuple(int(d) for d in dims)
    return repeat(t, (1,) * (t._data.ndim - len(dims)) + dims)


def repeat_interleave(input, repeats=None, dim=None, output_size=None):
    """Each element repeated `repeats` times along dim (flattened when dim is None)."""
    if repeats is None or isinstance(repeats, Tensor):
        _core.capture_read(input if repeats is None else repeats,
                           "mt.repeat_interleave (a shape read from the values)")
    if repeats is None:                     # torch.repeat_interleave(repeats)
        r = _index_array(input, "repeat_interleave")
        return wrap(np.repeat(np.arange(len(r)), r).astype(np.int64))
    t = _tensor(input, "repeat_interleave")
    if dim is None:
        t, d = _core.reshape(t, -1), 0
    else:
        d = _dim(dim, t._data.ndim, "repeat_interleave")
    n = t._data.shape[d] if t._data.ndim else 1
    if isinstance(repeats, (int, np.integer)) or (isinstance(repeats, Tensor) and repeats.numel() == 1
                                                  and repeats.ndim == 0):
        r = int(repeats)
        if r < 0:
            raise ValueError(f"repeat_interleave(): repeats must be non-negative, got {r}")
        index = np.repeat(np.arange(n), r)
    else:
        r = _index_array(repeats, "repeat_interleave")
        if r.shape != (n,):
            raise RuntimeError(f"repeat_interleave(): repeats must have the same size as input "
                               f"along dim ({n}), got shape {r.shape}")
        if r.size and r.min() < 0:
            raise ValueError("repeat_interleave(): repeats must be non-negative")
        index = np.repeat(np.arange(n), r)
    return _core.getitem(t, (slice(None),) * d + (index,))


def tensor_split(input, indices_or_sections, dim=0):
    """Split into n nearly equal parts (the first ones one larger), or at the indices."""
    t = _tensor(input, "tensor_split")
    d = _dim(dim, t._data.ndim, "tensor_split")
    n = t._data.shape[d]
    if isinstance(indices_or_sections, (int, np.integer)):
        k = int(indices_or_sections)
        if k <= 0:
            raise RuntimeError(f"tensor_split: number of sections must be larger than 0, got {k}")
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    else:
        cuts = [int(i) for i in indices_or_sections]
        bounds = [0] + cuts + [n]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        a = builtins.min(a, n)                   # indices past the end give empty parts
        b = builtins.max(builtins.min(b, n), a)
        parts.append(_core.getitem(t, (slice(None),) * d + (slice(a, b),)))
    return tuple(parts)


def rot90(input, k=1, dims=(0, 1)):
    """Rotate by 90 degrees k times in the plane of dims (from the first towards the second)."""
    t = _tensor(input, "rot90")
    if len(dims) != 2:
        raise RuntimeError(f"rot90: expected total rotation dims == 2, got {len(dims)}")
    d0, d1 = _dim(dims[0], t._data.ndim, "rot90"), _dim(dims[1], t._data.ndim, "rot90")
    if d0 == d1:
        raise RuntimeError(f"rot90: rotation dims must differ, got {dims}")
    k %= 4
    # torch's composition, so the strides are torch's too: a flip (a copy in the input's
    # layout), then a transpose of it (a view of that copy)
    if k == 1:
        return _core.transpose(flip(t, [d1]), d0, d1)
    if k == 2:
        return flip(t, [d0, d1])
    if k == 3:
        return _core.transpose(flip(t, [d0]), d0, d1)
    return _new_memory(t, t)                  # k = 0: a contiguous copy, as torch


def narrow(input, dim, start, length):
    t = _tensor(input, "narrow")
    d = _dim(dim, t._data.ndim, "narrow")
    n = t._data.shape[d]
    start = int(start)
    if start < 0:
        start += n
    if not 0 <= start <= n or length < 0 or start + length > n:
        raise IndexError(f"narrow(): start ({start}) + length ({length}) exceeds dimension "
                         f"size ({n})")
    return _core.getitem(t, (slice(None),) * d + (slice(start, start + length),))


def select(input, dim, index):
    t = _tensor(input, "select")
    d = _dim(dim, t._data.ndim, "select")
    n = t._data.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size "
                         f"{t._data.shape} at dimension {d}")
    return _core.getitem(t, (slice(None),) * d + (int(index),))


def unbind(input, dim=0):
    t = _tensor(input, "unbind")
    d = _dim(dim, t._data.ndim, "unbind")
    return tuple(select(t, d, i) for i in range(t._data.shape[d]))


def movedim(input, source, destination):
    t = _tensor(input, "movedim")
    src = [source] if isinstance(source, (int, np.integer)) else list(source)
    dst = [destination] if isinstance(destination, (int, np.integer)) else list(destination)
    if len(src) != len(dst):
        raise RuntimeError(f"movedim(): Invalid source or destination dims: source {src} and "
                           f"destination {dst} must have the same number of dims")
    n = t._data.ndim
    src, dst = [_dim(s, n, "movedim") for s in src], [_dim(s, n, "movedim") for s in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise RuntimeError("movedim(): repeated dim in source or destination")
    order = [a for a in range(n) if a not in src]
    for s, dd in sorted(zip(dst, src)):
        order.insert(s, dd)
    return _core.permute(t, *order)


moveaxis = movedim


def swapaxes(input, axis0, axis1):
    return _core.transpose(input, axis0, axis1)


swapdims = swapaxes


def t(input):
    """Transpose of a 2-D tensor; 0-D and 1-D tensors come back as they are."""
    x = _tensor(input, "t")
    if x._data.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is "
                           f"{x._data.ndim}D")
    return _core.transpose(x, 0, 1) if x._data.ndim == 2 else x


def diag(input, diagonal=0):
    """1-D -> a square matrix with it on the diagonal-th diagonal; 2-D -> that diagonal."""
    x = _tensor(input, "diag")
    if x._data.ndim == 2:
        return _core.diagonal(x, diagonal).clone()     # a copy, as torch's diag
    if x._data.ndim != 1:
        raise RuntimeError(f"diag(): matrix or a vector expected, got {x._data.ndim}-D")
    n, k = x._data.shape[0], int(diagonal)
    m = n + builtins.abs(k)
    # an index matrix into [x, 0]: position n (the zero) off the diagonal
    index = np.full((m, m), n, dtype=np.int64)
    i = np.arange(n)
    index[(i, i + k) if k >= 0 else (i - k, i)] = i
    padded = _core.cat([x, _core.zeros(1, dtype=x._data.dtype)], 0)
    return _core.getitem(padded, index)


def trace(input):
    x = _tensor(input, "trace")
    if x._data.ndim != 2:
        raise RuntimeError(f"trace(): expected a matrix, got a {x._data.ndim}-D tensor")
    return _core.sum(_core.diagonal(x))


# ---- the registry rows: mt.<name>, and t.<name>(...) calling fn(t, ...) ----------------

# (diagonal, a view, is the core's: ops/shape.pxi)
register_ops("index", globals(), """
    gather take_along_dim take scatter scatter_add index_add index_fill masked_select diag""")
register_ops("reduction", globals(), "sort argsort msort topk kthvalue trace")
register_ops("shape", globals(), "rot90 flip fliplr flipud roll tile repeat_interleave")
register_ops("shape", globals(), """
    tensor_split narrow select unbind movedim moveaxis swapaxes swapdims t""", aliasing="view")
register_ops("shape", globals(), "repeat", export=False)    # torch has no torch.repeat
