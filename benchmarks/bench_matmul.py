"""The float32 matmul ceiling: GFLOP/s of numpy's BLAS and of PyTorch on a large square
product and on the exact products of one GPT training step of each config.

For each config the "step ceiling" is the time the step would take if it were only its
matrix products, each run alone through the library: sum(count * time) over the
products below, and its GFLOP/s. bench_train.py's achieved GFLOP/s is measured against
the same FLOP count (see _common.matmul_shapes for the list and the formula).

Operands are laid out as the step reads them (a Linear's weight is stored (out, in)
and used transposed; dW reads the upstream gradient transposed), so the BLAS sees
the same transpose flags. Alternating numpy / torch, median of --repeats.

    python benchmarks/bench_matmul.py --threads 2
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_matmul.py
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402


def operands(s, rng):
    """The two float32 operands of a product, stored as the step stores them."""
    lead = () if s["batch"] is None else (s["batch"],)
    m, k, n = s["m"], s["k"], s["n"]
    a = rng.standard_normal(lead + ((k, m) if s["ta"] else (m, k)), dtype=np.float32)
    b = rng.standard_normal(lead + ((n, k) if s["tb"] else (k, n)), dtype=np.float32)
    return a, b


def closures(s, torch, rng):
    a, b = operands(s, rng)
    a_view = np.swapaxes(a, -1, -2) if s["ta"] else a
    b_view = np.swapaxes(b, -1, -2) if s["tb"] else b
    fns = {"numpy": lambda: np.matmul(a_view, b_view)}
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta = ta.transpose(-1, -2) if s["ta"] else ta
        tb = tb.transpose(-1, -2) if s["tb"] else tb
        fns["torch"] = lambda: torch.matmul(ta, tb)
    return fns


def measure(shapes, torch, repeats, min_time, seed=0):
    """[(shape, {engine: median seconds})] for a list of shapes."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        times = C.alternate(closures(s, torch, rng), repeats=repeats, min_time=min_time)
        out.append((s, {e: C.median(ts) for e, ts in times.items()}))
    return out


def step_ceiling(cfg, vocab_size, torch, repeats=5, min_time=0.05):
    """{engine: (seconds of the step's matmuls, GFLOP/s)} for one config; also the
    per-shape results."""
    results = measure(C.matmul_shapes(cfg, vocab_size), torch, repeats, min_time)
    total_flops = sum(C.shape_flops(s) * s["count"] for s, _ in results)
    ceiling = {}
    for eng in results[0][1]:
        secs = sum(t[eng] * s["count"] for s, t in results)
        ceiling[eng] = (secs, total_flops / secs / 1e9)
    return ceiling, results, total_flops


def gflops(s, t):
    return f"{C.shape_flops(s) / t / 1e9:.1f}" if t else "n/a"


def dims(s):
    b = f"{s['batch']}x " if s["batch"] else ""
    ta, tb = ("^T" if s["ta"] else ""), ("^T" if s["tb"] else "")
    return f"{b}({s['m']}x{s['k']}){ta}@({s['k']}x{s['n']}){tb}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="tiny,cpu,mid", help="comma-separated config names")
    p.add_argument("--square", type=int, default=2048, help="size of the square product (0: skip)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the corpus's number of distinct chars)")
    p.add_argument("--data", default=None, help="corpus that sets the vocabulary size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = p.parse_args(argv)

    torch = None if args.no_torch else C.try_import_torch()
    C.setup_threads(args.threads, torch)
    info = C.machine_info(args.threads, torch)
    C.print_machine(info)
    vocab = args.vocab or len(set(C.load_text(args.data)[0]))
    engines = ["numpy"] + (["torch"] if torch is not None else [])
    record = {"bench": "matmul", "machine": info, "vocab_size": vocab, "configs": {}}

    if args.square:
        n = args.square
        sq = dict(name=f"square {n}^3", count=1, batch=None, m=n, k=n, n=n, ta=False, tb=False)
        (s, t), = measure([sq], torch, args.repeats, args.min_time)
        print(f"\n## square float32 product {n}x{n} @ {n}x{n} (GFLOP/s, median of {args.repeats})\n")
        print(C.table(["product"] + engines, [[dims(s)] + [gflops(s, t[e]) for e in engines]]))
        record["square"] = {"n": n, **{e: C.shape_flops(s) / t[e] / 1e9 for e in engines}}

    for name in args.configs.split(","):
        cfg = C.CONFIGS[name]
        ceiling, results, total = step_ceiling(cfg, vocab, torch, args.repeats, args.min_time)
        rows = [[s["name"], s["count"], dims(s)] + [gflops(s, t[e]) for e in engines]
                for s, t in results]
        rows.append(["all products of one step", "", f"{total / 1e9:.3f} GFLOP"] +
                    [f"{ceiling[e][1]:.1f} ({ceiling[e][0] * 1e3:.1f} ms)" for e in engines])
        print(f"\n## config {name} ({cfg}, vocab {vocab}): GFLOP/s per product, "
              f"median of {args.repeats}\n")
        print(C.table(["product", "per step", "shape"] + [f"{e} GFLOP/s" for e in engines], rows))
        record["configs"][name] = {
            "step_gflop": total / 1e9,
            "ceiling": {e: {"seconds": ceiling[e][0], "gflops": ceiling[e][1]} for e in engines},
            "shapes": [{"name": s["name"], "count": s["count"], "dims": dims(s),
                        **{e: C.shape_flops(s) / t[e] / 1e9 for e in engines}}
                       for s, t in results],
        }
    if args.json is not None:
        C.emit_json(record, args.json)
    return record


if __name__ == "__main__":
    main()
