"""Sharpness during full-batch gradient descent: does training run at the edge of stability?

    python examples/sharpness.py                 # both models, pictures in out-sharpness/
    python examples/sharpness.py --quick         # a small version (a test runs it)
    python examples/sharpness.py --out docs/img  # the pictures of docs/SHARPNESS.md

Sharpness is the largest eigenvalue of the Hessian of the training loss. Gradient descent
with step size lr on a quadratic with curvature lambda diverges when lambda > 2/lr.
Cohen et al. (ICLR 2021, "Gradient Descent on Neural Networks Typically Occurs at the
Edge of Stability") found that on neural networks, full-batch GD first drives the
sharpness up ("progressive sharpening") until it reaches 2/lr, and then, instead of
diverging, keeps it hovering around 2/lr while the loss keeps falling, non-monotonically.

This script trains a small MLP (square loss, as in most of the paper's runs) and a tiny
Transformer (cross-entropy) with plain full-batch GD at a few learning rates, and every
few steps measures the sharpness by power iteration on Hessian-vector products:

    H v = d/dp < d loss/dp, v >     (one backward pass through a create_graph=True gradient)

Power iteration finds the eigenvalue of largest magnitude; when that one is negative it
runs again on H - lambda_neg I, whose largest eigenvalue is lambda_max - lambda_neg.
Each measurement starts from the previous eigenvector, so a few HVPs usually suffice.

Pictures (in --out): sharpness_mlp.png, sharpness_transformer.png (sharpness against
steps with 2/lr dashed, and the loss), sharpness_ratio.png (sharpness * lr / 2 for every
run: the edge of stability is the line at 1). docs/SHARPNESS.md says what they show.
"""
import math
import os
import time

if __name__ == "__main__":
    # (tests load this file by path, without examples/ on sys.path: they need no _cli)
    import _cli
    _cli.script(__name__)   # from here on, Ctrl-C exits quietly
    # NOTE: tiny matrices: one BLAS thread is the fast choice (set before numpy loads)
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import microtensor as mt  # noqa: E402
from microtensor import nn  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

# CPU seconds of a run with no arguments and of --quick, one thread (measured)
FULL_RUN_SECONDS = 115
QUICK_RUN_SECONDS = 4

# -----------------------------------------------------------------------------
DEFAULTS = dict(
    out="out-sharpness",
    seed=0,
    # the MLP: n random points in d dims with random labels among k classes, one-hot
    # targets, square loss; tanh MLP d -> width -> width -> k
    mlp_points=128, mlp_dim=16, mlp_classes=4, mlp_width=64,
    mlp_lrs=[0.1, 0.25, 0.5, 0.7], mlp_steps=3000, mlp_every=20,
    # the Transformer: a GPT on a fixed batch of sequences from a random Markov chain
    gpt_vocab=12, gpt_block=16, gpt_batch=16, gpt_layers=2, gpt_heads=2, gpt_embd=32,
    gpt_lrs=[0.01, 0.03, 0.07], gpt_steps=1500, gpt_every=20,
    # power iteration: stop when the estimate changes by less than tol (relative)
    power_iters=30, power_tol=1e-3,
)
QUICK = dict(mlp_points=64, mlp_width=32, mlp_lrs=[0.5, 1.0], mlp_steps=600, mlp_every=20,
             gpt_batch=4, gpt_block=8, gpt_embd=16, gpt_layers=1, gpt_lrs=[0.1],
             gpt_steps=160, gpt_every=20, power_iters=20)
# NOTE: measure every even number of steps. At the edge of stability GD bounces between
# the two walls of a valley, every other step on the same side, and the sharpness
# alternates with it; an odd interval would draw that alternation as a sawtooth.


# -----------------------------------------------------------------------------
# The sharpness: power iteration on Hessian-vector products

def dot(a, b):
    return sum(float(np.vdot(x, y)) for x, y in zip(a, b))


def normalized(v):
    norm = math.sqrt(dot(v, v))
    return [x / norm for x in v]


def hessian_vector_product(loss, params):
    """v -> H v for the Hessian of `loss` at the current parameters (v: numpy arrays).
    The gradient is built once, differentiably; each product is one more backward."""
    grads = mt.autograd.grad(loss, params, create_graph=True)

    def hvp(v):
        g_dot_v = sum((g * mt.tensor(x)).sum() for g, x in zip(grads, v))
        return [h.numpy() for h in mt.autograd.grad(g_dot_v, params, retain_graph=True)]
    return hvp


