"""See inside one training step in the browser: the graph, every value and gradient.

    python examples/explore.py                   # the main job's GPT -> explore.html
    python examples/explore.py --out step.html   # elsewhere
    python examples/explore.py --n_layer 12 --n_embd 64 --block_size 64 --batch_size 8 \\
        --no-residual                            # the residual study's 12-block model
    python examples/explore.py --config gpt2     # GPT-2 small (124M), random weights
    python examples/explore.py --init_from PATH  # a Hugging Face GPT-2 checkpoint folder

Builds the model of examples/train_char.py with its default settings (2 layers, 128
wide, on Python's documentation text), takes one training step on one batch through
mt.inspect.explore (forward with every module call tracked, backward under the
engine's per-node hook, one AdamW step at the schedule's first learning rate) and writes
one self-contained HTML page: no server, no network, open it by double-click. In it:
click a node for its value and gradient statistics and its rule's math; step the
backward pass in the engine's order (the arrow keys, or play); unfold a block; search
by name; the address (#node=op12) links to the selected node.

At GPT-2's size (--config gpt2: GPTConfig.gpt2(), 124M parameters, random weights and
random tokens; --init_from: the checkpoint's weights through GPT.from_pretrained and its
own BPE on the text) the step is batch 4 of 64 tokens, llm.c's CPU size; the blocks
open folded and every tensor is a few numbers (docs/EXPLORE.md), so the page stays
under 1 MB.
"""
import argparse
import os
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

from train_char import DEFAULTS as TRAIN, get_lr   # noqa: E402  (no heavy imports there)

DEFAULTS = dict(
    out="explore.html",     # the page
    config="char",          # 'char': train_char.py's model; 'gpt2': GPT-2 small's shape
    init_from=None,         # a Hugging Face GPT-2 checkpoint (folder) instead
    data=None,              # UTF-8 text; None = Python's documentation (pydoc_data)
    n_layer=TRAIN["n_layer"], n_head=TRAIN["n_head"], n_embd=TRAIN["n_embd"],
    block_size=TRAIN["block_size"], batch_size=TRAIN["batch_size"],
    seed=TRAIN["seed"],
)
GPT2_BATCH = dict(batch_size=4, block_size=64)   # llm.c's CPU training step
TEXT_CHARS = 200_000    # the BPE reads this much of the text: plenty for one batch


