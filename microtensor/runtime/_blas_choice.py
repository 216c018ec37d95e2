"""Which BLAS does microtensor's gemm call, chosen once, at import; and what the CPU
runs (its features, and the refusal of a kernel build it cannot run, refuse_kernel_build,
at the bottom). Which build of the fused kernels runs is microtensor/kernels/_choice.py's, which
reads the CPU's features here.

Every matrix product of the engine goes through one entry, `gemm` in
microtensor/kernels/_common.pxd, which calls a Fortran sgemm/dgemm through a pointer. This
module says which library that pointer points into:

  openblas  scipy's OpenBLAS, through scipy.linalg.cython_blas (always there)
  mkl       oneMKL's libmkl_rt, from the `mkl` wheel on PyPI (when installed)

MICROTENSOR_BLAS=auto (the default) takes oneMKL on an Intel CPU when the library is
there, and scipy's OpenBLAS otherwise; =openblas or =mkl asks for one. Why by vendor:
on the step's products at one thread, a 2-core Intel Xeon (Sapphire Rapids class) ran
oneMKL 2026.2 12-15% faster than scipy's OpenBLAS 0.3.30 in the cpu and mid configs
(benchmarks/bench_blas.py; docs/BENCHMARKS.md has the table), while on a 2-core AMD EPYC
(family 25, AVX-512) oneMKL was no faster, and 18% slower at mid (docs/BENCHMARKS.md,
"Which BLAS on AMD"). oneMKL is an optional dependency: `pip install "microtensor[mkl]"`.

oneMKL is asked for its sequential layer (microtensor runs its own OpenMP threads and
calls one single-threaded gemm per thread). If something else in the process already
loaded oneMKL with a threaded layer, its gemm would start threads of its own inside
ours: then oneMKL is not used, and `reason` says so.
"""
import ctypes
import ctypes.util
import glob
import os
import site
import sys
import warnings

CHOICES = ("auto", "openblas", "mkl")
_MKL_THREADING_SEQUENTIAL = 1
_MKL_INTERFACE_LP64 = 0

_loaded = {}        # keeps a chosen library loaded for the life of the process


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def find_mkl():
    """The path of oneMKL's single dynamic library (libmkl_rt), or None. The `mkl` wheel
    puts it in <prefix>/lib, beside the Python environment rather than inside a package."""
    prefixes = [sys.prefix, sys.base_prefix, getattr(site, "USER_BASE", None) or ""]
    for prefix in dict.fromkeys(p for p in prefixes if p):
        for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"):
            path = os.path.join(prefix, "lib", name)
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("mkl_rt")
    return found


def _open_mkl(path):
    """(library, version, reason): oneMKL opened with its sequential layer, or (None,
    None, why not)."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as e:
        return None, None, f"oneMKL at {path} did not load ({e})"
    try:
        lib.MKL_Set_Interface_Layer.restype = ctypes.c_int
        lib.MKL_Set_Threading_Layer.restype = ctypes.c_int
        interface = lib.MKL_Set_Interface_Layer(_MKL_INTERFACE_LP64)
        layer = lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, 256)
    except AttributeError as e:
        return None, None, f"{path} is not oneMKL's libmkl_rt ({e})"
    words = buf.value.decode(errors="replace").split()
    version = next((w.split("-")[0] for w in words if w[:1].isdigit()), "?")
    if layer != _MKL_THREADING_SEQUENTIAL:
        return None, version, ("oneMKL was already loaded with a threaded layer by another "
                               "library: its gemm would start threads inside microtensor's")
    if interface != _MKL_INTERFACE_LP64:
        return None, version, "oneMKL was already loaded with 64-bit integers (ILP64)"
    return lib, version, None


def _address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def choose(request=None):
    """The BLAS behind gemm, as a dict: name ('openblas' or 'mkl'), version, path,
    sgemm and dgemm (function addresses; 0 means scipy's cython_blas), request (what
    MICROTENSOR_BLAS asked for) and reason (why this one)."""
    if request is None:
        request = os.environ.get("MICROTENSOR_BLAS", "auto").strip().lower() or "auto"
    if request not in CHOICES:
        warnings.warn(f"MICROTENSOR_BLAS={request!r} is not one of {', '.join(CHOICES)}; "
                      "using auto", RuntimeWarning, stacklevel=2)
        request = "auto"
    scipy_blas = {"name": "openblas", "version": None, "path": None, "sgemm": 0, "dgemm": 0,
                  "request": request}
    if request == "openblas":
        return dict(scipy_blas, reason="MICROTENSOR_BLAS=openblas")
    vendor = _cpu_vendor()
    if request == "auto" and vendor != "GenuineIntel":
        return dict(scipy_blas, reason=f"auto: not an Intel CPU ({vendor})")
    path = find_mkl()
    if path is None:
        why = "oneMKL not installed (pip install mkl)"
        if request == "mkl":
            warnings.warn(f"MICROTENSOR_BLAS=mkl, but {why}: using scipy's OpenBLAS",
                          RuntimeWarning, stacklevel=2)
        return dict(scipy_blas, reason=f"{request}: {why}")
    lib, version, why_not = _open_mkl(path)
    if lib is None:
        if request == "mkl":
            warnings.warn(f"MICROTENSOR_BLAS=mkl, but {why_not}: using scipy's OpenBLAS",
                          RuntimeWarning, stacklevel=2)
        return dict(scipy_blas, reason=f"{request}: {why_not}")
    _loaded["mkl"] = lib
    reason = "MICROTENSOR_BLAS=mkl" if request == "mkl" else "auto: Intel CPU, oneMKL installed"
    return {"name": "mkl", "version": version, "path": path,
            "sgemm": _address(lib, "sgemm_"), "dgemm": _address(lib, "dgemm_"),
            "request": request, "reason": reason}


# ---- which build of the fused kernels ----------------------------------------------

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


def refuse_kernel_build(namespace, needs):
    """Replace every function a per-CPU build of the fused kernels exports with one that
    raises: called at the end of that module's import where the CPU lacks what the build
    was compiled for (`needs`), so a call (by hand, by pydoc, by a tool that walks the
    package) gets an exception instead of an unknown instruction. Plain Python on purpose:
    nothing here is compiled for the wider target."""
    module = namespace.get("__name__", "this kernel build")

    def refusing(name):
        def refused(*args, **kwargs):
            raise RuntimeError(
                f"{module}.{name} was compiled for CPUs with {needs}, which this CPU lacks; "
                f"microtensor loads the widest build this CPU runs by itself "
                f"(mt.show_config() names it)")
        refused.__name__ = refused.__qualname__ = name
        refused.__doc__ = f"Refused on this CPU: {module} needs {needs}."
        return refused

    for name, value in list(namespace.items()):
        if not name.startswith("__") and callable(value) and not isinstance(value, type):
            namespace[name] = refusing(name)


__all__ = ["choose", "find_mkl", "CHOICES", "refuse_kernel_build"]
