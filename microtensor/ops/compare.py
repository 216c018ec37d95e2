"""PyTorch's reductions and comparisons that have no gradient: any, all, count_nonzero,
isclose, allclose, equal, isinf, isposinf, isneginf, logical_xor, is_floating_point,
is_nonzero, nonzero, argwhere, unique, bincount, histc. Each reads the values and returns
a new tensor (or a Python value), never a graph node. Their registry rows close the file.
"""
import builtins

import numpy as np

from microtensor.core import _core
from microtensor.core._core import wrap, register_ops
from microtensor.ops._common import _tensor, _dim, _dims, _float, _array


def _reduce_bool(fn, op, input, dim, keepdim):
    t = _tensor(input, op)
    dims = _dims(dim, t._data.ndim, op) if dim is not None else None
    return wrap(np.asarray(fn(t._data, axis=dims, keepdims=keepdim), dtype=np.bool_))


def any(input, dim=None, keepdim=False):
    return _reduce_bool(np.any, "any", input, dim, keepdim)


def all(input, dim=None, keepdim=False):
    return _reduce_bool(np.all, "all", input, dim, keepdim)


def count_nonzero(input, dim=None):
    t = _tensor(input, "count_nonzero")
    dims = _dims(dim, t._data.ndim, "count_nonzero") if dim is not None else None
    return wrap(np.asarray(np.count_nonzero(t._data, axis=dims), dtype=np.int64))


def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return wrap(np.asarray(np.isclose(_array(input), _array(other), rtol=rtol, atol=atol,
                                      equal_nan=equal_nan)))


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """True when |input - other| <= atol + rtol |other| everywhere (a Python bool)."""
    _core.capture_read(input, "mt.allclose (a Python bool read from the values)")
    a, b = _array(_tensor(input, "allclose")), _array(_tensor(other, "allclose", "other"))
    try:
        np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise _core.ShapeError(f"allclose: shapes {a.shape} and {b.shape} cannot be "
                               "broadcast together") from None
    return builtins.bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def equal(input, other):
    """True when both have the same shape and the same values (a Python bool)."""
    _core.capture_read(input, "mt.equal (a Python bool read from the values)")
    a, b = _array(_tensor(input, "equal")), _array(_tensor(other, "equal", "other"))
    return a.shape == b.shape and builtins.bool(np.array_equal(a, b))


def isinf(input):
    return wrap(np.isinf(_array(input)))


def isposinf(input):
    return wrap(np.isposinf(_array(input)))


def isneginf(input):
    return wrap(np.isneginf(_array(input)))


def logical_xor(input, other):
    return wrap(np.logical_xor(_array(input), _array(other)))


def is_floating_point(input):
    return _tensor(input, "is_floating_point")._data.dtype.kind == "f"


def is_nonzero(input):
    _core.capture_read(input, "mt.is_nonzero (a Python bool read from the values)")
    t = _tensor(input, "is_nonzero")
    if t._data.size != 1:
        raise RuntimeError(f"Boolean value of Tensor with {t._data.size} values is ambiguous")
    return builtins.bool(t._data.reshape(()) != 0)


def nonzero(input, as_tuple=False):
    """Indices of the nonzero elements: (n, ndim) int64, or one index tensor per dim."""
    _core.capture_read(input, "mt.nonzero (a shape read from the values)")
    t = _tensor(input, "nonzero")
    a = t._data if t._data.ndim else t._data.reshape(1)
    idx = np.nonzero(a)
    if as_tuple:
        return tuple(wrap(i.astype(np.int64)) for i in idx)
    # (n, ndim) with the n indices of a dim side by side in memory: torch's strides (1, n)
    out = np.stack(idx).astype(np.int64).T if idx else np.zeros((0, 0), np.int64)
    if t._data.ndim == 0:
        out = out[:, :0]
    return wrap(out)


def argwhere(input):
    return nonzero(input)


def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    """The distinct values (sorted), with optional inverse indices and counts."""
    _core.capture_read(input, "mt.unique (a shape read from the values)")
    t = _tensor(input, "unique")
    axis = None if dim is None else _dim(dim, t._data.ndim, "unique")
    values, inverse, counts = np.unique(t._data, return_inverse=True, return_counts=True,
                                        axis=axis)
    out = [wrap(values)]
    if return_inverse:
        shape = t._data.shape if axis is None else (t._data.shape[axis],)
        out.append(wrap(inverse.reshape(shape).astype(np.int64)))
    if return_counts:
        out.append(wrap(counts.astype(np.int64)))
    return out[0] if len(out) == 1 else tuple(out)


def bincount(input, weights=None, minlength=0):
    _core.capture_read(input, "mt.bincount (a shape read from the values)")
    t = _tensor(input, "bincount")
    a = t._data
    if a.ndim != 1 or a.dtype.kind not in "iub":
        raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs, got "
                           f"shape {a.shape} and dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise ValueError("bincount: input must be non-negative")
    w = None if weights is None else _array(weights)
    out = np.bincount(a, weights=w, minlength=minlength)
    if w is None:
        out = out.astype(np.int64)
    elif w.dtype == np.float32:
        out = out.astype(np.float32)
    return wrap(out)


def histc(input, bins=100, min=0, max=0):
    """Counts in `bins` equal bins over [min, max] (the data's range when both are 0)."""
    t = _tensor(input, "histc")
    a = _float(t._data).reshape(-1)
    lo, hi = float(min), float(max)
    if lo == hi and a.size:
        lo, hi = float(a.min()), float(a.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError(f"histc: max ({hi}) must be larger than min ({lo})")
    counts, _ = np.histogram(a[(a >= lo) & (a <= hi)], bins=bins, range=(lo, hi))
    return wrap(counts.astype(a.dtype))


# ---- the registry rows: mt.<name>, and t.<name>(...) calling fn(t, ...) ----------------

register_ops("pointwise", globals(), "isclose isinf isposinf isneginf logical_xor")
register_ops("reduction", globals(), "any all count_nonzero bincount histc")
register_ops("reduction", globals(), "allclose equal is_floating_point is_nonzero",
             aliasing="none")                  # a Python bool, not a tensor
register_ops("index", globals(), "nonzero argwhere unique")
