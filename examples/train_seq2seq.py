"""Train the 2017 encoder-decoder Transformer to reverse strings of digits.

    python examples/train_seq2seq.py                 # run time: see --help
    python examples/train_seq2seq.py --max_len 12 --steps 3000 --prenorm

The source is a string of 1 to max_len digits, the target the same digits reversed.
Output digit i must copy source digit L-1-i, where L differs from example to example,
so the decoder has to find the right source position through cross-attention: no
fixed lookup table solves it. Exact match (every digit and the end token right, by
greedy decoding with the KV cache) is measured on held-out strings that never appear
in training; training stops early once the validation strings are all but perfect.
Exit status: 0 when the test exact match reaches 99%, 1 below that, 2 for bad options,
130 after Ctrl-C.
"""
import math
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

import numpy as np  # noqa: E402

# CPU seconds of the run with no arguments (all its threads together, so about the wall
# clock on one idle core), as measured by docs/regenerate.py, which rewrites this line and the docs that
# quote it.
DEFAULT_RUN_SECONDS = 99

# -----------------------------------------------------------------------------
# Defaults: name -> (value, accepted values, what it is). Each can be overridden:
# --name value
DEFAULTS = dict(
    seed=(0, _cli.seed_int, "seeds the data, the init and the held-out split"),
    min_len=(1, _cli.positive_int, "fewest digits in a string"),
    max_len=(10, _cli.positive_int, "most digits in a string (>= min_len)"),
    n_val=(500, _cli.positive_int,
           "held-out strings checked during training (for early stopping)"),
    n_test=(1000, _cli.positive_int,
            "held-out strings for the final accuracy, not looked at before"),
    d_model=(64, _cli.positive_int, "model width (a multiple of n_head)"),
    n_head=(4, _cli.positive_int, "attention heads (divides d_model)"),
    n_layer=(2, _cli.positive_int, "encoder layers; the decoder has as many"),
    d_ff=(256, _cli.positive_int, "MLP hidden width"),
    dropout=(0.0, _cli.probability,
             "dropout probability in [0, 1); fresh random data every step leaves nothing "
             "to regularise against"),
    batch_size=(64, _cli.positive_int, "strings per step"),
    steps=(2500, _cli.positive_int, "at most this many steps (stops earlier at target_acc)"),
    lr=(1e-3, _cli.positive_number, "peak learning rate of AdamW"),
    warmup=(100, _cli.nonnegative_int, "linear warmup steps (post-norm Transformers need one)"),
    weight_decay=(0.01, _cli.nonnegative_number, "AdamW weight decay"),
    eval_interval=(100, _cli.positive_int, "steps between validation checks"),
    target_acc=(1.0, _cli.number(0, 1, lo_open=True),
                "stop once the validation exact match reaches this, in (0, 1]"),
    threads=(0, _cli.nonnegative_int,
             "threads for microtensor's kernels and BLAS (0: the library's default, the "
             "physical cores)"),
)

PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3   # tokens 3..12 are the digits 0..9
VOCAB = FIRST_DIGIT + 10
HOLDOUT_MIN_LEN = 4


def parse_args(argv=None):
    parser = _cli.ArgumentParser(
        prog="train_seq2seq.py",
        description=__doc__.split("\n\n")[0] + " With the defaults it reaches 100% "
                    f"exact match in about {_cli.minutes(DEFAULT_RUN_SECONDS)} on one CPU "
                    f"core (measured: {DEFAULT_RUN_SECONDS} s of CPU time).")
    for name, (value, kind, help_text) in DEFAULTS.items():
        parser.add_argument(f"--{name}", type=kind, default=value, metavar=name.upper(),
                            help=f"{help_text} (default: {value})")
    parser.add_argument("--prenorm", action="store_true",
                        help="pre-norm blocks instead of the 2017 post-norm (default: post-norm)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE, as "
                        "JSON (docs/regenerate.py reads them; default: none)")
    args = parser.parse_args(argv)
    if args.min_len > args.max_len:
        _cli.fail(parser.prog, f"--min_len {args.min_len} is above --max_len {args.max_len}")
    _cli.check_heads(parser.prog, "d_model", args.d_model, args.n_head)
    args.threads = _cli.resolve_threads(parser.prog, args.threads)
    # the held-out strings are drawn from lengths holdout_min..max_len (see main) and
    # must leave most strings of those lengths to train on
    holdout_min = max(args.min_len, min(HOLDOUT_MIN_LEN, args.max_len))
    available = sum(10 ** n for n in range(holdout_min, args.max_len + 1))
    lengths = (f"{holdout_min}-{args.max_len}" if holdout_min < args.max_len
               else str(args.max_len))
    if args.n_val + args.n_test > available // 2:
        _cli.fail(parser.prog, f"--n_val {args.n_val} + --n_test {args.n_test} held-out "
                               f"strings are more than half of the {available:,} strings of "
                               f"{lengths} digits; use fewer or a larger --max_len")
    return args


def random_strings(rng, n, min_len, max_len):
    """n digit strings (tuples of ints 0..9) of uniformly random lengths."""
    lengths = rng.integers(min_len, max_len + 1, n)
    return [tuple(rng.integers(0, 10, L).tolist()) for L in lengths]


def encode_batch(strings, max_len):
    """src (B, max_len + 1): digits, EOS, padding; tgt_in (B, max_len + 1): BOS, reversed
    digits, padding; targets (B, max_len + 1): reversed digits, EOS, padding."""
    B, width = len(strings), max_len + 1
    src = np.full((B, width), PAD, dtype=np.int64)
    tgt_in = np.full((B, width), PAD, dtype=np.int64)
    targets = np.full((B, width), PAD, dtype=np.int64)
    for b, digits in enumerate(strings):
        L = len(digits)
        reversed_tokens = [FIRST_DIGIT + d for d in reversed(digits)]
        src[b, :L] = [FIRST_DIGIT + d for d in digits]
        src[b, L] = EOS
        tgt_in[b, 0] = BOS
        tgt_in[b, 1:L + 1] = reversed_tokens
        targets[b, :L] = reversed_tokens
        targets[b, L] = EOS
    return src, tgt_in, targets


