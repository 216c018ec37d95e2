"""The builds of the fused kernels side by side: baseline (SSE2), AVX2+FMA and AVX-512,
each op's forward + backward at one thread, on the shapes of the `cpu` config's step.

Every build this CPU runs is timed in the same process, rounds alternating the builds
(median of --repeats), by pointing microtensor.nn.functional at each build in turn: the
same Python path, only the compiled kernels differ.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_kernels.py
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402


def cases(mt, F, rows, width, vocab, heads, T):
    """{op: a zero-argument forward + backward} on the step's shapes."""
    rng = np.random.default_rng(0)

    def t(*shape, grad=True):
        return mt.tensor(rng.standard_normal(shape, dtype=np.float32), requires_grad=grad)
    x, g = t(rows, 4 * width), t(rows, 4 * width, grad=False)
    h, gh = t(rows, width), t(rows, width, grad=False)
    w, b = t(width), t(width)
    logits, target = t(rows, vocab), mt.tensor(rng.integers(0, vocab, rows))
    B = rows // T
    q = t(B, heads, T, width // heads)
    gq = t(B, heads, T, width // heads, grad=False)
    return {
        f"gelu ({rows}, {4 * width})": lambda: F.gelu(x).backward(g),
        f"gelu tanh ({rows}, {4 * width})": lambda: F.gelu(x, approximate="tanh").backward(g),
        f"layer_norm ({rows}, {width})": lambda: F.layer_norm(h, (width,), w, b).backward(gh),
        f"softmax ({rows}, {4 * width})": lambda: F.softmax(x, -1).backward(g),
        f"cross_entropy ({rows}, {vocab})": lambda: F.cross_entropy(logits, target).backward(),
        f"attention causal ({B}, {heads}, {T}, {width // heads})":
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).backward(gq),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cpu", help="the config whose shapes are used")
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--min-time", type=float, default=0.05)
    p.add_argument("--allow-busy", action="store_true",
                   help="time even when the 1-minute load average is above 0.3 (a dry run)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = p.parse_args(argv)

    C.check_quiet(args.allow_busy, "bench_kernels.py")
    import microtensor as mt
    from microtensor.nn import functional as F
    from microtensor.ops._functional_common import kernel_builds_here
    C.setup_threads(1, None)
    info = C.machine_info(1, None)
    C.print_machine(info)
    builds = {name: (fused, attention) for name, fused, attention in kernel_builds_here()}
    cfg = C.CONFIGS[args.config]
    ops = cases(mt, F, cfg["batch_size"] * cfg["block_size"], cfg["n_embd"], args.vocab,
                cfg["n_head"], cfg["block_size"])
    loaded = (F._kernels.fused, F._kernels.attention)
    rows, record = [], {"bench": "kernels", "machine": info, "config": args.config, "ops": {}}
    try:
        for op, fn in ops.items():
            def with_build(pair, fn=fn):
                def run():
                    F._kernels.fused, F._kernels.attention = pair
                    fn()
                return run
            times = C.alternate({n: with_build(pair) for n, pair in builds.items()},
                                repeats=args.repeats, min_time=args.min_time)
            med = {n: C.median(ts) * 1e6 for n, ts in times.items()}
            widest = next(iter(med))
            rows.append([op] + [f"{med[n]:.0f}" for n in builds] +
                        [f"{med[widest] / med.get('avx2', med[widest]):.2f}"])
            record["ops"][op] = med
    finally:
        F._kernels.fused, F._kernels.attention = loaded
    print(f"\n## fused kernels, forward + backward, 1 thread, us per call (median of "
          f"{args.repeats}); last column: the widest build / avx2\n")
    print(C.table(["op"] + list(builds) + ["widest / avx2"], rows))
    if args.json is not None:
        C.emit_json(record, args.json)
    return record


if __name__ == "__main__":
    main()
