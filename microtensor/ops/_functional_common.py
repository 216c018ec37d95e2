"""The helpers that F's fused ops share: argument checks (float tensors of one dtype,
the `reduction` option), the dtype error they raise, array plumbing (contiguous
copies, private index copies, upstream gradients in the right shape and dtype), the
thread count a kernel of a given size gets. The loader that picks the build of the
kernels (AVX-512, AVX2+FMA or baseline) is microtensor.kernels._choice's, imported here;
`microtensor.ops._kernels` loads the kernels once and holds them as `fused` and
`attention`; the op modules read them there.
"""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor
from microtensor.core.dtypes import KERNEL_FLOATS

# Which tensors each rule reads in backward (the version check of in-place changes looks
# at these only, as torch checks the tensors it saved): input positions, and the output.
declare_saved = _core.declare_saved


# the CPU's features and the choice of kernel build live with the engine's other
# import-time choices (microtensor/runtime/); F loads the chosen pair
from microtensor.runtime._blas_choice import (  # noqa: E402,F401  (names the tests and benchmarks read)
    _cpu_features, _cpu_has_avx2_fma, _cpu_has_avx512,
)
from microtensor.kernels._choice import (  # noqa: E402,F401
    KERNEL_BUILDS, _kernel_request, _import_build, kernel_builds_here, _load_kernels,
)


# ---- small helpers -----------------------------------------------------------------

class DtypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype. Both a TypeError (Python's word for it) and a
    RuntimeError (what torch raises for a dtype its kernel does not take), as ShapeError
    is both a ValueError and a RuntimeError."""


def _tensor(x, what):
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a microtensor Tensor, got {type(x).__name__}")
    return x


_F32, _F64 = KERNEL_FLOATS


def _float_array(x, what):
    """The float32/float64 array behind a tensor argument, or TypeError."""
    d = _tensor(x, what)._data
    dt = d.dtype
    # `is` first: numpy's dtypes of its own types are single objects (a fast test on
    # every call), `==` for the rest
    if dt is not _F32 and dt is not _F64 and dt != _F32 and dt != _F64:
        raise DtypeError(f"{what} must be a floating tensor (float32 or float64), got {d.dtype}")
    return d


def _same_dtype(op, **arrays):
    """All given arrays share one float dtype (torch refuses to mix them too)."""
    items = [(k, a) for k, a in arrays.items() if a is not None]
    dt = items[0][1].dtype
    for k, a in items[1:]:
        if a.dtype is not dt and a.dtype != dt:
            names = ", ".join(f"{k}: {a.dtype}" for k, a in items)
            raise DtypeError(f"{op}: expected all tensors to have the same dtype, got {names}")


def _contig(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _owned_indices(idx):
    """A private int64 copy of an index array, flat (M,). Backward reads the indices
    again, after any amount of user code: a view of the caller's tensor could by then
    hold other (or out-of-range) values, so the node keeps its own copy (the indices
    are small next to the activations they pick)."""
    return np.array(idx, dtype=np.int64, copy=True, order="C").reshape(-1)


def _grad_as(g, shape, dtype):
    """An upstream gradient as a C-contiguous array of this shape and dtype (the engine
    may hand us a broadcast view or another float dtype)."""
    g = np.asarray(g)
    if g.dtype != dtype or not g.flags.c_contiguous:
        g = np.ascontiguousarray(g, dtype=dtype)
    return g.reshape(shape)


# Below these many elements one thread is faster than waking the others: kernels that
# compute a transcendental per element pay off sooner than those that only move memory.
_PARALLEL_MIN = 1 << 15
_PARALLEL_MIN_MEMORY_BOUND = 1 << 18


def _threads(work, memory_bound=False):
    return _core.get_num_threads() if work >= (
        _PARALLEL_MIN_MEMORY_BOUND if memory_bound else _PARALLEL_MIN) else 1


def _wants_grad(node, i):
    t = node.inputs[i]
    return t is not None and t.requires_grad


def _check_reduction(reduction):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
