"""What this microtensor runs on: `mt.show_config()`, and `mt.config()`, the same as a dict.

    >>> import microtensor as mt
    >>> mt.show_config()
    microtensor 0.1.0
      CPU            Intel(R) Xeon(R) Processor (2 logical CPUs, 2 physical cores, 2 available)
      kernel build   -O3 -g0 -fopenmp (baseline x86-64), OpenMP
      fused kernels  avx512; attention avx512 (CPU has AVX2+FMA: yes, AVX-512: yes; ...)
      BLAS (gemm)    oneMKL 2026.2, sequential, called by each of microtensor's threads
                     (auto: Intel CPU, oneMKL installed)
      BLAS (numpy)   numpy's OpenBLAS 0.3.31, SkylakeX kernel, 2 threads
      threads        2 (default: the physical cores; OMP_NUM_THREADS unset)
      OpenMP waiting OMP_WAIT_POLICY=unset (runtime default); GOMP_SPINCOUNT=10000 (microtensor ...)

Every line comes from `config()`, a dict, which the benchmarks print in their headers
and record in their JSON. Nothing here changes a setting. A top-level module (the face's
layer), since it reports on every layer below: the runtime, the kernels, the core's threads.
"""
import os
import sys
import platform

from microtensor.threads import OMP_DEFAULTS, omp_settings


def cpu_model():
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") or line.startswith("Model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_vendor():
    """'Intel', 'AMD', or the vendor string /proc/cpuinfo gives (else 'unknown')."""
    from microtensor.runtime._blas_choice import _cpu_vendor
    vendor = _cpu_vendor()
    return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)


def kernel_build():
    """How the extensions were compiled: the flags setup.py used (recorded at build time
    in microtensor/runtime/_build_config.py), and which build of the fused kernels runs."""
    try:
        from microtensor.runtime import _build_config as b
        build = {"compile_args": list(b.COMPILE_ARGS), "openmp": b.OPENMP, "native": b.NATIVE,
                 "compiler": b.COMPILER}
    except ImportError:   # built before setup.py recorded its flags
        build = {"compile_args": None, "openmp": None, "native": None, "compiler": None}
    from microtensor.runtime._blas_choice import _cpu_has_avx2_fma, _cpu_has_avx512
    from microtensor.kernels._choice import loaded_kernels
    fused, attention = loaded_kernels()
    build["fused_kernels"] = getattr(fused, "TARGET", "baseline")
    build["attention_kernels"] = getattr(attention, "TARGET", "baseline")
    build["cpu_has_avx2_fma"] = _cpu_has_avx2_fma()
    build["cpu_has_avx512"] = _cpu_has_avx512()
    build["MICROTENSOR_KERNELS"] = os.environ.get("MICROTENSOR_KERNELS", "auto")
    return build


def blas():
    """The OpenBLAS libraries loaded (threadpoolctl): which one microtensor's gemm calls
    (scipy's, through cython_blas) and numpy's, each with its version, kernel and threads."""
    from microtensor.threads import blas_info
    out = []
    for lib in blas_info():
        who = "numpy" if "numpy" in lib["path"] else "scipy" if "scipy" in lib["path"] else "other"
        version = None
        if lib["config"]:
            words = lib["config"].split()
            version = words[1] if len(words) > 1 and words[0] == "OpenBLAS" else None
        out.append({"user": who, "version": version, "corename": lib["corename"],
                    "num_threads": lib["num_threads"], "path": lib["path"]})
    return out


def _malloc_state():
    from microtensor.runtime import _malloc
    return _malloc.state


def gemm_blas():
    """The BLAS microtensor's gemm calls (chosen at import, microtensor/runtime/_blas_choice.py):
    name, version, path, request (MICROTENSOR_BLAS) and reason."""
    from microtensor.kernels import _blas
    return _blas.blas_choice()


def config():
    """Everything show_config() prints, as a dict."""
    from microtensor.core._core import get_num_threads
    from microtensor.threads import default_num_threads, physical_cores, _allowed_cpus
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "version": sys.modules["microtensor"].__version__,   # the package is imported: we are in it
        "cpu": cpu_model(),
        "vendor": cpu_vendor(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "cpus_available": len(_allowed_cpus()),
        "build": kernel_build(),
        "blas": blas(),
        "gemm": gemm_blas(),
        "malloc": dict(_malloc_state()),
        "threads": get_num_threads(),
        "default_threads": default_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "openmp_wait": omp_settings(),
        "loadavg": load,
    }