def exact_match(model, strings, max_len, batch_size=250):
    """Fraction of strings whose greedy decoding is exactly the reversed digits then EOS."""
    import microtensor as mt
    model.eval()
    correct = 0
    for start in range(0, len(strings), batch_size):
        chunk = strings[start:start + batch_size]
        src, _, targets = encode_batch(chunk, max_len)
        out = model.generate(mt.from_numpy(src), max_len + 1, bos_id=BOS, eos_id=EOS).numpy()
        predicted = out[:, 1:]  # drop BOS; finished rows continue with PAD
        width = min(predicted.shape[1], targets.shape[1])
        for b, digits in enumerate(chunk):
            n = len(digits) + 1  # the digits and EOS
            correct += n <= width and np.array_equal(predicted[b, :n], targets[b, :n])
    model.train()
    return correct / len(strings)


def main(argv=None):
    args = parse_args(argv)
    results = train(args)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["test_acc"] >= 0.99 else 1


def train(args):
    """The whole run; returns its numbers (docs/regenerate.py quotes them)."""
    import microtensor as mt
    from microtensor.threads import set_threads
    from models import EncoderDecoder

    set_threads(args.threads or None)      # 0: the library's default
    mt.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    # Held-out strings are drawn first and excluded from every training batch. They have
    # at least HOLDOUT_MIN_LEN digits: there are only 1,110 strings of 1-3 digits, so
    # holding some of those out would remove whole lengths from training, while a
    # million-odd longer ones make the exclusion cost nothing.
    holdout_min = max(args.min_len, min(HOLDOUT_MIN_LEN, args.max_len))
    held_out = []
    while len(held_out) < args.n_val + args.n_test:   # parse_args made sure there are enough
        held_out = list(dict.fromkeys(held_out + random_strings(
            rng, 2 * (args.n_val + args.n_test), holdout_min, args.max_len)))
    val, test = held_out[:args.n_val], held_out[args.n_val:args.n_val + args.n_test]
    excluded = set(val) | set(test)
    print(f"held out: {len(val)} validation + {len(test)} test strings of {holdout_min}-"
          f"{args.max_len} digits; training draws {args.min_len}-{args.max_len} digits "
          f"and never sees a held-out string")

    model = EncoderDecoder(VOCAB, VOCAB, d_model=args.d_model, n_head=args.n_head,
                           n_layer=args.n_layer, d_ff=args.d_ff, max_len=args.max_len + 1,
                           dropout=args.dropout, prenorm=args.prenorm, pad_id=PAD)
    print(f"EncoderDecoder: {model.num_parameters():,} parameters, "
          f"{'pre' if args.prenorm else 'post'}-norm, d_model={args.d_model}, "
          f"{args.n_layer}+{args.n_layer} layers")
    optimizer = mt.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                               weight_decay=args.weight_decay)

    def lr_factor(step):  # linear warmup, then cosine down to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(progress, 1.0)))
    scheduler = mt.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    t0 = time.time()
    val_acc = 0.0
    for step in range(1, args.steps + 1):
        strings = []
        while len(strings) < args.batch_size:
            strings += [s for s in random_strings(rng, args.batch_size + 8, args.min_len,
                                                  args.max_len) if s not in excluded]
        strings = strings[:args.batch_size]
        src, tgt_in, targets = (mt.from_numpy(a) for a in encode_batch(strings, args.max_len))
        _, loss = model(src, tgt_in, targets)
        if not math.isfinite(loss.item()):
            _cli.fail("train_seq2seq.py", f"the loss became {loss.item()} at step {step}: "
                      f"training stopped; try a lower --lr (this run: {args.lr:g})",
                      _cli.EXIT_ERROR)
        optimizer.zero_grad()
        loss.backward()
        mt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        if step % args.eval_interval == 0 or step == args.steps:
            val_acc = exact_match(model, val, args.max_len)
            print(f"step {step:5d} | loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e} "
                  f"| val exact match {val_acc:6.2%} | {time.time() - t0:6.1f}s", flush=True)
            if val_acc >= args.target_acc:
                print(f"validation reached {args.target_acc:.1%}: stopping")
                break
    train_time = time.time() - t0

    test_acc = exact_match(model, test, args.max_len)
    longest = [s for s in test if len(s) == args.max_len]
    longest_acc = exact_match(model, longest, args.max_len) if longest else None
    print(f"test exact match: {test_acc:.2%} on {len(test)} held-out strings "
          + (f"({longest_acc:.2%} on the {len(longest)} of length {args.max_len}); "
             if longest else "")
          + f"trained {step} steps in {train_time:.0f}s")
    for digits in test[:3]:
        src, _, _ = encode_batch([digits], args.max_len)
        out = model.generate(mt.from_numpy(src), args.max_len + 1, bos_id=BOS, eos_id=EOS)
        decoded = "".join(str(t - FIRST_DIGIT) for t in out.numpy()[0, 1:] if t >= FIRST_DIGIT)
        print(f"  {''.join(map(str, digits)):>{args.max_len}} -> {decoded}")
    return dict(test_acc=test_acc, longest_acc=longest_acc, n_longest=len(longest),
                max_len=args.max_len,
                val_acc=val_acc, steps=step, train_seconds=train_time,
                n_test=len(test), parameters=model.num_parameters())


if __name__ == "__main__":
    _cli.run(main)
