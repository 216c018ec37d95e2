"""Draw the computation graph behind a tensor: a tiny expression and one Transformer block.

    python examples/graph.py                  # DOT files and PNGs in out-graph/
    python examples/graph.py --out /tmp/g     # elsewhere
    python examples/graph.py --animate        # the backward pass as a GIF, and two stills
    dot -Tsvg out-graph/graph_block.dot > b.svg   # with Graphviz, for the clusters

Every box is one backward node (`t.grad_fn.name()`) with the shape of the tensor its
op produced; blue boxes are parameters (named as in `model.named_parameters()`), yellow
ones other leaves. Arrows follow the forward pass (an input points at the op that reads
it); backward walks them the other way. When Graphviz's `dot` is installed the PNGs come
from it, otherwise microtensor draws the layered graph itself with matplotlib.
docs/regenerate.py runs it with --out docs/img for the pictures of docs/RESIDUAL_FLOW.md.

--animate watches the engine instead (mt.inspect.BackwardTrace) as it runs the backward
pass of a two-block residual model: boxes light up in the order the engine reaches them,
each edge gets as wide as the log of the gradient norm that went along it, and each
residual addition is labelled with the norms of the two parts of the gradient reaching
its stream (skip: straight through the addition; branch: back through attention or the
MLP). The last frames set 12 blocks with residuals beside 12 without. It writes
backward_pass.gif, backward_pass.png (its last frame) and backward_depth.png.
"""
import os
import subprocess

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

# NOTE: microtensor is imported inside the functions, once the command line has been
# checked: --help and a bad option answer at once

DEFAULTS = dict(out="out-graph", n_embd=16, n_head=2, seq_len=4, seed=0)
ANIMATION = dict(n_embd=16, n_head=2, seq_len=6, vocab=11, fps=2, dpi=72, hold=3)


def expression_graph():
    """L = sum(tanh(w * x + b)^2): the graph of a tiny neuron."""
    import microtensor as mt
    x = mt.tensor([0.5, -1.0, 2.0])
    w = mt.tensor([1.0, 0.5, -0.3], requires_grad=True)
    b = mt.tensor(0.1, requires_grad=True)
    h = (w * x + b).tanh()
    loss = (h ** 2).sum()
    return loss, {"w": w, "b": b, "h": h, "loss": loss}


def block_graph(args, prenorm=True):
    """One TransformerBlock on a (1, T, C) input, with its module calls tracked."""
    import microtensor as mt
    from microtensor import inspect as mti
    from models import TransformerBlock
    mt.manual_seed(args.seed)
    block = TransformerBlock(args.n_embd, args.n_head, prenorm=prenorm)
    x = mt.randn(1, args.seq_len, args.n_embd, requires_grad=True)
    with mti.track_modules(block) as calls:
        y = block(x)
    return y, block, calls, {"x": x}


def write(graph, out, name, engine, dpi=72):
    """name.dot and name.png in `out`, each written under a temporary name of this
    process and then renamed."""
    dot_path = os.path.join(out, name + ".dot")

    def write_dot(tmp):
        with open(tmp, "w") as f:
            f.write(graph.to_dot())
    _cli.replace_with(dot_path, write_dot)
    png_path = os.path.join(out, name + ".png")
    try:
        _cli.replace_with(png_path, lambda tmp: graph.save_png(tmp, dpi=dpi, engine=engine))
    except (OSError, subprocess.CalledProcessError) as e:
        _cli.fail("graph.py", f"drawing {png_path} failed: {e}", _cli.EXIT_ERROR)
    print(f"  {dot_path}\n  {png_path}  ({graph.num_ops} ops, {len(graph.nodes)} boxes, "
          f"{os.path.getsize(png_path) // 1024} KB)")


