"""Double backpropagation: a classifier trained with a penalty on its input gradient.

    python examples/double_backprop.py                  # with and without the penalty
    python examples/double_backprop.py --compare_torch  # the same steps in PyTorch too

Drucker & LeCun (1992) added to a classifier's loss the squared norm of the gradient of
each example's loss with respect to that example's input:

    L = mean_i CE_i  +  lam * mean_i ||d CE_i / d x_i||^2

The penalty is itself a gradient, so minimising L needs the gradient of a gradient: it
is computed with create_graph=True, and L.backward() then differentiates through that
first backward pass. A small input gradient means the loss changes little when a point
moves a little: the decision boundary keeps its distance from the training points.

The training code below is written once and run by microtensor and (with
--compare_torch) by PyTorch, from the same initial weights in float64; the script
prints how far apart the two end up (rounding, ~1e-13).
"""
import time
from types import SimpleNamespace

if __name__ == "__main__":
    # (tests load this file by path, without examples/ on sys.path: they need no _cli)
    import _cli
    _cli.script(__name__)   # from here on, Ctrl-C exits quietly

import numpy as np  # noqa: E402

import microtensor as mt  # noqa: E402

# -----------------------------------------------------------------------------
DEFAULTS = dict(
    n_points=200,        # two interleaved half-moons in 2-D, half per class
    noise=0.15,
    hidden=32,           # MLP 2 -> hidden -> hidden -> 2, GELU
    steps=400,           # full-batch SGD steps
    lr=0.2,
    momentum=0.9,
    penalty=0.3,         # lam above
    seed=0,
)
RUN_SECONDS = 15         # the default run, microtensor only, on one core


def make_moons(n, noise, seed):
    """(n, 2) float64 points and (n,) int64 labels: two interleaved half circles."""
    r = np.random.default_rng(seed)
    t = r.uniform(0, np.pi, n)
    label = np.arange(n) % 2
    x = np.where(label[:, None] == 0,
                 np.stack([np.cos(t), np.sin(t)], 1),
                 np.stack([1 - np.cos(t), 0.5 - np.sin(t)], 1))
    return x + noise * r.standard_normal((n, 2)), label.astype(np.int64)


def init_weights(hidden, seed):
    """[W1, b1, W2, b2, W3, b3] as numpy arrays (both libraries start from these)."""
    r = np.random.default_rng(seed + 1)
    sizes = [(hidden, 2), (hidden, hidden), (2, hidden)]
    weights = []
    for out_f, in_f in sizes:
        weights += [r.standard_normal((out_f, in_f)) / np.sqrt(in_f), np.zeros(out_f)]
    return weights


def backend(name):
    """The same names from microtensor or from torch: the training code reads alike."""
    if name == "torch":
        import torch
        return SimpleNamespace(tensor=lambda a, **kw: torch.tensor(a, **kw), F=torch.nn.functional,
                               grad=torch.autograd.grad, SGD=torch.optim.SGD)
    return SimpleNamespace(tensor=mt.tensor, F=mt.nn.functional, grad=mt.autograd.grad,
                           SGD=mt.optim.SGD)


def mlp(F, params, x):
    w1, b1, w2, b2, w3, b3 = params
    return F.linear(F.gelu(F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)), w3, b3)  # (N, 2)


