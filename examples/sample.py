"""Generate text from a checkpoint written by train_char.py, or from GPT-2.

    python examples/sample.py                              # newest checkpoint in out-char/
    python examples/sample.py --prompt "The " --num_samples 3 --temperature 0.7
    python examples/sample.py --ckpt out-char/ckpt_best.safetensors --top_p 0.9
    python examples/sample.py --init_from gpt2 --prompt "Hello, I'm a language model,"

The prompt is printed first, then its continuation (on stdout; which checkpoint was read
and the tokens per second go to stderr). --temperature 0 is greedy decoding: always the
most likely next token (the same text whatever the seed). --init_from reads a Hugging Face
GPT-2 checkpoint (a folder with config.json, model.safetensors, vocab.json and
merges.txt, or a Hub name) and speaks its BPE.
"""
import os
import sys
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

DEFAULTS = dict(
    ckpt=None,            # a checkpoint file; None = the newest one in out_dir
    init_from=None,       # a Hugging Face GPT-2 checkpoint instead (folder or Hub name)
    out_dir="out-char",
    prompt="",            # "" = start from a newline, as if at the start of a paragraph
    max_new_tokens=500,
    temperature=0.8,      # < 1 sharpens the distribution, > 1 flattens it, 0 = greedy
    top_k=40,             # keep the k most likely characters; 0 = all
    top_p=None,           # keep the smallest set with this total probability; None = all
    seed=1337,
    num_samples=1,
    threads=0,            # 0: the library's default (the physical cores)
)


def build_parser():
    p = _cli.ArgumentParser(prog="sample.py",
                            description="Generate text from a train_char.py checkpoint. "
                                        "500 characters of the default model take about a "
                                        "second.")

    def option(name, type, help):
        default = DEFAULTS[name]
        shown = "none" if default is None else repr(default) if isinstance(default, str) \
            else default
        p.add_argument(f"--{name}", type=type, default=default, metavar=name.upper(),
                       help=f"{help} (default: {shown})")

    option("ckpt", str, "checkpoint file; none = the newest *.safetensors in --out_dir")
    option("out_dir", str, "directory searched when --ckpt is not given")
    option("init_from", str, "a Hugging Face GPT-2 checkpoint instead of a train_char.py one: "
                             "a folder with config.json, model.safetensors and vocab.json + "
                             "merges.txt (train_char.py --init_from writes one in OUT/hf), or "
                             "a Hub name such as gpt2")
    option("prompt", str, "text to continue, printed before the continuation; "
                          "empty = start at a new line")
    option("max_new_tokens", _cli.nonnegative_int, "characters to generate per sample (>= 0)")
    option("temperature", _cli.nonnegative_number,
           "sampling temperature (>= 0): below 1 sharper, above 1 flatter, 0 = greedy "
           "(always the most likely character)")
    option("top_k", _cli.nonnegative_int, "sample among the k most likely characters; "
                                          "0 = no limit")
    option("top_p", _cli.number(0, 1, lo_open=True),
           "nucleus sampling, in (0, 1]: the smallest set of characters whose probabilities "
           "sum to top_p; none = no limit")
    option("seed", _cli.seed_int, "random seed (>= 0)")
    option("num_samples", _cli.positive_int, "number of samples (>= 1)")
    option("threads", _cli.nonnegative_int, "threads for microtensor's kernels and BLAS; "
                                            "0 = the library's default (the physical cores)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser.prog

    def fail(message):
        _cli.fail(prog, message)

    args.threads = _cli.resolve_threads(prog, args.threads)
    if args.threads > 0:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(args.threads)

    import microtensor as mt
    import chardata
    from chardata import CharDataError

    if args.threads > 0:
        mt.set_num_threads(args.threads)
        chardata.set_blas_threads(args.threads)

    if args.init_from is not None and args.ckpt is not None:
        fail("--init_from and --ckpt both name a checkpoint: give one of them")
    try:
        if args.init_from is not None:
            model, tokenizer, path = load_pretrained(args.init_from, fail)
            block_size = model.config.block_size
        else:
            model, tokenizer, path, block_size = load_char_checkpoint(args, fail)
        prompt_ids = tokenizer.encode(args.prompt, what="prompt")
    except CharDataError as e:
        fail(str(e))
    print(f"{prog}: read {path}", file=sys.stderr)

    # an empty prompt starts at a new line (not printed): the model has seen plenty of those
    context_ids = prompt_ids
    if len(context_ids) == 0:
        context_ids = tokenizer.encode("\n" if tokenizer.chars is None or "\n" in tokenizer.stoi
                                       else tokenizer.chars[0])
    context_ids = context_ids[-block_size:]  # the model sees at most block_size tokens

    mt.manual_seed(args.seed)
    model.eval()
    idx = mt.from_numpy(context_ids[None, :].copy())  # (1, T)
    generated, seconds = 0, 0.0
    for i in range(args.num_samples):
        t0 = time.perf_counter()
        with mt.no_grad():
            out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                                 top_k=min(args.top_k, tokenizer.vocab_size) or None,
                                 top_p=args.top_p)
        seconds += time.perf_counter() - t0
        generated += args.max_new_tokens
        continuation = tokenizer.decode(out.numpy()[0, len(context_ids):])
        if i > 0:
            print("-" * 40)
        print(args.prompt + continuation, flush=True)
    if generated and seconds > 0:
        print(f"{prog}: {generated} tokens in {seconds:.2f} s, {generated / seconds:,.1f} "
              f"tokens/s (the prompt's {len(context_ids)} included in the time)",
              file=sys.stderr)
    return 0


def load_pretrained(name, fail):
    """(model, tokenizer, path) of a Hugging Face GPT-2 checkpoint."""
    import chardata
    from models import GPT
    from models.pretrained import resolve_checkpoint, CheckpointError
    try:
        path = resolve_checkpoint(name)
        model = GPT.from_pretrained(path)
    except (CheckpointError, OSError, TypeError) as e:
        fail(f"--init_from {name}: {e}")
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return model, chardata.BPETokenizerFiles(folder), path


def load_char_checkpoint(args, fail):
    """(model, tokenizer, path, block_size) of a train_char.py checkpoint; the BPE of a
    fine-tuned GPT-2 (train_char.py --init_from) is in the hf/ folder beside it."""
    import chardata
    path = args.ckpt or chardata.newest_checkpoint(args.out_dir)
    try:
        model_state, _, info = chardata.load_checkpoint(path)
    except chardata.DamagedCheckpoint as e:
        # ckpt_last and ckpt_best are separate files: the other one may be whole
        other = chardata.other_checkpoint(path)
        at = chardata.readable_iter(other) if other else None
        if at is None:
            fail(f"{e}; no other checkpoint beside it can be read: train again "
                 f"(train_char.py --force --out_dir {os.path.dirname(path) or '.'})")
        if args.ckpt:
            fail(f"{e}; the other checkpoint, {other} (iteration {at}), is a separate "
                 f"file: sample from it with --ckpt {other}")
        print(f"note: {e}; sampling from {other} (iteration {at}) instead",
              file=sys.stderr)
        path = other
        model_state, _, info = chardata.load_checkpoint(path)
    model = chardata.build_model(info["config"], model_state, source=f"checkpoint {path}")
    if info.get("vocab") is None:
        tokenizer = chardata.BPETokenizerFiles(os.path.join(os.path.dirname(path), "hf"))
    else:
        tokenizer = chardata.CharTokenizer(info["vocab"])
    at = info.get("iter")
    return model, tokenizer, f"{path} (iteration {at})", info["config"]["block_size"]


if __name__ == "__main__":
    _cli.run(main)