def residual_stack(n_layer, residual, seed):
    """n_layer pre-norm TransformerBlocks, a final norm and a linear head, on a random
    (1, T, C) input with random targets; the loss computed with every module call
    tracked. Returns (loss, graph, input)."""
    import microtensor as mt
    from microtensor import nn, inspect as mti
    from microtensor.nn import functional as F
    from models import TransformerBlock
    C, V, T = ANIMATION["n_embd"], ANIMATION["vocab"], ANIMATION["seq_len"]

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([TransformerBlock(C, ANIMATION["n_head"], residual=residual)
                                    for _ in range(n_layer)])
            self.ln_f = nn.LayerNorm(C)
            self.head = nn.Linear(C, V)

        def forward(self, x, targets):
            for block in self.h:
                x = block(x)
            return F.cross_entropy(self.head(self.ln_f(x)).view(-1, V), targets.view(-1))

    mt.manual_seed(seed)
    model = Stack()
    x = mt.randn(1, T, C, requires_grad=True)
    targets = mt.randint(0, V, (1, T))
    with mti.track_modules(model) as calls:
        loss = model(x, targets)
    # two blocks: one box per sublayer, the residual additions between them;
    # a deep stack: one box per block
    graph = mti.build_graph(loss, module=model, calls=calls, names={"x": x},
                            collapse=True, depth=1 if n_layer <= 2 else 0)
    return loss, graph, x


def without_params(graph):
    """The graph less its parameter boxes: the animation follows the stream."""
    keep = {i for i, n in graph.nodes.items() if n.kind != "param"}
    graph.nodes = {i: n for i, n in graph.nodes.items() if i in keep}
    graph.edges = [(a, b) for a, b in graph.edges if a in keep and b in keep]
    graph.origin = {i: members for i, members in graph.origin.items() if i in keep}
    return graph


def traced_flow(n_layer, residual, seed):
    from microtensor import inspect as mti
    loss, graph, _ = residual_stack(n_layer, residual, seed)
    graph = without_params(graph)
    with mti.BackwardTrace(keep_grads=True) as trace:
        loss.backward()
    return mti.GradientFlow(graph, trace)


