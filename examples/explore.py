"""See inside one training step in the browser: the graph, every value and gradient.

    python examples/explore.py                   # the main job's GPT -> explore.html
    python examples/explore.py --out step.html   # elsewhere
    python examples/explore.py --n_layer 12 --n_embd 64 --block_size 64 --batch_size 8 \\
        --no-residual                            # the residual study's 12-block model

Builds the model of examples/train_char.py with its default settings (2 layers, 128
wide, on Python's documentation text), takes one training step on one batch through
mt.inspect.explore (forward with every module call tracked, backward under the
engine's per-node hook, one AdamW step at the schedule's first learning rate) and writes
one self-contained HTML page: no server, no network, open it by double-click. In it:
click a node for its value and gradient statistics and its rule's math; step the
backward pass in the engine's order (the arrow keys, or play); unfold a block; search
by name; the address (#node=op12) links to the selected node.
"""
import argparse
import os
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

from train_char import DEFAULTS as TRAIN, get_lr   # noqa: E402  (no heavy imports there)

DEFAULTS = dict(
    out="explore.html",     # the page
    data=None,              # UTF-8 text; None = Python's documentation (pydoc_data)
    n_layer=TRAIN["n_layer"], n_head=TRAIN["n_head"], n_embd=TRAIN["n_embd"],
    block_size=TRAIN["block_size"], batch_size=TRAIN["batch_size"],
    seed=TRAIN["seed"],
)


def build_parser():
    p = _cli.ArgumentParser(
        prog="explore.py",
        description="Take one training step of the main job's model (examples/train_char.py "
                    "with its defaults) and write the step's autograd graph, with every "
                    "value, gradient and the engine's backward order, as one self-contained "
                    "HTML page (no network; open it in any browser by double-click). The "
                    "model options below reproduce other models, e.g. the residual study's "
                    "12-block stacks: --n_layer 12 --n_embd 64 --block_size 64 --batch_size 8 "
                    "[--no-residual]. Runs in a few seconds.")
    p.add_argument("--out", default=DEFAULTS["out"], metavar="PATH",
                   help=f"the HTML page to write (default: {DEFAULTS['out']})")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="UTF-8 text to take the batch from (default: Python's documentation "
                        "text, pydoc_data.topics, as the main job)")
    for name, help in (("n_layer", "transformer blocks"), ("n_head", "attention heads"),
                       ("n_embd", "embedding width (a multiple of n_head)"),
                       ("block_size", "context length in characters"),
                       ("batch_size", "sequences in the batch")):
        p.add_argument(f"--{name}", type=_cli.positive_int, default=DEFAULTS[name],
                       metavar=name.upper(), help=f"{help} (default: {DEFAULTS[name]})")
    p.add_argument("--residual", action=argparse.BooleanOptionalAction, default=True,
                   help="skip connections around attention and the MLP (default: on)")
    p.add_argument("--prenorm", action=argparse.BooleanOptionalAction, default=True,
                   help="normalise before each sublayer (default: on)")
    p.add_argument("--unfold", action="store_true",
                   help="open the page with every block unfolded (default: blocks folded)")
    p.add_argument("--seed", type=_cli.seed_int, default=DEFAULTS["seed"],
                   help=f"initialisation and batch seed (default: {DEFAULTS['seed']})")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.check_heads(parser.prog, "n_embd", args.n_embd, args.n_head)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _cli.writable_dir(parser.prog, out_dir, "--out")

    import numpy as np
    import microtensor as mt
    import chardata
    from models import GPT, GPTConfig

    # data: the main job's corpus and tokenizer, one random training batch
    try:
        text = chardata.load_corpus(args.data)
        tokenizer = chardata.CharTokenizer.from_text(text)
        ids = tokenizer.encode(text)
        train, _ = chardata.train_val_split(ids, args.block_size, args.data or "the corpus")
    except chardata.CharDataError as e:
        _cli.fail(parser.prog, str(e))
    x, y = chardata.get_batch(train, args.block_size, args.batch_size,
                              np.random.default_rng(args.seed))     # (B, T) each

    # model and optimizer as train_char.py builds them
    mt.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                          dropout=TRAIN["dropout"], bias=TRAIN["bias"], norm=TRAIN["norm"],
                          pos=TRAIN["pos"], mlp=TRAIN["mlp"], prenorm=args.prenorm,
                          tie_weights=TRAIN["tie_weights"], residual=args.residual))
    params = [p for p in model.parameters() if p.requires_grad]
    run = dict(TRAIN, min_lr=TRAIN["lr"] / 10, lr_decay_iters=TRAIN["max_iters"])
    lr = get_lr(0, run)                    # the first step's learning rate (warmup)
    optimizer = mt.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": TRAIN["weight_decay"]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=(TRAIN["beta1"], TRAIN["beta2"]))

    # the step: forward (module calls tracked), backward (watched), optimizer.step()
    start = time.perf_counter()
    title = (f"GPT {args.n_layer} layers x {args.n_embd}, "
             f"{'residual' if args.residual else 'no residual'}, one AdamW step (lr {lr:.2g})")
    explorer = mt.inspect.explore(lambda: model(x, y), model=model, optimizer=optimizer,
                                  title=title, fold="none" if args.unfold else "auto")
    _cli.replace_with(args.out, explorer.save)
    seconds = time.perf_counter() - start
    meta = explorer.data["meta"]
    path = os.path.abspath(args.out)
    print(f"wrote {args.out}: {meta['nodes']} nodes ({meta['ops']} ops), loss "
          f"{meta['loss']:.4f}, {os.path.getsize(args.out) / 1024:.0f} KB, in {seconds:.1f} s")
    print(f"open it in a browser (no server needed): file://{path}")
    print("  click a node: value and gradient; the arrow keys or play: the backward pass; "
          "#node=<id> in the address selects a node")
    return 0


if __name__ == "__main__":
    _cli.run(main)
