"""Why residual connections: watch the gradient flow through deep stacks.

    python examples/residual_flow.py                 # tables + pictures in out-residual_flow/
    python examples/residual_flow.py --quick         # the same study, smaller
    python examples/residual_flow.py --out /tmp/rf   # pictures elsewhere

(--help states the run times.) docs/regenerate.py runs it with --out docs/img to redraw
the pictures of docs/RESIDUAL_FLOW.md and to rewrite the numbers quoted there.

Three experiments, each a table on stdout and a PNG:
  1. a scalar stack: F(x) = tanh(0.5 x) applied again and again, plainly (x <- F(x)) or
     with a shortcut (x <- x + F(x)); the gradient at the input by autograd, depth 1-20;
  2. Transformer stacks at initialisation, 2 to 48 blocks: the gradient norm arriving at
     every block's input (mt.inspect.GradientRecorder), residuals on/off, pre/post-norm;
  3. a short training run of the same model with residuals on and off, and pre- vs
     post-norm at a depth where it matters: loss curves.
"""
import math
import os
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

# NOTE: the models here are tiny (64-wide matrices). A multi-threaded BLAS spends more
# time waking its threads than multiplying, and on a busy machine a step can get 50x
# slower; one thread is the fast choice. Must be set before numpy is imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


import numpy as np  # noqa: E402

import microtensor as mt  # noqa: E402
from microtensor import inspect as mti  # noqa: E402

# CPU seconds of a run with no arguments and of --quick (one thread, so on an idle core
# also the wall clock), as measured by docs/regenerate.py, which rewrites these lines and
# the docs that quote them.
FULL_RUN_SECONDS = 41
QUICK_RUN_SECONDS = 15

# -----------------------------------------------------------------------------
# Defaults (--quick shrinks them; see QUICK)
DEFAULTS = dict(
    out="out-residual_flow",                     # pictures; docs/regenerate.py: docs/img
    scalar_depth=20,                             # experiment 1: depths 1..20
    depths=[2, 4, 8, 12, 16, 24, 32, 48],        # experiment 2: stack depths
    n_embd=64, n_head=4, block_size=64,          # model width and context (both 2 and 3)
    batch_size=8,
    train_layers=6,                              # experiment 3: the deep model
    shallow_layers=2,                            # experiment 3: pre/post-norm, shallow
    train_iters=300,
    lr=1e-3,
    seed=1337,
)
QUICK = dict(depths=[2, 4, 8, 16], block_size=32, train_iters=150)


# -----------------------------------------------------------------------------
# Experiment 1: the scalar stack

def scalar_stack(depth, shortcut, x0=1.0):
    """Apply F(x) = tanh(0.5 x) `depth` times to x0, plainly or as x + F(x).

    Returns (dx_L/dx_0 by microtensor's autograd, [x_0, ..., x_{L-1}]), the second being
    the points each layer's slope is taken at."""
    x_in = mt.tensor(x0, dtype=mt.float64, requires_grad=True)
    x, visited = x_in, []
    for _ in range(depth):
        visited.append(x.item())
        f = (0.5 * x).tanh()
        x = x + f if shortcut else f
    x.backward()
    return x_in.grad.item(), visited


def scalar_closed_form(visited, shortcut):
    """The same derivative by the chain rule: a product of per-layer slopes, with
    F'(x) = 0.5 (1 - tanh^2(0.5 x)); the shortcut layer's slope is 1 + F'(x)."""
    slopes = [0.5 * (1.0 - math.tanh(0.5 * x) ** 2) for x in visited]
    return math.prod((1.0 + s) if shortcut else s for s in slopes)


