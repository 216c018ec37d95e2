"""Time per call of single ops: microtensor vs numpy (forward) vs PyTorch eager.

Two groups of ops:
  core   a + b, a * b, a.exp(), a @ b, a.sum() on a small (8 elements) and a large
         (1M elements; 512x512 for matmul) float32 tensor
  fused  softmax, layer_norm, cross_entropy, gelu and causal attention at the shapes
         of a char-level model (B=12, T=64, C=128, 4 heads) and a mid-size one
         (B=12, T=256, C=384, 6 heads)

Forward is timed with inputs that do not require grad; forward+backward with inputs
that do, calling backward with a fixed random upstream gradient (an all-ones one lets
some engines take shortcuts) and clearing .grad before each call, the same way for
every engine. Numbers are medians over --repeats repetitions, engines alternating.

    python benchmarks/bench_ops.py                 # both groups, 2 threads
    python benchmarks/bench_ops.py --only fused --threads 1 --json out.jsonl
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402

import microtensor as mt  # noqa: E402


# ---- cases -----------------------------------------------------------------------
# A case: name, size label, input arrays, and per engine a function of its tensors.
# The same arrays (float32) feed every engine.

def core_cases(rng):
    small = {"x": (2, 4), "mm": ((2, 4), (4, 2))}
    large = {"x": (1024, 1024), "mm": ((512, 512), (512, 512))}
    cases = []
    for label, s in (("small", small), ("large", large)):
        a, b = rng.standard_normal(s["x"]), rng.standard_normal(s["x"])
        ma, mb = rng.standard_normal(s["mm"][0]), rng.standard_normal(s["mm"][1])
        size = f"{label} {s['x'][0]}x{s['x'][1]}"
        msize = f"{label} {s['mm'][0][0]}x{s['mm'][0][1]}@{s['mm'][1][0]}x{s['mm'][1][1]}"
        cases += [
            dict(name="a + b", size=size, arrays=[a, b],
                 mt=lambda a, b: a + b, np=np.add, torch=lambda a, b: a + b),
            dict(name="a * b", size=size, arrays=[a, b],
                 mt=lambda a, b: a * b, np=np.multiply, torch=lambda a, b: a * b),
            dict(name="a.exp()", size=size, arrays=[a],
                 mt=lambda a: a.exp(), np=np.exp, torch=lambda a: a.exp()),
            dict(name="a @ b", size=msize, arrays=[ma, mb],
                 mt=lambda a, b: a @ b, np=np.matmul, torch=lambda a, b: a @ b),
            dict(name="a.sum()", size=size, arrays=[a],
                 mt=lambda a: a.sum(), np=np.sum, torch=lambda a: a.sum()),
        ]
    return cases


MODEL_SHAPES = {
    # name: (B, T, C, n_head, vocab)
    "char": (12, 64, 128, 4, 65),
    "mid": (12, 256, 384, 6, 65),
}


def fused_cases(rng, torch, models=tuple(MODEL_SHAPES)):
    """The fused ops of a GPT step, at the shapes they have inside the model."""
    F_mt = getattr(mt.nn, "functional", None)
    F_t = torch.nn.functional if torch is not None else None
    cases = []
    for model in models:
        B, T, Cd, nh, V = MODEL_SHAPES[model]
        hs = Cd // nh
        scores = rng.standard_normal((B, nh, T, T))
        x = rng.standard_normal((B, T, Cd))
        w, bias = 1 + 0.1 * rng.standard_normal(Cd), 0.1 * rng.standard_normal(Cd)
        logits = rng.standard_normal((B * T, V))
        target = rng.integers(0, V, B * T)
        h = rng.standard_normal((B, T, 4 * Cd))
        q, k, v = (rng.standard_normal((B, nh, T, hs)) for _ in range(3))
        tag = f"{model} "
        cases += [
            dict(name="softmax(-1)", size=tag + "x".join(map(str, scores.shape)),
                 arrays=[scores],
                 mt=lambda s: mt_fn(F_mt, "softmax")(s, -1),
                 torch=lambda s: F_t.softmax(s, -1)),
            dict(name="layer_norm", size=tag + "x".join(map(str, x.shape)),
                 arrays=[x, w, bias],
                 mt=lambda x, w, b, C_=Cd: mt_fn(F_mt, "layer_norm")(x, (C_,), w, b),
                 torch=lambda x, w, b, C_=Cd: F_t.layer_norm(x, (C_,), w, b)),
            dict(name="cross_entropy", size=tag + f"{B * T}x{V}",
                 arrays=[logits], consts=[target],
                 mt=lambda l, t: mt_fn(F_mt, "cross_entropy")(l, t),
                 torch=lambda l, t: F_t.cross_entropy(l, t)),
            dict(name="gelu", size=tag + "x".join(map(str, h.shape)), arrays=[h],
                 mt=lambda h: mt_fn(F_mt, "gelu")(h),
                 torch=lambda h: F_t.gelu(h)),
            dict(name="causal attention", size=tag + "x".join(map(str, q.shape)),
                 arrays=[q, k, v],
                 mt=lambda q, k, v: mt_fn(F_mt, "scaled_dot_product_attention")(
                     q, k, v, is_causal=True),
                 torch=lambda q, k, v: F_t.scaled_dot_product_attention(
                     q, k, v, is_causal=True)),
        ]
    return cases


class Missing(Exception):
    """An op microtensor does not have yet: its column shows n/a."""


def mt_fn(F, name):
    fn = getattr(F, name, None) if F is not None else None
    if fn is None:
        fn = getattr(mt, name, None) if name == "softmax" else None
    if fn is None:
        raise Missing(f"mt.nn.functional.{name}")
    return fn


# ---- closures per engine -----------------------------------------------------------

def make_closures(case, torch, rng):
    """{(engine, mode): zero-argument callable} for one case."""
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in case["arrays"]]
    consts = case.get("consts", [])
    fns = {}

    # microtensor
    mt_const = [mt.from_numpy(np.asarray(c, dtype=np.int64)) for c in consts]
    x_nograd = [mt.from_numpy(a) for a in arrays]
    x_grad = [mt.from_numpy(a.copy()).requires_grad_() for a in arrays]
    try:
        out = case["mt"](*x_nograd, *mt_const)
    except Missing:
        out = None
    if out is not None:
        gout = rng.standard_normal(out.shape).astype(np.float32) if out.ndim else None
        g_mt = mt.from_numpy(gout) if gout is not None else None
        f = case["mt"]
        fns[("microtensor", "fwd")] = lambda: f(*x_nograd, *mt_const)

        def mt_fwd_bwd():
            for t in x_grad:
                t.grad = None
            f(*x_grad, *mt_const).backward(g_mt)
        fns[("microtensor", "fwd+bwd")] = mt_fwd_bwd

    # numpy (forward only)
    if "np" in case:
        fnp = case["np"]
        fns[("numpy", "fwd")] = lambda: fnp(*arrays)

    # torch eager
    if torch is not None:
        t_const = [torch.from_numpy(np.asarray(c, dtype=np.int64)) for c in consts]
        t_nograd = [torch.from_numpy(a) for a in arrays]
        t_grad = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
        ft = case["torch"]
        out_t = ft(*t_nograd, *t_const)
        g_t = torch.from_numpy(gout) if out is not None and gout is not None else (
            torch.from_numpy(rng.standard_normal(tuple(out_t.shape)).astype(np.float32))
            if out_t.dim() else None)
        fns[("torch", "fwd")] = lambda: ft(*t_nograd, *t_const)

        def torch_fwd_bwd():
            for t in t_grad:
                t.grad = None
            ft(*t_grad, *t_const).backward(g_t)
        fns[("torch", "fwd+bwd")] = torch_fwd_bwd
    return fns


def check_agreement(case, torch):
    """Forward values of microtensor and torch on one case agree (a benchmark of a
    wrong op would be meaningless)."""
    if torch is None:
        return None
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in case["arrays"]]
    consts = case.get("consts", [])
    try:
        a = case["mt"](*[mt.from_numpy(x) for x in arrays],
                       *[mt.from_numpy(np.asarray(c, dtype=np.int64)) for c in consts]).numpy()
    except Missing:
        return None
    b = case["torch"](*[torch.from_numpy(x) for x in arrays],
                      *[torch.from_numpy(np.asarray(c, dtype=np.int64)) for c in consts]).numpy()
    return float(np.max(np.abs(a.astype(np.float64) - b)) / (np.max(np.abs(b)) + 1e-12))


# ---- main ------------------------------------------------------------------------

def run(cases, torch, repeats, min_time, rng):
    rows, records = [], []
    for case in cases:
        fns = make_closures(case, torch, rng)
        res = {}
        for mode in ("fwd", "fwd+bwd"):
            group = {eng: fn for (eng, m), fn in fns.items() if m == mode}
            times = C.alternate(group, repeats=repeats, min_time=min_time)
            for eng, ts in times.items():
                res[(eng, mode)] = C.median(ts)
        get = res.get
        err = check_agreement(case, torch)
        rows.append([
            case["name"], case["size"],
            C.fmt_time(get(("microtensor", "fwd"))), C.fmt_time(get(("numpy", "fwd"))),
            C.fmt_time(get(("torch", "fwd"))),
            C.fmt_ratio(get(("microtensor", "fwd")), get(("numpy", "fwd"))),
            C.fmt_ratio(get(("microtensor", "fwd")), get(("torch", "fwd"))),
            C.fmt_time(get(("microtensor", "fwd+bwd"))), C.fmt_time(get(("torch", "fwd+bwd"))),
            C.fmt_ratio(get(("microtensor", "fwd+bwd")), get(("torch", "fwd+bwd"))),
        ])
        records.append({"op": case["name"], "size": case["size"],
                        "seconds": {f"{e}/{m}": v for (e, m), v in res.items()},
                        "max_rel_diff_vs_torch": err})
        if err is not None and err > 1e-3:
            print(f"WARNING: {case['name']} {case['size']}: microtensor and torch differ "
                  f"(max relative difference {err:.2e})", file=sys.stderr)
    return rows, records


HEADERS = ["op", "shape", "mt fwd", "numpy fwd", "torch fwd", "mt/numpy", "mt/torch",
           "mt fwd+bwd", "torch fwd+bwd", "mt/torch f+b"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="repetitions per engine (median)")
    p.add_argument("--min-time", type=float, default=0.02,
                   help="seconds each repetition lasts at least")
    p.add_argument("--only", choices=["core", "fused"], default=None)
    p.add_argument("--models", default=",".join(MODEL_SHAPES),
                   help="model shapes for the fused ops: " + ", ".join(MODEL_SHAPES))
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as one JSON line (stdout if no PATH)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch = None if args.no_torch else C.try_import_torch()
    C.setup_threads(args.threads, torch)
    info = C.machine_info(args.threads, torch)
    C.print_machine(info)
    rng = np.random.default_rng(args.seed)

    groups = []
    if args.only in (None, "core"):
        groups.append(("core ops", core_cases(rng)))
    if args.only in (None, "fused"):
        groups.append(("fused ops at model shapes", fused_cases(rng, torch, args.models.split(","))))
    out = {"machine": info, "repeats": args.repeats, "results": []}
    for title, cases in groups:
        rows, records = run(cases, torch, args.repeats, args.min_time, rng)
        print(f"\n## {title} (median time per call of {args.repeats} repetitions; "
              f"ratio < 1 means microtensor is faster)\n")
        print(C.table(HEADERS, rows))
        out["results"] += records
    if args.json is not None:
        C.emit_json({"bench": "ops", **out}, args.json)
    return out


if __name__ == "__main__":
    main()