def power_iteration(matvec, v, max_iters, tol):
    """(Rayleigh quotient, unit vector, iterations) for the eigenvalue of largest magnitude."""
    v = normalized(v)
    estimate = None
    for i in range(1, max_iters + 1):
        w = matvec(v)
        new = dot(v, w)                                  # v is a unit vector
        v = normalized(w)
        if estimate is not None and abs(new - estimate) <= tol * abs(new):
            return new, v, i
        estimate = new
    return new, v, max_iters


def sharpness(loss, params, v0, rng, max_iters, tol):
    """(largest eigenvalue of the Hessian, its eigenvector, HVPs used)."""
    hvp = hessian_vector_product(loss, params)
    lam, v, n = power_iteration(hvp, v0, max_iters, tol)
    if lam < 0:
        # the dominant eigenvalue is negative: shift the spectrum so the top one dominates
        shifted = lambda u: [h - lam * x for h, x in zip(hvp(u), u)]   # noqa: E731
        start = [rng.standard_normal(x.shape) for x in v]
        top, v, m = power_iteration(shifted, start, max_iters, tol)
        lam, n = top + lam, n + m
    return lam, v, n


# -----------------------------------------------------------------------------
# The two problems: (model, loss function) pairs

def mlp_problem(args, seed):
    r = np.random.default_rng(seed)
    x = mt.tensor(r.standard_normal((args.mlp_points, args.mlp_dim)))            # (n, d)
    y = mt.tensor(np.eye(args.mlp_classes)[r.integers(0, args.mlp_classes,
                                                       args.mlp_points)])     # (n, k)
    mt.manual_seed(seed + 1)
    w = args.mlp_width
    model = nn.Sequential(nn.Linear(args.mlp_dim, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(),
                          nn.Linear(w, args.mlp_classes)).double()
    # square loss: mean over points of the squared error summed over classes / 2
    return model, lambda: ((model(x) - y) ** 2).sum() / (2 * args.mlp_points)


def markov_sequences(vocab, length, batch, rng):
    """(batch, length + 1) int64 walks on a random Markov chain (a little structure to learn)."""
    transition = rng.dirichlet(np.full(vocab, 0.3), size=vocab)          # (V, V), rows sum to 1
    seqs = np.zeros((batch, length + 1), dtype=np.int64)
    seqs[:, 0] = rng.integers(0, vocab, batch)
    for t in range(length):
        for b in range(batch):
            seqs[b, t + 1] = rng.choice(vocab, p=transition[seqs[b, t]])
    return seqs


def gpt_problem(args, seed):
    r = np.random.default_rng(seed)
    seqs = markov_sequences(args.gpt_vocab, args.gpt_block, args.gpt_batch, r)
    idx, targets = mt.tensor(seqs[:, :-1]), mt.tensor(seqs[:, 1:])         # (B, T) each
    mt.manual_seed(seed + 1)
    cfg = GPTConfig(vocab_size=args.gpt_vocab, block_size=args.gpt_block,
                    n_layer=args.gpt_layers, n_head=args.gpt_heads, n_embd=args.gpt_embd)
    model = GPT(cfg).double()
    return model, lambda: model(idx, targets)[1]


# -----------------------------------------------------------------------------
# Training with full-batch GD, measuring the sharpness as we go

def run(make_problem, args, lr, steps, every, label):
    """Train one model from its initial weights with GD at `lr`; returns a dict with the
    loss of every step and the sharpness every `every` steps."""
    model, loss_fn = make_problem(args, args.seed)
    params = list(model.parameters())
    opt = mt.optim.SGD(params, lr=lr)
    rng = np.random.default_rng(args.seed + 2)
    v = [rng.standard_normal(p.shape) for p in params]
    losses, sharp_steps, sharp, hvps = [], [], [], 0
    t0 = time.process_time()
    for step in range(steps + 1):
        loss = loss_fn()
        if step % every == 0 or step == steps:
            lam, v, n = sharpness(loss, params, v, rng, args.power_iters, args.power_tol)
            sharp_steps.append(step)
            sharp.append(lam)
            hvps += n
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            print(f"  {label} lr={lr:g}: the loss diverged at step {step}")
            break
        if step == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    run = dict(lr=lr, losses=losses, steps=sharp_steps, sharpness=sharp, hvps=hvps,
               seconds=time.process_time() - t0)
    run.update(summarize(run))
    return run


def summarize(run):
    """The numbers the table and docs/SHARPNESS.md quote."""
    edge = 2 / run["lr"]
    s = np.array(run["sharpness"])
    reached = np.nonzero(s >= 0.95 * edge)[0]
    first = int(run["steps"][reached[0]]) if reached.size else None
    after = s[reached[0]:] / edge if reached.size else np.array([])
    losses = np.array(run["losses"])
    return dict(edge=edge, start=float(s[0]), peak=float(s.max()), final_loss=float(losses[-1]),
                reached_at=first,
                # once at the edge: where the sharpness sits, relative to 2/lr
                ratio_median=float(np.median(after)) if after.size else None,
                ratio_max=float(after.max()) if after.size else None,
                # the loss at the edge of stability goes up now and then
                loss_increases=int(np.sum(np.diff(losses) > 0)))


def report(name, runs):
    print(f"\n{name}: sharpness (largest Hessian eigenvalue) under full-batch GD")
    print(f"  {'lr':>6} {'2/lr':>7} {'at step 0':>9} {'peak':>8} {'reaches 0.95*2/lr':>18} "
          f"{'then median/max of sharpness*lr/2':>34} {'loss ups':>8} {'final loss':>10}")
    for r in runs:
        when = "never" if r["reached_at"] is None else f"at step {r['reached_at']}"
        ratio = ("-" if r["ratio_median"] is None
                 else f"{r['ratio_median']:.2f} / {r['ratio_max']:.2f}")
        print(f"  {r['lr']:6g} {r['edge']:7.1f} {r['start']:9.2f} {r['peak']:8.2f} {when:>18} "
              f"{ratio:>34} {r['loss_increases']:8d} {r['final_loss']:10.4f}")


# -----------------------------------------------------------------------------
# Pictures

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def plot_runs(plt, runs, title):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.4), sharex=True,
                                      gridspec_kw=dict(height_ratios=[3, 2]))
    for r, color in zip(runs, COLORS):
        top.plot(r["steps"], r["sharpness"], color=color, lw=1.4, label=f"lr = {r['lr']:g}")
        top.axhline(r["edge"], color=color, ls="--", lw=1)
        bottom.plot(np.arange(len(r["losses"])), r["losses"], color=color, lw=1)
    top.set_ylabel("sharpness (top Hessian eigenvalue)")
    top.set_title(title + "\n(dashed: 2 / lr in the same colour)", fontsize=10)
    top.legend(fontsize=8, loc="upper left")
    top.set_ylim(0, 1.35 * max(max(max(r["sharpness"]), min(r["edge"], 3 * max(r["sharpness"])))
                               for r in runs))
    bottom.set_yscale("log")
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("full-batch GD step")
    fig.tight_layout()
    return fig