def experiment_scalar(args, plt):
    print("\n== 1. The scalar stack: F(x) = tanh(0.5 x), x0 = 1 ==")
    depths = list(range(1, args.scalar_depth + 1))
    plain = [scalar_stack(d, shortcut=False)[0] for d in depths]
    short = [scalar_stack(d, shortcut=True)[0] for d in depths]
    print(f"{'depth':>5}  {'plain  x <- F(x)':>18}  {'shortcut  x <- x + F(x)':>24}")
    for d, p, s in zip(depths, plain, short):
        print(f"{d:>5}  {p:>18.3e}  {s:>24.3f}")
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    ax.semilogy(depths, plain, "o-", ms=3, label="plain: x <- F(x)")
    ax.semilogy(depths, short, "s-", ms=3, label="shortcut: x <- x + F(x)")
    ax.axhline(1.0, color="gray", lw=0.6, ls=":")
    ax.set_xlabel("depth L (layers)")
    ax.set_xticks(range(0, depths[-1] + 1, 2))
    ax.set_ylabel("|dx_L / dx_0|  (log scale)")
    ax.set_title("Gradient at the input of a stack of F(x) = tanh(0.5x)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save(fig, args.out, "scalar_stack.png")
    print(f"\n[{path}] Each plain layer multiplies the gradient by F'(x) <= 0.5, so after "
          f"{depths[-1]} layers it is {plain[-1]:.1e}: it vanishes geometrically. With the "
          "shortcut each layer multiplies it by 1 + F'(x) >= 1, so it never shrinks; the "
          "identity path carries it back unchanged and the branch only adds to it.")
    return dict(depth=depths[-1], plain=plain[-1], shortcut=short[-1])


# -----------------------------------------------------------------------------
# Text (experiments 2 and 3): Python's own documentation, one token per character

def load_text():
    from pydoc_data.topics import topics
    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.int64)
    n_train = int(0.9 * len(ids))
    return ids[:n_train], ids[n_train:], len(chars)


def get_batch(data, block_size, batch_size, rng):
    starts = rng.integers(0, len(data) - block_size - 1, size=batch_size)
    offsets = starts[:, None] + np.arange(block_size)  # (B, T)
    return mt.from_numpy(data[offsets]), mt.from_numpy(data[offsets + 1])


def make_gpt(args, vocab_size, n_layer, residual=True, prenorm=True):
    from models import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=args.block_size, n_layer=n_layer,
                         n_head=args.n_head, n_embd=args.n_embd, residual=residual,
                         prenorm=prenorm))


# -----------------------------------------------------------------------------
# Experiment 2: gradient norms at every block's input, at initialisation

CONFIGS = {  # name -> (residual, prenorm)
    "pre-norm, residual": (True, True),
    "pre-norm, no residual": (False, True),
    "post-norm, residual": (True, False),
    "post-norm, no residual": (False, False),
}


def block_grads(model, x, y):
    """One forward/backward of a fresh model through the recorder. Per block: the
    gradient norm at its input, the gradient norm over its parameters, and how different
    the positions' vectors are at its output (|h - mean over positions| / |h|)."""
    from models import TransformerBlock
    recorder = mti.GradientRecorder(model, modules=TransformerBlock)
    with recorder:
        _, loss = model(x, y)
    loss.backward()
    spread = []
    for call in recorder.calls.calls:
        if isinstance(call.module, TransformerBlock):
            h = call.outputs[0].numpy().astype(np.float64)  # (B, T, C)
            spread.append(np.linalg.norm(h - h.mean(axis=1, keepdims=True)) / np.linalg.norm(h))
    return dict(inputs=[r.input_norm for r in recorder],
                params=[r.param_norm for r in recorder], spread=spread), recorder


