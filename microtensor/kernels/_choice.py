"""Which build of the fused kernels runs: the widest this CPU runs (AVX-512, AVX2+FMA,
baseline), chosen once, when the functional layer (F) first loads them.

Apart from the BLAS choice (microtensor/runtime/_blas_choice.py), because the builds
import the gemm, whose module imports the BLAS choice: here, in the kernels' layer above
the runtime, the loader imports the builds and nothing below imports it back.
"""
from microtensor.runtime._blas_choice import _cpu_has_avx2_fma, _cpu_has_avx512

__all__ = ["KERNEL_BUILDS", "kernel_builds_here", "loaded_kernels"]

_loaded = {}        # the chosen (fused module, attention module), once loaded


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
    safe on any CPU, see microtensor/kernels/_kernel_target.pxi)."""
    import importlib
    try:
        pair = (importlib.import_module("microtensor.kernels." + fused),
                importlib.import_module("microtensor.kernels." + attention))
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
    chosen build is imported. The functional layer (F) calls it once, at its import."""
    request = _kernel_request()
    names = [b[0] for b in KERNEL_BUILDS]
    builds = KERNEL_BUILDS if request == "auto" else KERNEL_BUILDS[names.index(request):]
    for name, fused, attention, runs_here in builds:
        pair = runs_here() and _import_build(fused, attention)
        if pair:
            _loaded["kernels"] = pair
            return pair
    from microtensor.kernels import _fused
    from microtensor.kernels import _fused_attention
    _loaded["kernels"] = (_fused, _fused_attention)
    return _loaded["kernels"]


def loaded_kernels():
    """(fused module, attention module) that the functional layer (F) loaded (loading
    them now if it has not been imported yet)."""
    return _loaded.get("kernels") or _load_kernels()