def _blas_line(lib):
    return (f"{lib['user']}'s OpenBLAS {lib['version'] or '?'}, {lib['corename']} kernel, "
            f"{lib['num_threads']} thread{'s' if lib['num_threads'] != 1 else ''}")


def _malloc_line(m):
    if not m:
        return "?"
    if m["tuned"]:
        return (f"freed memory kept for reuse (glibc mmap threshold "
                f"{m['mmap_threshold'] >> 20} MiB, trim threshold {m['trim_threshold'] >> 20} MiB;"
                " MICROTENSOR_MALLOC=default leaves glibc's defaults)")
    return f"allocator's defaults ({m['reason']})"


def format_config(c):
    """The lines show_config() prints, from a config() dict."""
    b = c["build"]
    flags = " ".join(b["compile_args"]) if b["compile_args"] is not None else "unknown (built " \
        "before setup.py recorded its flags)"
    target = "-march=native" if b["native"] else "baseline of the platform"
    choice = c.get("gemm") or {"name": "openblas"}
    if choice["name"] == "mkl":
        gemm_line = (f"oneMKL {choice['version']}, sequential, called by each of microtensor's "
                     f"threads ({choice['reason']})")
    else:
        gemm_line = "; ".join(_blas_line(lib) for lib in c["blas"] if lib["user"] != "numpy") \
            or "scipy's BLAS"
        if choice.get("reason"):
            gemm_line += f" ({choice['reason']})"
        if c.get("vendor") == "Intel" and "not installed" in (choice.get("reason") or ""):
            gemm_line += "\n                 " + mkl_hint()
    npy = [lib for lib in c["blas"] if lib["user"] == "numpy"]
    wait = "; ".join(f"{k}={v['value']} ({v['source']})" for k, v in c["openmp_wait"].items())
    return [
        f"microtensor {c['version']}",
        f"  CPU            {c['cpu']} ({c['vendor']}; {c['logical_cpus']} logical CPUs, "
        f"{c['physical_cores']} physical cores, {c['cpus_available']} available)",
        f"  kernel build   {flags} ({target}); OpenMP "
        f"{'on' if b['openmp'] else 'off' if b['openmp'] is not None else '?'}",
        f"  fused kernels  {b['fused_kernels']}; attention {b['attention_kernels']} "
        f"(CPU has AVX2+FMA: {'yes' if b['cpu_has_avx2_fma'] else 'no'}, AVX-512: "
        f"{'yes' if b.get('cpu_has_avx512') else 'no'}; "
        f"MICROTENSOR_KERNELS={b['MICROTENSOR_KERNELS']})",
        "  BLAS (gemm)    " + gemm_line,
        "  BLAS (numpy)   " + ("; ".join(_blas_line(lib) for lib in npy) or "not OpenBLAS"),
        f"  threads        {c['threads']} (default {c['default_threads']}: "
        + (f"OMP_NUM_THREADS={c['OMP_NUM_THREADS']})" if c["OMP_NUM_THREADS"]
           else "the physical cores)"),
        f"  OpenMP waiting {wait}",
        "  memory         " + _malloc_line(c.get("malloc")),
        f"  load average   {c['loadavg']}",
    ]


def mkl_hint():
    """What makes the products faster on an Intel CPU without oneMKL: the optional extra
    (oneMKL is installed on demand only, never on AMD, where it is not used)."""
    import sys
    pip = os.path.join(os.path.dirname(sys.executable), "pip")
    rel = os.path.relpath(pip)
    pip = pip if rel.startswith("..") else rel
    return (f"oneMKL makes the products faster on this Intel CPU: {pip} install mkl "
            f"(or pip install \"microtensor[mkl]\"); docs/BENCHMARKS.md has the figures")


def show_config(file=None):
    """Print the CPU, the kernel build, the BLAS, the threads and OpenMP's waiting policy."""
    print("\n".join(format_config(config())), file=file)


__all__ = ["show_config", "config", "cpu_model", "cpu_vendor", "kernel_build", "blas", "gemm_blas",
           "OMP_DEFAULTS"]
