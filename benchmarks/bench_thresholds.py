"""Where a second thread starts to pay, kernel by kernel: the measurement behind each
kernel's parallel threshold (the *_PARALLEL_MIN constants beside the kernels).

For each kernel and each size (a power of two of elements, or of multiply-adds for gemm)
it times the kernel at 1 thread and at N threads (default: the physical cores), the two
interleaved, each timing the best of --repeats batches (the best, not the median: on a
shared machine the noise only ever adds), and prints the ratio N threads / 1 thread.
The threshold is the first size from which every ratio stays below 1.

    python benchmarks/bench_thresholds.py                  # every kernel
    python benchmarks/bench_thresholds.py --kernels gemm,gelu --threads 2

Each kernel applies its own threshold, so below it both columns run one thread (ratio
1.00). To measure below the thresholds, build with them off first (a scratch tree):

    MICROTENSOR_PARALLEL_MIN_SCALE=0 python setup.py build_ext --inplace

(every threshold is multiplied by that scale at compile time; 1 by default). Run it on a
quiet machine; the OpenMP waiting policy in
effect (microtensor's default, OMP_WAIT_POLICY=PASSIVE, unless set) is printed, since
the cost of a wake-up is what the threshold pays back.
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernels():
    import microtensor as mt  # noqa: F401  (the OpenMP defaults, before the extensions)
    from microtensor.kernels import _blas
    from microtensor.core import _core
    from microtensor.nn import functional as F
    from microtensor.optim import _adamw
    fused = F._kernels.fused
    f32 = np.float32
    rng = np.random.default_rng(0)

    def elementwise(kernel):
        def make(n):
            x = rng.standard_normal(n).astype(f32)
            out = np.empty_like(x)
            return lambda t: kernel(out, x, t)
        return make

    def rows(kernel, width=256):
        def make(n):
            x = rng.standard_normal((max(1, n // width), width)).astype(f32)
            out = np.empty_like(x)
            return lambda t: kernel(out, x, t)
        return make

    def layernorm(n, width=256):
        R = max(1, n // width)
        x = rng.standard_normal((R, width)).astype(f32)
        out, mean, rstd = np.empty_like(x), np.empty(R, f32), np.empty(R, f32)
        w, b = np.ones(width, f32), np.zeros(width, f32)
        return lambda t: fused.layernorm_forward(out, mean, rstd, x, w, b, 1e-5, t)

    def adam(n):
        p, g = rng.standard_normal(n).astype(f32), rng.standard_normal(n).astype(f32)
        m, v = np.zeros(n, f32), np.zeros(n, f32)
        return lambda t: _adamw.adam_step(p, g, m, v, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0,
                                          True, False, t)

    def gemm(n, m=64):
        # (m, k) @ (k, k): n multiply-adds = m * k * k, the shapes of a small linear layer
        k = max(1, int(round((n / m) ** 0.5)))
        a = rng.standard_normal((m, k)).astype(f32)
        b = rng.standard_normal((k, k)).astype(f32)
        out = np.empty((m, k), f32)
        return lambda t: _blas.gemm(a, b, out=out, num_threads=t)

    def core_add(n):
        a, b = rng.standard_normal(n).astype(f32), rng.standard_normal(n).astype(f32)
        return lambda t: _core.add(mt.from_numpy(a), mt.from_numpy(b))

    return {"gelu": elementwise(fused.gelu_forward), "silu": elementwise(fused.silu_forward),
            "softmax": rows(fused.softmax_forward), "layernorm": layernorm, "adam": adam,
            "gemm": gemm, "core_add": core_add}


def best_time(fn, number, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="gelu,silu,softmax,layernorm,adam,gemm")
    p.add_argument("--threads", type=int, default=None, help="N (default: physical cores)")
    p.add_argument("--min-log2", type=int, default=11)
    p.add_argument("--max-log2", type=int, default=21)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="1-thread/N-thread alternations")
    args = p.parse_args(argv)
    import microtensor as mt
    from microtensor import threads as T
    import microtensor.buildinfo  # noqa: F401
    n_threads = args.threads or T.physical_cores()
    kernels = _kernels()
    print(f"# {mt.buildinfo.cpu_model()}; N = {n_threads} threads; "
          f"OpenMP {T.omp_settings()}; load average {os.getloadavg()}")
    if True:
        for name in args.kernels.split(","):
            print(f"\n## {name}\n| size | 1 thread | {n_threads} threads | ratio |\n|---:|---:|---:|---:|")
            for lg in range(args.min_log2, args.max_log2 + 1):
                call = kernels[name](1 << lg)
                one = lambda: call(1)          # noqa: E731
                many = lambda: call(n_threads)  # noqa: E731
                many()
                # about 2 ms per batch
                t = best_time(one, 3, 3)
                number = max(1, int(2e-3 / max(t, 1e-7)))
                t1 = tn = float("inf")
                for _ in range(args.rounds):
                    t1 = min(t1, best_time(one, number, args.repeats))
                    tn = min(tn, best_time(many, number, args.repeats))
                print(f"| 2^{lg} | {t1 * 1e6:.1f} us | {tn * 1e6:.1f} us | {tn / t1:.2f} |",
                      flush=True)
    print(f"\n# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