def train(library="microtensor", penalty=DEFAULTS["penalty"], steps=DEFAULTS["steps"],
          lr=DEFAULTS["lr"], momentum=DEFAULTS["momentum"], hidden=DEFAULTS["hidden"],
          n_points=DEFAULTS["n_points"], noise=DEFAULTS["noise"], seed=DEFAULTS["seed"],
          log_every=0):
    """Full-batch SGD on CE + penalty * mean ||dCE_i/dx_i||^2; returns the final weights
    (numpy) and a history of (step, CE, penalty term, accuracy)."""
    lib = backend(library)
    x_np, y_np = make_moons(n_points, noise, seed)
    x = lib.tensor(x_np, requires_grad=True)        # we need d loss / d x
    y = lib.tensor(y_np)
    params = [lib.tensor(w, requires_grad=True) for w in init_weights(hidden, seed)]
    opt = lib.SGD(params, lr=lr, momentum=momentum)
    history = []
    for step in range(steps + 1):
        logits = mlp(lib.F, params, x)
        losses = lib.F.cross_entropy(logits, y, reduction="none")             # (N,)
        ce = losses.mean()
        # row i of d(sum_j CE_j)/dx is dCE_i/dx_i (the examples do not interact);
        # create_graph=True keeps this gradient differentiable for loss.backward()
        (grad_x,) = lib.grad(losses.sum(), x, create_graph=True)            # (N, 2)
        grad_norm2 = (grad_x * grad_x).sum(1).mean()
        loss = ce + penalty * grad_norm2
        if log_every and (step % log_every == 0 or step == steps):
            acc = float((logits.detach().numpy().argmax(1) == y_np).mean())
            history.append((step, float(ce.item()), float(grad_norm2.item()), acc))
        if step == steps:
            break
        opt.zero_grad()
        x.grad = None
        loss.backward()
        opt.step()
    return [p.detach().numpy().copy() for p in params], history


def main(argv=None):
    import _cli
    parser = _cli.ArgumentParser(
        prog="double_backprop.py",
        description="A gradient-norm penalty in the loss (double backpropagation): trains a "
                    "small MLP on two half-moons with and without it and prints both runs. "
                    f"Takes about {_cli.minutes(RUN_SECONDS)} on one CPU core "
                    "(--compare_torch: about twice that).")
    parser.add_argument("--penalty", type=_cli.nonnegative_number, default=DEFAULTS["penalty"],
                        help="weight lam of the input-gradient penalty, >= 0 (default: "
                             f"{DEFAULTS['penalty']})")
    parser.add_argument("--steps", type=_cli.positive_int, default=DEFAULTS["steps"],
                        help=f"full-batch SGD steps, >= 1 (default: {DEFAULTS['steps']})")
    parser.add_argument("--lr", type=_cli.positive_number, default=DEFAULTS["lr"],
                        help=f"SGD learning rate, > 0 (default: {DEFAULTS['lr']})")
    parser.add_argument("--hidden", type=_cli.positive_int, default=DEFAULTS["hidden"],
                        help=f"width of the two hidden layers (default: {DEFAULTS['hidden']})")
    parser.add_argument("--seed", type=_cli.seed_int, default=DEFAULTS["seed"],
                        help=f"seed of the data and the weights (default: {DEFAULTS['seed']})")
    parser.add_argument("--compare_torch", action="store_true",
                        help="run the same training in PyTorch as well and print how far "
                             "the weights end up from microtensor's")
    args = parser.parse_args(argv)
    if args.compare_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            _cli.fail(parser.prog, "--compare_torch needs PyTorch (pip install torch)")
    mt.set_num_threads(1)
    options = dict(steps=args.steps, lr=args.lr, hidden=args.hidden, seed=args.seed,
                   log_every=max(1, args.steps // 8))
    t0 = time.time()
    runs = {}
    for lam in (0.0, args.penalty):
        runs[lam] = train("microtensor", penalty=lam, **options)
        print(f"penalty lam = {lam:g}")
        print(f"  {'step':>5}  {'cross-entropy':>13}  {'mean |dCE_i/dx_i|^2':>20}  accuracy")
        for step, ce, g2, acc in runs[lam][1]:
            print(f"  {step:5d}  {ce:13.4f}  {g2:20.5f}  {acc:8.3f}")
    (_, plain), (_, penalised) = runs[0.0], runs[args.penalty]
    print(f"the penalty cut the input-gradient norm^2 from {plain[-1][2]:.4f} to "
          f"{penalised[-1][2]:.4f} (cross-entropy {plain[-1][1]:.4f} -> {penalised[-1][1]:.4f})")
    if args.compare_torch:
        theirs, t_hist = train("torch", penalty=args.penalty, **options)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(runs[args.penalty][0], theirs))
        loss_diff = abs(t_hist[-1][1] - penalised[-1][1])
        print(f"PyTorch, same steps: largest weight difference {diff:.2e}, final cross-entropy "
              f"difference {loss_diff:.2e}")
    print(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    _cli.run(main)
