"""Which BLAS is fastest on this machine for the products of a training step: the
libraries microtensor's gemm could call, side by side, at one thread.

Each candidate gets the same float32 operands, stored as the step stores them (a
Linear's weight (out, in) read transposed; dW reads the upstream gradient transposed),
through its C entry with the transposes as flags, the way microtensor/kernels/_common.pxd's
gemm calls its library:

  mt/OpenBLAS      microtensor.kernels._blas.gemm on scipy's bundled OpenBLAS (cython_blas)
  mt/oneMKL        microtensor.kernels._blas.gemm on libmkl_rt of the `mkl` wheel (sequential
                   layer), when installed
  scipy-openblas32 the newer OpenBLAS of the `scipy-openblas32` wheel, when installed
                   (cblas through ctypes: about 2 us more a call than the others)
  BLIS             the `blis` wheel's gemm (through its Python entry), when installed
  numpy            numpy's matmul (its own OpenBLAS), held to the same thread count
  torch            torch.mm (oneMKL inside PyTorch), when installed

Rounds alternate the candidates (median of --repeats). Per config, the last row is
the step's products summed with their counts: what the step would spend in gemm.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_blas.py --configs tiny,cpu
"""
import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from bench_matmul import operands, dims  # noqa: E402

import numpy as np  # noqa: E402

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_CBLAS_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                    ctypes.c_void_p, ctypes.c_int]


def _cblas(path, symbol, threads_symbol=None):
    """A cblas_sgemm from a shared library, held to one thread, or None."""
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        fn = getattr(lib, symbol)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, _CBLAS_ARGS
    if threads_symbol and hasattr(lib, threads_symbol):
        getattr(lib, threads_symbol)(1)
    fn._lib = lib
    return fn


def candidates():
    """{name: cblas_sgemm or a Python gemm} for every library found."""
    found = {}
    try:
        import scipy_openblas32
        found["scipy-openblas32 " + scipy_openblas32.__version__] = _cblas(
            os.path.join(scipy_openblas32.get_lib_dir(),
                         "lib" + scipy_openblas32.get_library() + ".so"),
            "scipy_cblas_sgemm", "scipy_openblas_set_num_threads")
    except (ImportError, AttributeError):
        pass
    return {k: v for k, v in found.items() if v is not None}


def mt_gemms():
    """{name: BLAS name} of the libraries microtensor's own gemm can be pointed at here."""
    from microtensor.kernels import _blas
    out = {}
    for name, label in (("openblas", "mt/OpenBLAS"), ("mkl", "mt/oneMKL")):
        try:
            choice = _blas._use_for_benchmark(name)
        except ValueError:
            continue
        out[label + (f" {choice['version']}" if choice["version"] else "")] = name
    return out


def closures(s, libs, mts, torch, rng):
    a, b = operands(s, rng)
    m, k, n = s["m"], s["k"], s["n"]
    c = np.empty((m, n), np.float32)
    ta, tb = (_TRANS if s["ta"] else _NO_TRANS), (_TRANS if s["tb"] else _NO_TRANS)
    lda, ldb = a.shape[1], b.shape[1]
    a_view = a.T if s["ta"] else a
    b_view = b.T if s["tb"] else b
    from microtensor.kernels import _blas
    fns = {}

    def through(blas):
        def run():
            _blas._use_for_benchmark(blas)
            _blas.gemm(a_view, b_view, out=c)
        return run
    # the switch is a dict lookup and a pointer store: well under a microsecond a call
    for label, blas in mts.items():
        fns[label] = through(blas)
    for name, fn in libs.items():
        fns[name] = (lambda fn=fn: fn(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda,
                                      b.ctypes.data, ldb, 0.0, c.ctypes.data, n))
    try:
        import blis.py
        fns["BLIS"] = lambda: blis.py.gemm(a, b, out=c, trans1=s["ta"], trans2=s["tb"],
                                           alpha=1.0, beta=0.0)
    except ImportError:
        pass
    fns["numpy"] = lambda: np.matmul(a_view, b_view, out=c)
    if torch is not None:
        t_a, t_b = torch.from_numpy(a), torch.from_numpy(b)
        t_a = t_a.T if s["ta"] else t_a
        t_b = t_b.T if s["tb"] else t_b
        t_c = torch.from_numpy(c)
        fns["torch"] = lambda: torch.mm(t_a, t_b, out=t_c)
    return fns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny,cpu", help="comma-separated config names")
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (lm_head's width)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.02)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--allow-busy", action="store_true",
                   help="time even when the 1-minute load average is above 0.3 (a dry run)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = p.parse_args(argv)

    C.check_quiet(args.allow_busy, "bench_blas.py")
    torch = None if args.no_torch else C.try_import_torch()
    C.setup_threads(1, torch)
    info = C.machine_info(1, torch)
    C.print_machine(info)
    libs, mts = candidates(), mt_gemms()
    rng = np.random.default_rng(0)
    record = {"bench": "blas", "machine": info, "configs": {}}
    for name in args.configs.split(","):
        cfg = C.CONFIGS[name]
        # (product, times per step): the linear layers' products, then attention's per
        # head (one (T, hs) @ (hs, T) and one (T, T) @ (T, hs) stand for all six)
        every = C.matmul_shapes(cfg, args.vocab)
        shapes = [(s, s["count"]) for s in every if s["batch"] is None]
        shapes += [(dict(s, batch=None), 3 * s["count"] * s["batch"])
                   for s in every if s["batch"] is not None][:2]
        rows, totals, engines = [], {}, None
        for s, per_step in shapes:
            times = C.alternate(closures(s, libs, mts, torch, rng), repeats=args.repeats,
                                min_time=args.min_time)
            engines = list(times)
            med = {e: C.median(ts) for e, ts in times.items()}
            for e in engines:
                totals[e] = totals.get(e, 0.0) + per_step * med[e]
            rows.append([s["name"], per_step, dims(s)] +
                        [f"{C.shape_flops(s) / med[e] / 1e9:.1f}" for e in engines])
        rows.append(["the step's products", "", ""] + [f"{totals[e] * 1e3:.2f} ms" for e in engines])
        print(f"\n## config {name}: GFLOP/s per product at 1 thread, median of {args.repeats}"
              f" (last row: ms per step in these products)\n")
        print(C.table(["product", "per step", "shape"] + engines, rows))
        record["configs"][name] = {"ms_per_step": {e: totals[e] * 1e3 for e in engines},
                                   "rows": rows}
    if args.json is not None:
        C.emit_json(record, args.json)
    return record


if __name__ == "__main__":
    main()