def experiment_depth(args, plt, train, vocab_size):
    print("\n== 2. Transformer stacks at initialisation: gradients reaching each block ==")
    rng = np.random.default_rng(args.seed)
    x, y = get_batch(train, args.block_size, args.batch_size, rng)  # one batch for all
    runs = {name: {} for name in CONFIGS}   # name -> depth -> block_grads(...)[0]
    for name, (residual, prenorm) in CONFIGS.items():
        for depth in args.depths:
            mt.manual_seed(args.seed)
            model = make_gpt(args, vocab_size, depth, residual, prenorm)
            runs[name][depth] = block_grads(model, x, y)[0]
    deepest = args.depths[-1]

    print("|dL/dx| at the input and |dL/dθ| of the parameters of the first, middle and "
          "last block:")
    print(f"{'config':<24}{'depth':>6}{'dx first':>10}{'middle':>10}{'last':>10}"
          f"{'dθ first':>10}{'middle':>10}{'last':>10}")
    for name in CONFIGS:
        for depth in args.depths:
            r = runs[name][depth]
            print(f"{name:<24}{depth:>6}" + "".join(
                f"{v[i]:>10.2e}" for v in (r["inputs"], r["params"]) for i in (0, len(v) // 2, -1)))

    # the skip/branch split, in a residual stack
    mt.manual_seed(args.seed)
    depth = min(6, deepest)
    recorder = block_grads(make_gpt(args, vocab_size, depth), x, y)[1]
    print(f"\nThe split in a {depth}-block pre-norm stack: the gradient at a block's input = "
          "skip (straight through the additions: dL/dy) + branch (through attention and the "
          "MLP), summed as vectors; the rows under each block split each of its two skip "
          "connections the same way:")
    split_table = recorder.table(units=True)
    print(split_table)

    paths = []
    for title, pair, file in (
            ("Residual connections on vs off (pre-norm), at initialisation",
             ("pre-norm, residual", "pre-norm, no residual"), "depth_residual.png"),
            ("Pre-norm vs post-norm (both with residuals), at initialisation",
             ("pre-norm, residual", "post-norm, residual"), "depth_norm.png")):
        paths.append(plot_depth(plt, runs, pair, args.depths, title, args.out, file))

    on, off = runs["pre-norm, residual"][deepest], runs["pre-norm, no residual"][deepest]
    post = runs["post-norm, residual"][deepest]
    collapsed = [i for i, v in enumerate(off["spread"]) if v < 1e-3]
    ratio = lambda v: v[0] / v[-1]
    # post-norm's block 0 against the median of the other blocks
    post_input_x = post["inputs"][0] / float(np.median(post["inputs"][1:]))
    post_param_x = post["params"][0] / float(np.median(post["params"][1:]))
    print(f"\n[{paths[0]}] With residuals each of the {deepest} blocks gets about the same "
          f"gradient for its weights (first/last {ratio(on['params']):.2f}) and the positions "
          f"keep distinct vectors (spread >= {min(on['spread']):.2f}). Without them the "
          "attention layers, nearly uniform at initialisation, average the positions block "
          "after block: "
          + (f"from block {collapsed[0]} on every position holds the same vector to 1 part in "
             "1000 (bottom right), so the model can no longer tell its inputs apart; "
             if collapsed else f"the spread falls to {min(off['spread']):.1e}; ")
          + (f"and at {deepest} blocks the first block's weights get only "
             f"{ratio(off['params']):.1e} of the last block's gradient."
             if ratio(off['params']) < 0.1 else
             f"the weight gradients have not shrunk yet at {deepest} blocks (first/last "
             f"{ratio(off['params']):.2f}); deeper stacks (the full run goes to 48) show "
             "whether they vanish."))
    print(f"\n[{paths[1]}] With GPT-2's initialisation (small output projections, so each "
          "block starts close to the identity) both placements start flat: post-norm's "
          f"blocks 1-{deepest - 1} get weight gradients from {min(post['params'][1:]):.2g} to "
          f"{max(post['params'][1:]):.2g}. Block 0 is the exception: in post-norm its "
          "attention reads the raw embeddings (scale 0.02) with no norm in front, so its "
          f"input gradient is {post_input_x:.0f}x the others' (its weights' "
          f"{post_param_x:.0f}x). Post-norm's trouble comes in training (experiment 3): its "
          "norms sit on the skip path, which stops being an identity as soon as the branches "
          "grow.")
    return dict(depths=list(args.depths), deepest=deepest,
                ratio_residual=ratio(on["params"]), spread_residual=min(on["spread"]),
                collapse_block=collapsed[0] if collapsed else None,
                spread_no_residual=min(off["spread"]), ratio_no_residual=ratio(off["params"]),
                post_block0_input=post_input_x, post_block0_params=post_param_x,
                post_params_min=min(post["params"][1:]), post_params_max=max(post["params"][1:]),
                split_depth=depth, split_table=split_table)


def plot_depth(plt, runs, pair, depths, title, out, file):
    """2 x 2 panels for two configurations: per block at the deepest depth, the gradient
    at the input, over the parameters and the spread across positions; and the
    first/last ratio of the parameter gradients against depth."""
    deepest = depths[-1]
    fig, axes = plt.subplots(2, 2, figsize=(9.0, 6.4))
    (ax_in, ax_par), (ax_ratio, ax_spread) = axes
    for name, color in zip(pair, ("C0", "C3")):
        r = runs[name][deepest]
        ax_in.semilogy(r["inputs"], color=color, label=name)
        ax_par.semilogy(r["params"], color=color, label=name)
        ax_spread.semilogy(r["spread"], color=color, label=name)
        ax_ratio.loglog(depths, [runs[name][d]["params"][0] / runs[name][d]["params"][-1]
                                 for d in depths], "o-", ms=3, color=color, label=name)
    ax_in.set_ylabel("|dL/dx| at the block's input")
    ax_par.set_ylabel("|dL/dθ| over the block's weights")
    ax_spread.set_ylabel("spread across positions")
    ax_spread.set_ylim(bottom=min(1e-7, ax_spread.get_ylim()[0]), top=3)
    for ax in (ax_in, ax_par, ax_spread):
        ax.set_xlabel(f"block (0 = nearest the input), {deepest} blocks")
    ax_ratio.set_xscale("log", base=2)
    ax_ratio.set_xticks(depths, [str(d) for d in depths])
    ax_ratio.minorticks_off()
    ax_ratio.axhline(1.0, color="gray", lw=0.6, ls=":")
    ax_ratio.set_xlabel("number of blocks")
    ax_ratio.set_ylabel("|dL/dθ|: first block / last block")
    for ax in axes.flat:
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, out, file)


# -----------------------------------------------------------------------------
# Experiment 3: a short training run

def train_run(args, train, val, vocab_size, n_layer, residual, prenorm):
    """AdamW with a short warmup, the same batches for every run; the training loss at
    every step and the validation loss at the end."""
    mt.manual_seed(args.seed)
    model = make_gpt(args, vocab_size, n_layer, residual, prenorm)
    optimizer = mt.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                               weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    warmup = max(1, args.train_iters // 20)
    losses = []
    for step in range(args.train_iters):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        x, y = get_batch(train, args.block_size, args.batch_size, rng)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        mt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    val_rng = np.random.default_rng(0)
    with mt.no_grad():
        val_loss = np.mean([model(*get_batch(val, args.block_size, args.batch_size,
                                             val_rng))[1].item() for _ in range(8)])
    return losses, float(val_loss)


def smooth(values, k):
    k = max(1, min(k, len(values)))
    kernel = np.ones(k) / k
    return np.convolve(values, kernel, mode="valid")


def experiment_training(args, plt, train, val, vocab_size):
    print("\n== 3. Training: the same model and budget, one piece changed ==")
    deep, shallow = args.train_layers, args.shallow_layers
    runs = {  # label -> (layers, residual, prenorm)
        f"{deep} blocks, pre-norm, residual": (deep, True, True),
        f"{deep} blocks, pre-norm, no residual": (deep, False, True),
        f"{deep} blocks, post-norm, residual": (deep, True, False),
        f"{shallow} blocks, pre-norm, residual": (shallow, True, True),
        f"{shallow} blocks, post-norm, residual": (shallow, True, False),
    }
    counts = np.bincount(train, minlength=vocab_size) / len(train)
    unigram = float(-(counts[counts > 0] * np.log(counts[counts > 0])).sum())
    results = {}
    print(f"{'run':<36}{'train loss (last 10%)':>22}{'val loss':>10}{'time':>8}")
    for label, (n_layer, residual, prenorm) in runs.items():
        t0 = time.time()
        results[label] = train_run(args, train, val, vocab_size, n_layer, residual, prenorm)
        print(f"{label:<36}{tail(results[label][0]):>22.3f}{results[label][1]:>10.3f}"
              f"{time.time() - t0:>7.0f}s")
    labels = list(runs)
    panels = ((f"residual on vs off, {deep} blocks", labels[0:2]),
              (f"pre- vs post-norm, {deep} blocks", [labels[0], labels[2]]),
              (f"pre- vs post-norm, {shallow} blocks", labels[3:5]))
    fig, axes = plt.subplots(1, 3, figsize=(11.0, 3.5), sharey=True)
    k = max(1, args.train_iters // 15)
    for ax, (title, pair) in zip(axes, panels):
        for label, color in zip(pair, ("C0", "C3")):
            losses = results[label][0]
            ax.plot(losses, color=color, alpha=0.2, lw=0.6)
            ax.plot(range(k - 1, len(losses)), smooth(losses, k), color=color,
                    label=label.split(", ", 1)[1])
        ax.axhline(unigram, color="gray", lw=0.6, ls=":")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training loss (nats/char)")
    axes[0].set_ylim(top=min(axes[0].get_ylim()[1], 6.0))  # a spike would squash the rest
    fig.suptitle(f"Character GPT on Python's docs: {args.train_iters} AdamW steps, "
                 f"lr {args.lr:g}, same batches for every run", fontsize=10)
    fig.tight_layout()
    path = save(fig, args.out, "training.png")
    final = {label: tail(results[label][0]) for label in labels}
    left = {label: escape_step(results[label][0], unigram, k) for label in labels}
    print(f"\n[{path}] Same budget, one change per panel. Left: without residuals the "
          f"{deep}-block model ends at {final[labels[1]]:.2f} nats/char against "
          f"{final[labels[0]]:.2f} with them. Middle: at {deep} blocks post-norm ends at "
          f"{final[labels[2]]:.2f}, pre-norm at {final[labels[0]]:.2f}; pre-norm leaves the "
          f"plateau {describe_step(left[labels[0]])}, post-norm "
          f"{describe_step(left[labels[2]])}. Right: at {shallow} "
          f"blocks the placement of the norm matters less ({final[labels[4]]:.2f} post vs "
          f"{final[labels[3]]:.2f} pre). The dotted line, {unigram:.2f} nats/char, is the "
          "entropy of the character frequencies: a curve stuck there is a model that "
          "predicts how common each character is and ignores its input.")
    return dict(train_iters=args.train_iters, lr=args.lr, batch_size=args.batch_size,
                block_size=args.block_size, deep=deep, shallow=shallow, unigram=unigram,
                final=final, val={label: results[label][1] for label in labels},
                escape=left, labels=labels)


def escape_step(losses, plateau, k):
    """The first step where the smoothed loss is 0.15 nats below the plateau, or None."""
    below = np.nonzero(smooth(losses, k) < plateau - 0.15)[0]
    return int(below[0]) + k - 1 if len(below) else None


def describe_step(step):
    return "never (within this budget)" if step is None else f"at step {step}"


def tail(losses):
    """The mean of the last 10% of a loss curve."""
    return float(np.mean(losses[-max(1, len(losses) // 10):]))


# -----------------------------------------------------------------------------

def save(fig, out, name):
    """The figure as a small PNG in `out` (written under a temporary name of this process,
    then renamed); returns its path, relative when it is below the working directory."""
    import matplotlib.pyplot as plt
    path = os.path.join(out, name)
    try:
        _cli.replace_with(path, lambda tmp: mti.save_small_png(fig, tmp, dpi=90, colors=128))
    finally:
        plt.close(fig)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def parse_args(argv=None):
    quick_depths = QUICK["depths"]
    parser = _cli.ArgumentParser(
        prog="residual_flow.py",
        description="Gradient flow through deep stacks, with and without residual "
                    "connections: tables on stdout, pictures in --out. Takes about "
                    f"{_cli.minutes(FULL_RUN_SECONDS)} on one CPU core, --quick about "
                    f"{_cli.minutes(QUICK_RUN_SECONDS)} (measured: {FULL_RUN_SECONDS} s and "
                    f"{QUICK_RUN_SECONDS} s of CPU time).")
    parser.add_argument("--out", default=DEFAULTS["out"], help="directory for the PNGs, "
                        f"created if needed (default: {DEFAULTS['out']}/ in the working "
                        "directory; docs/regenerate.py passes --out docs/img)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller study: depths {', '.join(map(str, quick_depths))}, "
                             f"context {QUICK['block_size']}, {QUICK['train_iters']} training "
                             "steps per run")
    parser.add_argument("--depths", type=_cli.integer(2), nargs="+", metavar="N",
                        help="stack depths for experiment 2, each >= 2 (the study compares "
                             f"the first block with the others; default: "
                             f"{' '.join(map(str, DEFAULTS['depths']))}, --quick "
                             f"{' '.join(map(str, quick_depths))})")
    parser.add_argument("--train_iters", type=_cli.positive_int, metavar="N",
                        help="training steps per run in experiment 3, >= 1 (default: "
                             f"{DEFAULTS['train_iters']}, --quick {QUICK['train_iters']})")
    parser.add_argument("--lr", type=_cli.positive_number, help="AdamW learning rate in "
                        f"experiment 3, > 0 (default: {DEFAULTS['lr']:g})")
    parser.add_argument("--skip", choices=["scalar", "depth", "training"], nargs="+",
                        default=[], help="experiments to leave out (default: none)")
    parser.add_argument("--seed", type=_cli.seed_int, default=DEFAULTS["seed"],
                        help=f"seed of the weights and the batches (default: {DEFAULTS['seed']})")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers the sentences "
                        "quote to FILE, as JSON (docs/regenerate.py reads them; default: none)")
    args = parser.parse_args(argv)
    settings = dict(DEFAULTS, **(QUICK if args.quick else {}))
    for key, value in vars(args).items():
        if value is not None and key not in ("quick", "skip"):
            settings[key] = value
    settings["depths"] = sorted(set(settings["depths"]))
    for key, value in settings.items():
        setattr(args, key, value)
    if set(args.skip) != {"scalar", "depth", "training"}:
        _cli.writable_dir(parser.prog, args.out)
    return args


def study(args):
    """Run the experiments not in args.skip; returns their numbers by experiment (the
    sentences printed with each picture, and docs/RESIDUAL_FLOW.md, quote them)."""
    mt.set_num_threads(1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = time.time()
    facts = {}
    if "scalar" not in args.skip:
        facts["scalar"] = experiment_scalar(args, plt)
    if "depth" not in args.skip or "training" not in args.skip:
        train, val, vocab_size = load_text()
    if "depth" not in args.skip:
        facts["depth"] = experiment_depth(args, plt, train, vocab_size)
    if "training" not in args.skip:
        facts["training"] = experiment_training(args, plt, train, val, vocab_size)
    print(f"\ndone in {time.time() - t0:.0f}s; pictures in {args.out}/")
    return facts


def main(argv=None):
    args = parse_args(argv)
    facts = study(args)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
    return 0


if __name__ == "__main__":
    _cli.run(main)