def plot_ratio(plt, groups):
    fig, axes = plt.subplots(1, len(groups), figsize=(7.5, 3.4), squeeze=False, sharey=True)
    for ax, (name, runs) in zip(axes[0], groups):
        for r, color in zip(runs, COLORS):
            ax.plot(r["steps"], np.array(r["sharpness"]) * r["lr"] / 2, color=color, lw=1.2,
                    label=f"lr = {r['lr']:g}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, 2.2)
        ax.set_xlabel("full-batch GD step")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("sharpness * lr / 2")
    fig.suptitle("Each run in units of its own stability limit 2/lr (the line at 1)", fontsize=10)
    fig.tight_layout()
    return fig


def save(fig, out, name):
    import _cli
    import matplotlib.pyplot as plt
    path = os.path.join(out, name)
    try:
        from microtensor import inspect as mti
        write = (lambda tmp: mti.save_small_png(fig, tmp, dpi=90, colors=128)) \
            if hasattr(mti, "save_small_png") else (lambda tmp: fig.savefig(tmp, dpi=90))
        _cli.replace_with(path, write)
    finally:
        plt.close(fig)
    return path


# -----------------------------------------------------------------------------

def study(args):
    """Train every run; returns {"mlp": [run, ...], "transformer": [run, ...]}."""
    mt.set_num_threads(1)
    results = {}
    problems = [("mlp", "MLP", mlp_problem, args.mlp_lrs, args.mlp_steps, args.mlp_every),
                ("transformer", "Transformer", gpt_problem, args.gpt_lrs, args.gpt_steps,
                 args.gpt_every)]
    for key, name, make, lrs, steps, every in problems:
        if key in args.skip:
            continue
        results[key] = []
        for lr in lrs:
            r = run(make, args, lr, steps, every, name)
            print(f"  {name} lr={lr:g}: {steps} steps, {r['hvps']} Hessian-vector products, "
                  f"{r['seconds']:.1f}s", flush=True)
            results[key].append(r)
        report(name, results[key])
    return results


def draw(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    titles = {"mlp": f"tanh MLP, {args.mlp_points} points with random labels, square loss",
              "transformer": f"{args.gpt_layers}-layer GPT (n_embd {args.gpt_embd}), "
                             f"{args.gpt_batch} sequences, cross-entropy"}
    for key, runs in results.items():
        paths.append(save(plot_runs(plt, runs, titles[key]), args.out, f"sharpness_{key}.png"))
    if results:
        groups = [({"mlp": "MLP", "transformer": "GPT"}[k], v) for k, v in results.items()]
        paths.append(save(plot_ratio(plt, groups), args.out, "sharpness_ratio.png"))
    return paths


def parse_args(argv=None):
    import _cli
    d = DEFAULTS
    parser = _cli.ArgumentParser(
        prog="sharpness.py",
        description="The largest Hessian eigenvalue of the training loss during full-batch "
                    "gradient descent, at several learning rates, against 2/lr (the edge of "
                    "stability): tables on stdout, pictures in --out. Takes about "
                    f"{_cli.minutes(FULL_RUN_SECONDS)} on one CPU core (about "
                    f"{_cli.minutes(QUICK_RUN_SECONDS)} with --quick).")
    parser.add_argument("--out", default=d["out"], help="directory for the PNGs, created if "
                        f"needed (default: {d['out']}/ in the working directory)")
    parser.add_argument("--quick", action="store_true",
                        help="a small version: smaller models and data, two MLP learning "
                             "rates and one Transformer learning rate, few steps")
    parser.add_argument("--mlp_lrs", type=_cli.positive_number, nargs="+", metavar="LR",
                        help="GD learning rates of the MLP runs, each > 0 (default: "
                             f"{' '.join(map(str, d['mlp_lrs']))})")
    parser.add_argument("--gpt_lrs", type=_cli.positive_number, nargs="+", metavar="LR",
                        help="GD learning rates of the Transformer runs, each > 0 (default: "
                             f"{' '.join(map(str, d['gpt_lrs']))})")
    parser.add_argument("--mlp_steps", type=_cli.positive_int, metavar="N",
                        help=f"GD steps of each MLP run (default: {d['mlp_steps']})")
    parser.add_argument("--gpt_steps", type=_cli.positive_int, metavar="N",
                        help=f"GD steps of each Transformer run (default: {d['gpt_steps']})")
    parser.add_argument("--every", type=_cli.positive_int, metavar="N",
                        help="measure the sharpness every N steps; an even N keeps GD's "
                             "step-to-step alternation out of the curves (default: "
                             f"{d['mlp_every']})")
    parser.add_argument("--power_iters", type=_cli.positive_int, metavar="N",
                        help="most Hessian-vector products per power iteration (default: "
                             f"{d['power_iters']})")
    parser.add_argument("--skip", choices=["mlp", "transformer"], nargs="+", default=[],
                        help="models to leave out (default: none)")
    parser.add_argument("--seed", type=_cli.seed_int, default=d["seed"],
                        help=f"seed of the data and the weights (default: {d['seed']})")
    parser.add_argument("--json", metavar="FILE", help="also write every run's summary (the "
                        "numbers of the tables) to FILE as JSON (default: none)")
    args = parser.parse_args(argv)
    settings = dict(DEFAULTS, **(QUICK if args.quick else {}))
    for key, value in vars(args).items():
        if value is not None and key not in ("quick", "skip", "every"):
            settings[key] = value
    if args.every is not None:
        settings["mlp_every"] = settings["gpt_every"] = args.every
    for key, value in settings.items():
        setattr(args, key, value)
    if set(args.skip) != {"mlp", "transformer"}:
        _cli.writable_dir(parser.prog, args.out)
    if args.json and os.path.isdir(args.json):
        _cli.fail(parser.prog, f"--json {args.json} is a directory, not a file")
    return args


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    results = study(args)
    paths = draw(results, args)
    if args.json:
        import json
        import _cli
        summary = {k: [{f: r[f] for f in r if f not in ("losses", "steps", "sharpness")}
                       for r in runs] for k, runs in results.items()}

        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
        _cli.replace_with(args.json, write)
    print(f"\ndone in {time.time() - t0:.0f}s; pictures: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    _cli.run(main)
