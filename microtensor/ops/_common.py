"""Helpers shared by the op families of ops/: argument checks (a tensor, a dim, dims), the
float32 default for integer input, and `declare_saved` (what a rule reads)."""
import builtins

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor


def _tensor(x, op, what="input"):
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}(): {what} must be a Tensor, got {type(x).__name__}")
    return x


def _dim(dim, ndim, op="dim"):
    """A dim in [-ndim, ndim) as a non-negative index (0-d tensors take -1 and 0)."""
    if isinstance(dim, Tensor):
        dim = dim.item()
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {dim!r}")
    n = builtins.max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {dim})")
    return int(dim) % n


def _dims(dim, ndim, op="dim"):
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (tuple, list)):
        out = tuple(_dim(d, ndim, op) for d in dim)
        if len(set(out)) != len(out):
            raise ValueError(f"{op}: dim {tuple(dim)} appears more than once")
        return out
    return (_dim(dim, ndim, op),)


def _float(a):
    """Float math on an integer or bool array happens in float32 (torch's default)."""
    return a if a.dtype.kind == "f" else a.astype(np.float32)


def _array(x):
    return x._data if isinstance(x, Tensor) else np.asarray(x)


def declare_saved(cls, *inputs, output=False, live=()):
    """Tell the engine which tensors `cls.backward` reads (input positions, the output),
    so an in-place change to one of them is caught and a change to any other is not;
    `live`: inputs only the create-graph rule reads (see the core's declare_saved)."""
    declare = getattr(_core, "declare_saved", None)
    if declare is not None:
        declare(cls, *inputs, output=output, live=live)
    return cls
