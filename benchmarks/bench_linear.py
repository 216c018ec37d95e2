"""The linear layer against its own gemms: what a Linear costs beyond its matrix products.

A Linear's forward and backward are three gemms (y = x W^T, dx = g W, dW = g^T x) plus
the bias (added to y, summed over g's rows for db). For every Linear of a training step
(the GPT's qkv, attention projection, MLP up and down, lm_head) this times, side by side
in one process, medians of several rounds:

  gemms     the three products alone, through microtensor's gemm into ready buffers
  mt        F.linear forward + backward through the engine (bias included)
  torch     torch.nn.functional.linear forward + backward (when torch is installed)

and prints mt / gemms (the layer's cost around its products: 1.00 is the floor) and
mt / torch, per shape and over the step (each shape weighted by its count per step).

    python benchmarks/bench_linear.py --config cpu --threads 1,2
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def linear_shapes(cfg, vocab):
    """(name, count per step, M, in, out) of every Linear in the GPT's step."""
    m, c = cfg["batch_size"] * cfg["block_size"], cfg["n_embd"]
    n = cfg["n_layer"]
    return [("attn.c_attn", n, m, c, 3 * c), ("attn.c_proj", n, m, c, c),
            ("mlp.c_fc", n, m, c, 4 * c), ("mlp.c_proj", n, m, 4 * c, c),
            ("lm_head", 1, m, c, vocab)]


def closures(M, n_in, n_out, torch, rng):
    import microtensor as mt
    import microtensor.nn.functional as F
    from microtensor.kernels import _blas
    x = rng.standard_normal((M, n_in)).astype(np.float32)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    g = rng.standard_normal((M, n_out)).astype(np.float32)
    y, dx, dw = (np.empty((M, n_out), np.float32), np.empty((M, n_in), np.float32),
                 np.empty((n_out, n_in), np.float32))

    def gemms():
        nt = mt.get_num_threads()
        _blas.gemm(x, w.T, out=y, num_threads=nt)
        _blas.gemm(g, w, out=dx, num_threads=nt)
        _blas.gemm(g.T, x, out=dw, num_threads=nt)

    tx, tw, tb = (mt.tensor(a, requires_grad=True) for a in (x, w, b))
    tg = mt.tensor(g)

    def engine():
        tx.grad = tw.grad = tb.grad = None
        F.linear(tx, tw, tb).backward(tg)

    # the two time the same products: the engine's results are the gemms' (bias aside)
    gemms()
    engine()
    assert np.allclose(tx.grad.numpy(), dx, rtol=1e-4, atol=1e-4), "dx differs from g @ W"
    assert np.allclose(tw.grad.numpy(), dw, rtol=1e-4, atol=1e-3), "dW differs from g^T @ x"
    assert np.allclose(tb.grad.numpy(), g.sum(0), rtol=1e-4, atol=1e-3), "db differs"
    fns = {"gemms": gemms, "mt": engine}
    if torch is not None:
        px, pw, pb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
        pg = torch.tensor(g)

        def theirs():
            px.grad = pw.grad = pb.grad = None
            torch.nn.functional.linear(px, pw, pb).backward(pg)
        fns["torch"] = theirs
    return fns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="cpu", help="comma-separated: tiny, cpu, mid")
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (lm_head's width)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per repetition")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--allow-busy", action="store_true",
                   help="time even when the 1-minute load average is above 0.3 (a dry run)")
    args = p.parse_args(argv)
    C.check_quiet(args.allow_busy, "bench_linear.py")
    torch = None if args.no_torch else C.try_import_torch()
    rng = np.random.default_rng(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        C.setup_threads(threads, torch)
        C.print_machine(C.machine_info(threads, torch))
        for name in args.config.split(","):
            cfg = C.CONFIGS[name]
            rows, totals = [], {}
            for layer, count, M, n_in, n_out in linear_shapes(cfg, args.vocab):
                fns = closures(M, n_in, n_out, torch, rng)
                med = {k: C.median(v) for k, v in C.alternate(fns, repeats=args.repeats,
                                                                  min_time=args.min_time).items()}
                for k, v in med.items():
                    totals[k] = totals.get(k, 0.0) + count * v
                rows.append([f"{layer} ({M}x{n_in} -> {n_out}) x{count}"]
                            + [C.fmt_time(med[k]) for k in fns]
                            + [f"{med['mt'] / med['gemms']:.2f}"]
                            + ([f"{med['mt'] / med['torch']:.2f}"] if "torch" in med else []))
            keys = list(totals)
            rows.append(["step total"] + [C.fmt_time(totals[k]) for k in keys]
                        + [f"{totals['mt'] / totals['gemms']:.2f}"]
                        + ([f"{totals['mt'] / totals['torch']:.2f}"] if "torch" in totals else []))
            print(f"\n{name}, {threads} thread{'s' if threads > 1 else ''}: one Linear's "
                  "forward + backward (float32)")
            print(C.table(["Linear"] + keys + ["mt / gemms"]
                          + (["mt / torch"] if "torch" in totals else []), rows))
    C.print_load_after()


if __name__ == "__main__":
    main()
