"""The row-wise kernels of a training step at its shapes: attention with its head split
(forward, forward + backward), layer norm's and cross-entropy's forward kernels, and a
transpose that records its gradient; with PyTorch's where it has the same call.

Medians of several rounds, the calls of each round alternating. To compare two builds
(before and after a change), build each in its own checkout and run this script from
each in turn, on a quiet machine:

    PYTHONPATH=/path/to/old python benchmarks/bench_rows.py --config tiny,cpu,mid
    PYTHONPATH=/path/to/new python benchmarks/bench_rows.py --config tiny,cpu,mid
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def closures(cfg, vocab, torch, rng):
    """name -> {engine: fn} for one config's shapes."""
    import microtensor as mt
    from microtensor.ops import _kernels
    B, T, nh, c = cfg["batch_size"], cfg["block_size"], cfg["n_head"], cfg["n_embd"]
    hs, R = c // nh, cfg["batch_size"] * cfg["block_size"]
    out = {}

    qkv = mt.tensor(rng.standard_normal((B, T, 3 * c)).astype(np.float32), requires_grad=True)
    g = mt.tensor(rng.standard_normal((B, T, c)).astype(np.float32))

    def attend(lib, x, grad=None):
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(c, dim=2))
        y = lib.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, c)
        if grad is not None:
            x.grad = None
            y.backward(grad)
        return y

    def mt_forward():
        with mt.no_grad():
            attend(mt, qkv)
    out[f"attention forward (B {B}, T {T}, hs {hs})"] = {"mt": mt_forward}
    out[f"attention forward + backward (T {T}, hs {hs})"] = {"mt": lambda: attend(mt, qkv, g)}
    if torch is not None:
        tqkv = torch.tensor(qkv.numpy(), requires_grad=True)
        tg = torch.tensor(g.numpy())

        def torch_forward():
            with torch.no_grad():
                attend(torch, tqkv)
        out[f"attention forward (B {B}, T {T}, hs {hs})"]["torch"] = torch_forward
        out[f"attention forward + backward (T {T}, hs {hs})"]["torch"] = \
            lambda: attend(torch, tqkv, tg)

    x = rng.standard_normal((R, c)).astype(np.float32)
    w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    y, mean, rstd = np.empty_like(x), np.empty(R, np.float32), np.empty(R, np.float32)
    out[f"layer norm forward kernel ({R} x {c})"] = {
        "mt": lambda: _kernels.fused.layernorm_forward(y, mean, rstd, x, w, b, 1e-5,
                                                       mt.get_num_threads())}

    logits = rng.standard_normal((R, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, R)
    losses, m, s = (np.empty(R, np.float32) for _ in range(3))
    out[f"cross-entropy forward kernel ({R} x {vocab})"] = {
        "mt": lambda: _kernels.fused.crossentropy_forward(losses, m, s, logits, targets, -100,
                                                          0.0, mt.get_num_threads())}

    h = qkv.split(c, dim=2)[0].view(B, T, nh, hs)
    out["transpose recording its gradient"] = {"mt": lambda: h.transpose(1, 2)}
    if torch is not None:
        th = tqkv.split(c, dim=2)[0].view(B, T, nh, hs)
        out["transpose recording its gradient"]["torch"] = lambda: th.transpose(1, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny,cpu", help="comma-separated: tiny, cpu, mid")
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (the logits' width)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per repetition")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--allow-busy", action="store_true",
                   help="time even when the 1-minute load average is above 0.3 (a dry run)")
    args = p.parse_args(argv)
    C.check_quiet(args.allow_busy, "bench_rows.py")
    torch = None if args.no_torch else C.try_import_torch()
    rng = np.random.default_rng(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        C.setup_threads(threads, torch)
        C.print_machine(C.machine_info(threads, torch))
        for name in args.config.split(","):
            rows = []
            for label, fns in closures(C.CONFIGS[name], args.vocab, torch, rng).items():
                med = {k: C.median(v) for k, v in C.alternate(
                    fns, repeats=args.repeats, min_time=args.min_time).items()}
                rows.append([label, C.fmt_time(med["mt"]),
                             C.fmt_time(med["torch"]) if "torch" in med else "",
                             f"{med['mt'] / med['torch']:.2f}" if "torch" in med else ""])
            print(f"\n{name}, {threads} thread{'s' if threads > 1 else ''}")
            print(C.table(["call", "mt", "torch", "mt / torch"], rows))
    C.print_load_after()


if __name__ == "__main__":
    main()
