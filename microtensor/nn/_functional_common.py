"""The helpers that F's fused ops share: argument checks (float tensors of one dtype,
the `reduction` option), the dtype error they raise, array plumbing (contiguous
copies, private index copies, upstream gradients in the right shape and dtype), the
thread count a kernel of a given size gets, and the loader that picks the AVX2+FMA or
the baseline build of the kernels. `microtensor.nn.functional` loads the kernels once
and holds them as `_fused` and `_attention`; the op modules read them there.
"""
import numpy as np

import microtensor._core as _core
from microtensor._core import Tensor

# Which tensors each rule reads in backward (the version check of in-place changes looks
# at these only, as torch checks the tensors it saved): input positions, and the output.
declare_saved = _core.declare_saved


def _cpu_features():
    """The CPU's features as numpy found them at its import ({} where it cannot say)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return {}
    return features


def _cpu_has_avx2_fma():
    """Does this CPU run the AVX2+FMA build of the kernels?"""
    f = _cpu_features()
    return bool(f.get("AVX2")) and bool(f.get("FMA3"))


def _cpu_has_avx512():
    """Does this CPU run the AVX-512 build (F, BW, VL and DQ, with AVX2 and FMA)?"""
    f = _cpu_features()
    return _cpu_has_avx2_fma() and all(f.get(k) for k in ("AVX512F", "AVX512BW", "AVX512VL",
                                                          "AVX512DQ"))


# the builds of the fused kernels, widest first: (name, fused module, attention module,
# does the CPU run it?)
KERNEL_BUILDS = (
    ("avx512", "_fused_avx512", "_fused_attention_avx512", _cpu_has_avx512),
    ("avx2", "_fused_avx2", "_fused_attention_avx2", _cpu_has_avx2_fma),
    ("baseline", "_fused", "_fused_attention", lambda: True),
)


def _kernel_request():
    """MICROTENSOR_KERNELS: auto (the widest build the CPU runs), avx512, avx2 or
    baseline (the widest the CPU runs, up to the one named)."""
    import os
    import warnings
    request = os.environ.get("MICROTENSOR_KERNELS", "auto").strip().lower() or "auto"
    names = [b[0] for b in KERNEL_BUILDS]
    if request != "auto" and request not in names:
        warnings.warn(f"MICROTENSOR_KERNELS={request!r} is not one of auto, "
                      f"{', '.join(names)}; using auto", RuntimeWarning, stacklevel=3)
        request = "auto"
    return request


def _import_build(fused, attention):
    """(fused module, attention module) of one build, or None where this installation
    lacks it (another platform) or the build says this CPU cannot run it (each per-CPU
    build checks the CPU itself at import, with the compiler's own test; importing one is
    safe on any CPU, see microtensor/_kernel_target.pxi)."""
    import importlib
    try:
        pair = (importlib.import_module("microtensor." + fused),
                importlib.import_module("microtensor." + attention))
    except ImportError:
        return None
    if not all(getattr(m, "CPU_RUNS_THIS_BUILD", True) for m in pair):
        return None
    return pair


def kernel_builds_here():
    """[(name, fused module, attention module)] for every build of the kernels this CPU
    runs and this installation has, widest first (the tests and
    benchmarks/bench_kernels.py compare them)."""
    found = [(name, _import_build(fused, attention))
             for name, fused, attention, runs_here in KERNEL_BUILDS if runs_here()]
    return [(name, pair[0], pair[1]) for name, pair in found if pair is not None]


def _load_kernels():
    """The fused kernels: the widest build the CPU runs (AVX-512, AVX2+FMA, baseline), or
    no wider than MICROTENSOR_KERNELS names (to test or compare the builds). Only the
    chosen build is imported."""
    request = _kernel_request()
    names = [b[0] for b in KERNEL_BUILDS]
    builds = KERNEL_BUILDS if request == "auto" else KERNEL_BUILDS[names.index(request):]
    for name, fused, attention, runs_here in builds:
        pair = runs_here() and _import_build(fused, attention)
        if pair:
            return pair
    from microtensor import _fused, _fused_attention
    return _fused, _fused_attention


# ---- small helpers -----------------------------------------------------------------

class DtypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype. Both a TypeError (Python's word for it) and a
    RuntimeError (what torch raises for a dtype its kernel does not take), as ShapeError
    is both a ValueError and a RuntimeError."""


def _tensor(x, what):
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a microtensor Tensor, got {type(x).__name__}")
    return x


def _float_array(x, what):
    """The float32/float64 array behind a tensor argument, or TypeError."""
    d = _tensor(x, what)._data
    if d.dtype != np.float32 and d.dtype != np.float64:
        raise DtypeError(f"{what} must be a floating tensor (float32 or float64), got {d.dtype}")
    return d


def _same_dtype(op, **arrays):
    """All given arrays share one float dtype (torch refuses to mix them too)."""
    items = [(k, a) for k, a in arrays.items() if a is not None]
    dt = items[0][1].dtype
    for k, a in items[1:]:
        if a.dtype != dt:
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


# broadcasting is undone in one place, the core's unbroadcast()
_unbroadcast = _core.sum_to_shape