def animate(args):
    """backward_pass.gif and its stills (see the module doc)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import PillowWriter
    from microtensor import inspect as mti

    flow = traced_flow(2, True, args.seed)
    deep = {res: traced_flow(args.deep, res, args.seed) for res in (True, False)}
    ranges = [f.norm_range() for f in deep.values()]
    deep_scale = (min(r[0] for r in ranges), max(r[1] for r in ranges))

    def size(f):
        _, box_w, _, center, _ = f.geometry()
        xs, ys = [c[0] for c in center.values()], [c[1] for c in center.values()]
        return max(xs) - min(xs) + 3.0, max(ys) - min(ys) + 0.8
    w2, h2 = size(flow)
    wd, hd = (max(v) for v in zip(*(size(f) for f in deep.values())))
    top = 1.3                    # inches above the drawing: title and legend
    width, height = max(w2, 2 * wd), max(h2, hd) + top
    fig = plt.figure(figsize=(width, height))
    n = len(flow.steps)
    legend = ("boxes: light orange once reached, dark orange at this step\n"
              "edges: as wide as the log of the gradient norm sent along them\n"
              "(skip connections orange); beside each addition, the norms of the\n"
              "gradient's two parts: skip (through the addition), branch (through the sublayer)")

    def pass_frame(step):
        fig.clf()
        ax = fig.add_axes([0.02, 0.02, 0.96, (height - top) / height])
        box = flow.graph.nodes[flow.steps[step]].label.splitlines()[0]
        flow.draw(ax, step)
        fig.text(0.5, 1 - 0.3 / height, f"backward, step {step + 1} of {n}: the engine "
                 f"reaches {box.replace('Backward', '')}", ha="center", fontsize=10,
                 weight="bold")
        fig.text(0.5, 1 - 0.5 / height, legend, ha="center", va="top", fontsize=7.5)

    def depth_frame():
        fig.clf()
        for k, res in enumerate((True, False)):
            ax = fig.add_axes([0.02 + 0.49 * k, 0.02, 0.47, (height - top) / height])
            f = deep[res]
            # the gradient a block sends back to its input, beside the block
            notes = {b: f"|dL/dx| {norm:.2g}" for (a, b), norm in f.edge_norm.items()
                     if f.graph.nodes[b].kind == "module"}
            f.draw(ax, scale=deep_scale, notes=notes, splits=False,
                   title=f"{args.deep} blocks, {'with' if res else 'without'} residuals")
        fig.text(0.5, 1 - 0.3 / height, f"the gradient reaching each block's input, "
                 f"{args.deep} blocks at initialisation", ha="center", fontsize=10,
                 weight="bold")
        fig.text(0.5, 1 - 0.5 / height, "edge width: log of the gradient norm, one scale "
                 "for both;\nbeside each block, the norm of the gradient\nit sends back to its "
                 "input", ha="center", va="top", fontsize=7.5)

    gif = os.path.join(args.out, "backward_pass.gif")

    def write_gif(tmp):
        writer = PillowWriter(fps=ANIMATION["fps"])
        with writer.saving(fig, tmp, dpi=ANIMATION["dpi"]):
            for step in range(n):
                pass_frame(step)
                writer.grab_frame()
            for _ in range(ANIMATION["hold"] - 1):
                writer.grab_frame()
            depth_frame()
            for _ in range(ANIMATION["hold"]):
                writer.grab_frame()
    _cli.replace_with(gif, write_gif)
    pass_frame(n - 1)
    still = os.path.join(args.out, "backward_pass.png")
    _cli.replace_with(still, lambda tmp: mti.save_small_png(fig, tmp, dpi=80))
    depth_frame()
    depth = os.path.join(args.out, "backward_depth.png")
    _cli.replace_with(depth, lambda tmp: mti.save_small_png(fig, tmp, dpi=80))
    plt.close(fig)
    for path, what in ((gif, f"the {n} steps of the pass, then {args.deep} blocks"),
                       (still, "its last step"),
                       (depth, f"{args.deep} blocks with and without residuals")):
        print(f"  {path}  ({what}, {os.path.getsize(path) // 1024} KB)")
    return 0


def main(argv=None):
    parser = _cli.ArgumentParser(
        prog="graph.py",
        description="Draw the computation graph of a tiny expression and of one "
                    "Transformer block (DOT + PNG). Takes a few seconds.")
    parser.add_argument("--out", default=DEFAULTS["out"], help="output directory, created "
                        f"if needed (default: {DEFAULTS['out']}/ in the working directory)")
    parser.add_argument("--engine", choices=["auto", "dot", "matplotlib"], default="auto",
                        help="who draws the PNGs: auto = Graphviz's dot if it is installed, "
                             "else matplotlib; dot = Graphviz only (an error without it); "
                             "matplotlib = microtensor's own layout (default: auto)")
    parser.add_argument("--post_norm", action="store_true",
                        help="draw a post-norm block instead of GPT-2's pre-norm one "
                             "(default: pre-norm)")
    parser.add_argument("--animate", action="store_true",
                        help="instead of the graphs, write an animation of the backward "
                             "pass over a two-block residual model (backward_pass.gif) and "
                             "two stills (default: off)")
    parser.add_argument("--deep", type=_cli.integer(3, 48), default=12, metavar="N",
                        help="with --animate, the depth of the stacks compared at the end, "
                             "with and without residuals (3 to 48; default: 12)")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS.items():
        setattr(args, key, getattr(args, key, value))
    from microtensor import inspect as mti
    if args.engine == "dot" and not mti.dot_available():
        _cli.fail(parser.prog, "--engine dot needs Graphviz's `dot` program, which is not on "
                               "PATH; install Graphviz or use --engine matplotlib")
    _cli.writable_dir(parser.prog, args.out)
    if args.animate:
        return animate(args)
    use_dot = args.engine != "matplotlib" and mti.dot_available()
    print(f"PNG engine: {'Graphviz dot' if use_dot else 'matplotlib'}")

    loss, names = expression_graph()
    print("\nloss = sum(tanh(w * x + b) ** 2), x a constant (no gradient, so not drawn):")
    print(mti.to_dot(loss, names=names))
    write(mti.build_graph(loss, names=names, title="loss = sum(tanh(w*x + b)^2)"),
          args.out, "graph_expression", args.engine, dpi=160)   # small: drawn large

    y, block, calls, names = block_graph(args, prenorm=not args.post_norm)
    kind = "post-norm" if args.post_norm else "pre-norm"
    print(f"\none {kind} TransformerBlock(n_embd={args.n_embd}, n_head={args.n_head}) on "
          f"x of shape {tuple(names['x'].shape)}:")
    write(mti.build_graph(y, module=block, calls=calls, names=names,
                          title=f"one {kind} TransformerBlock, every op "
                                "(orange: skip connections)"),
          args.out, "graph_block", args.engine)
    print("\nthe same block, one box per submodule (collapse=True); the two AddBackward "
          "left are the residual connections:")
    write(mti.build_graph(y, module=block, calls=calls, names=names, collapse=True,
                          title=f"one {kind} TransformerBlock, by module"),
          args.out, "graph_block_collapsed", args.engine, dpi=160)   # few boxes: drawn large
    return 0


if __name__ == "__main__":
    _cli.run(main)
