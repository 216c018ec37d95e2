"""Draw the computation graph behind a tensor: a tiny expression and one Transformer block.

    python examples/graph.py                  # DOT files and PNGs in out-graph/
    python examples/graph.py --out /tmp/g     # elsewhere
    dot -Tsvg out-graph/graph_block.dot > b.svg   # with Graphviz, for the clusters

Every box is one backward node (`t.grad_fn.name()`) with the shape of the tensor its
op produced; blue boxes are parameters (named as in `model.named_parameters()`), yellow
ones other leaves. Arrows follow the forward pass (an input points at the op that reads
it); backward walks them the other way. When Graphviz's `dot` is installed the PNGs come
from it, otherwise microtensor draws the layered graph itself with matplotlib.
docs/regenerate.py runs it with --out docs/img for the pictures of docs/RESIDUAL_FLOW.md.
"""
import os
import subprocess

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

# NOTE: microtensor is imported inside the functions, once the command line has been
# checked: --help and a bad option answer at once

DEFAULTS = dict(out="out-graph", n_embd=16, n_head=2, seq_len=4, seed=0)


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


def write(graph, out, name, engine):
    """name.dot and name.png in `out`, each written under a temporary name of this
    process and then renamed."""
    dot_path = os.path.join(out, name + ".dot")

    def write_dot(tmp):
        with open(tmp, "w") as f:
            f.write(graph.to_dot())
    _cli.replace_with(dot_path, write_dot)
    png_path = os.path.join(out, name + ".png")
    try:
        _cli.replace_with(png_path, lambda tmp: graph.save_png(tmp, dpi=72, engine=engine))
    except (OSError, subprocess.CalledProcessError) as e:
        _cli.fail("graph.py", f"drawing {png_path} failed: {e}", _cli.EXIT_ERROR)
    print(f"  {dot_path}\n  {png_path}  ({graph.num_ops} ops, {len(graph.nodes)} boxes, "
          f"{os.path.getsize(png_path) // 1024} KB)")


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
    args = parser.parse_args(argv)
    for key, value in DEFAULTS.items():
        setattr(args, key, getattr(args, key, value))
    from microtensor import inspect as mti
    if args.engine == "dot" and not mti.dot_available():
        _cli.fail(parser.prog, "--engine dot needs Graphviz's `dot` program, which is not on "
                               "PATH; install Graphviz or use --engine matplotlib")
    _cli.writable_dir(parser.prog, args.out)
    use_dot = args.engine != "matplotlib" and mti.dot_available()
    print(f"PNG engine: {'Graphviz dot' if use_dot else 'matplotlib'}")

    loss, names = expression_graph()
    print("\nloss = sum(tanh(w * x + b) ** 2), x a constant (no gradient, so not drawn):")
    print(mti.to_dot(loss, names=names))
    write(mti.build_graph(loss, names=names, title="loss = sum(tanh(w*x + b)^2)"),
          args.out, "graph_expression", args.engine)

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
          args.out, "graph_block_collapsed", args.engine)
    return 0


if __name__ == "__main__":
    _cli.run(main)