def build_parser():
    p = _cli.ArgumentParser(
        prog="explore.py",
        description="Take one training step of the main job's model (examples/train_char.py "
                    "with its defaults) and write the step's autograd graph, with every "
                    "value, gradient and the engine's backward order, as one self-contained "
                    "HTML page (no network; open it in any browser by double-click). The "
                    "model options below reproduce other models, e.g. the residual study's "
                    "12-block stacks: --n_layer 12 --n_embd 64 --block_size 64 --batch_size 8 "
                    "[--no-residual]; --config gpt2 or --init_from PATH take a step of GPT-2 "
                    "small (124M parameters). Runs in a few seconds.")
    p.add_argument("--out", default=DEFAULTS["out"], metavar="PATH",
                   help=f"the HTML page to write (default: {DEFAULTS['out']})")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="UTF-8 text to take the batch from (default: Python's documentation "
                        "text, pydoc_data.topics, as the main job)")
    p.add_argument("--config", choices=("char", "gpt2"), default=DEFAULTS["config"],
                   help="char: the main job's character model (default); gpt2: GPT-2 small's "
                        "shape (GPTConfig.gpt2(), 124M parameters) with random weights, fed "
                        "random tokens")
    p.add_argument("--init_from", default=None, metavar="PATH",
                   help="a Hugging Face GPT-2 checkpoint folder (config.json and "
                        "model.safetensors, read by GPT.from_pretrained); its vocab.json and "
                        "merges.txt, where there, tokenize the text")
    for name, help in (("n_layer", "transformer blocks"), ("n_head", "attention heads"),
                       ("n_embd", "embedding width (a multiple of n_head)")):
        p.add_argument(f"--{name}", type=_cli.positive_int, default=None,
                       metavar=name.upper(), help=f"{help} (default: {DEFAULTS[name]}; "
                       "not with --config gpt2 or --init_from)")
    for name, help in (("block_size", "tokens in each sequence"),
                       ("batch_size", "sequences in the batch")):
        p.add_argument(f"--{name}", type=_cli.positive_int, default=None,
                       metavar=name.upper(), help=f"{help} (default: {DEFAULTS[name]}; "
                       f"{GPT2_BATCH[name]} at GPT-2's size)")
    p.add_argument("--residual", action=argparse.BooleanOptionalAction, default=None,
                   help="skip connections around attention and the MLP (default: on; not "
                        "with --init_from)")
    p.add_argument("--prenorm", action=argparse.BooleanOptionalAction, default=None,
                   help="normalise before each sublayer (default: on; not with --init_from)")
    p.add_argument("--unfold", action="store_true",
                   help="open the page with every block unfolded (default: blocks folded)")
    p.add_argument("--seed", type=_cli.seed_int, default=DEFAULTS["seed"],
                   help=f"initialisation and batch seed (default: {DEFAULTS['seed']})")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser.prog
    gpt2 = args.config == "gpt2" or args.init_from is not None
    if args.init_from is not None and args.config == "gpt2":
        _cli.fail(prog, "--config gpt2 and --init_from both name the model: give one of them")
    shaped = [f"--{k}" for k in ("n_layer", "n_head", "n_embd") if getattr(args, k) is not None]
    if gpt2 and shaped:
        _cli.fail(prog, f"{', '.join(shaped)}: GPT-2's shape is fixed (n_layer 12, n_head 12, "
                        "n_embd 768); drop --config gpt2 / --init_from for another shape")
    if args.config == "gpt2" and args.data is not None:
        _cli.fail(prog, "--data: random weights have no tokenizer to read the text with (they "
                        "are fed random tokens); --init_from a checkpoint folder with its "
                        "vocab.json and merges.txt reads a text")
    if args.init_from is not None and (args.residual is not None or args.prenorm is not None):
        _cli.fail(prog, "--residual and --prenorm change the model; with --init_from it is "
                        "the checkpoint's")
    for key in ("n_layer", "n_head", "n_embd"):
        if getattr(args, key) is None:
            setattr(args, key, DEFAULTS[key])
    for key in ("block_size", "batch_size"):
        if getattr(args, key) is None:
            setattr(args, key, GPT2_BATCH[key] if gpt2 else DEFAULTS[key])
    residual = args.residual is not False
    prenorm = args.prenorm is not False
    if not gpt2:
        _cli.check_heads(prog, "n_embd", args.n_embd, args.n_head)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _cli.writable_dir(prog, out_dir, "--out")

    import numpy as np
    import microtensor as mt
    import chardata
    from models import GPT, GPTConfig
    rng = np.random.default_rng(args.seed)
    mt.manual_seed(args.seed)

    # model and data: GPT-2's shape or the main job's character model, one random batch
    if gpt2:
        if args.init_from is not None:
            from models.pretrained import resolve_checkpoint, CheckpointError
            try:
                path = resolve_checkpoint(args.init_from)
                model = GPT.from_pretrained(path, dtype=mt.float32)
            except (CheckpointError, OSError, TypeError) as e:
                _cli.fail(prog, f"--init_from {args.init_from}: {e}")
            model.train()                  # from_pretrained gives eval mode; this is training
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            name = os.path.basename(os.path.normpath(path))
            config = model.config
        else:
            config = GPTConfig.gpt2(residual=residual, prenorm=prenorm)
            folder, name = None, "GPT-2 small (random weights)"
        if args.block_size > config.block_size:
            _cli.fail(prog, f"--block_size {args.block_size}: the model has "
                            f"{config.block_size} positions")
        if args.init_from is None:
            model = GPT(config)
        try:
            # the checkpoint's own BPE on the text where it has one; random tokens otherwise
            tokenizer = chardata.BPETokenizerFiles(folder) if folder else None
        except chardata.CharDataError:
            tokenizer = None
        if tokenizer is None and args.data is not None:
            _cli.fail(prog, "--data: the checkpoint has no tokenizer (vocab.json and "
                            "merges.txt) to read the text with")
        if tokenizer is not None:
            try:
                text = chardata.load_corpus(args.data)[:TEXT_CHARS]
                ids = tokenizer.encode(text)
            except chardata.CharDataError as e:
                _cli.fail(prog, str(e))
            if len(ids) <= args.block_size:
                _cli.fail(prog, f"the text holds {len(ids)} tokens, too few for one sequence "
                                f"of --block_size {args.block_size}")
            x, y = chardata.get_batch(ids, args.block_size, args.batch_size, rng)  # (B, T)
            batch = "text"
        else:
            ids = rng.integers(0, config.vocab_size, (args.batch_size, args.block_size + 1))
            x, y = mt.tensor(ids[:, :-1]), mt.tensor(ids[:, 1:])               # (B, T)
            batch = "random tokens"
    else:
        try:
            text = chardata.load_corpus(args.data)
            tokenizer = chardata.CharTokenizer.from_text(text)
            ids = tokenizer.encode(text)
            train, _ = chardata.train_val_split(ids, args.block_size, args.data or "the corpus")
        except chardata.CharDataError as e:
            _cli.fail(prog, str(e))
        x, y = chardata.get_batch(train, args.block_size, args.batch_size, rng)  # (B, T)
        # the model as train_char.py builds it
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                              dropout=TRAIN["dropout"], bias=TRAIN["bias"], norm=TRAIN["norm"],
                              pos=TRAIN["pos"], mlp=TRAIN["mlp"], prenorm=prenorm,
                              tie_weights=TRAIN["tie_weights"], residual=residual))

    # the optimizer as train_char.py builds it
    params = [p for p in model.parameters() if p.requires_grad]
    run = dict(TRAIN, min_lr=TRAIN["lr"] / 10, lr_decay_iters=TRAIN["max_iters"])
    lr = get_lr(0, run)                    # the first step's learning rate (warmup)
    optimizer = mt.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": TRAIN["weight_decay"]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=(TRAIN["beta1"], TRAIN["beta2"]))

    # the step: forward (module calls tracked), backward (watched), optimizer.step()
    if gpt2:
        title = (f"{name}: {sum(p.numel() for p in params):,} parameters, batch "
                 f"{args.batch_size} x {args.block_size} {batch}, one AdamW step (lr {lr:.2g})")
    else:
        title = (f"GPT {args.n_layer} layers x {args.n_embd}, "
                 f"{'residual' if residual else 'no residual'}, one AdamW step (lr {lr:.2g})")
    start = time.perf_counter()
    explorer = mt.inspect.explore(lambda: model(x, y), model=model, optimizer=optimizer,
                                  title=title, fold="none" if args.unfold else "auto")
    _cli.replace_with(args.out, explorer.save)
    seconds = time.perf_counter() - start
    meta = explorer.data["meta"]
    path = os.path.abspath(args.out)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {meta['nodes']} nodes ({meta['ops']} ops), loss "
          f"{meta['loss']:.4f}, {size / 1024:.0f} KB ({size:,} bytes), in {seconds:.1f} s "
          f"(forward, backward, optimizer step and page)")
    print(f"open it in a browser (no server needed): file://{path}")
    print("  click a node: value and gradient; the arrow keys or play: the backward pass; "
          "#node=<id> in the address selects a node")
    return 0


if __name__ == "__main__":
    _cli.run(main)
