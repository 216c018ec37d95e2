"""Train the 2017 encoder-decoder Transformer to reverse strings of digits.

    python examples/train_seq2seq.py                 # about 3 minutes on 2 CPU cores
    python examples/train_seq2seq.py --max_len 12 --steps 3000 --prenorm

The source is a string of 1 to max_len digits, the target the same digits reversed.
Output digit i must copy source digit L-1-i, where L differs from example to example,
so the decoder has to find the right source position through cross-attention: no
fixed lookup table solves it. Exact match (every digit and the end token right, by
greedy decoding with the KV cache) is measured on held-out strings that never appear
in training; training stops early once the validation strings are all but perfect.
"""
import argparse
import os
import sys
import time

import numpy as np

# -----------------------------------------------------------------------------
# Defaults: name -> (value, what it is). Each can be overridden: --name value
DEFAULTS = dict(
    seed=(0, "seeds the data, the init and the held-out split"),
    min_len=(1, "fewest digits in a string"),
    max_len=(10, "most digits in a string"),
    n_val=(500, "held-out strings checked during training (for early stopping)"),
    n_test=(1000, "held-out strings for the final accuracy, not looked at before"),
    d_model=(64, "model width"),
    n_head=(4, "attention heads"),
    n_layer=(2, "encoder layers; the decoder has as many"),
    d_ff=(256, "MLP hidden width"),
    dropout=(0.0, "fresh random data every step: nothing to regularise against"),
    batch_size=(64, "strings per step"),
    steps=(2500, "at most this many steps (stops earlier at target_acc)"),
    lr=(1e-3, "peak learning rate of AdamW"),
    warmup=(100, "linear warmup steps (post-norm Transformers need one)"),
    weight_decay=(0.01, "AdamW weight decay"),
    eval_interval=(100, "steps between validation checks"),
    target_acc=(1.0, "stop once the validation exact match reaches this"),
    threads=(1, "threads for microtensor's kernels and BLAS; this model's matrices are "
                "small, and on a busy machine a second thread costs more than it gives"),
)

PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3   # tokens 3..12 are the digits 0..9
VOCAB = FIRST_DIGIT + 10
HOLDOUT_MIN_LEN = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, (value, help_text) in DEFAULTS.items():
        parser.add_argument(f"--{name}", type=type(value), default=value, help=help_text)
    parser.add_argument("--prenorm", action="store_true",
                        help="pre-norm blocks instead of the 2017 post-norm")
    return parser.parse_args()


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


def main():
    args = parse_args()
    import microtensor as mt
    from microtensor.threads import set_threads
    from models import EncoderDecoder

    set_threads(args.threads)
    mt.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    # Held-out strings are drawn first and excluded from every training batch. They have
    # at least HOLDOUT_MIN_LEN digits: there are only 1,110 strings of 1-3 digits, so
    # holding some of those out would remove whole lengths from training, while a
    # million-odd longer ones make the exclusion cost nothing.
    holdout_min = max(args.min_len, min(HOLDOUT_MIN_LEN, args.max_len))
    held_out = list(dict.fromkeys(random_strings(rng, 2 * (args.n_val + args.n_test),
                                                 holdout_min, args.max_len)))
    if len(held_out) < args.n_val + args.n_test:
        sys.exit("too few distinct strings of these lengths for the held-out sets")
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
        strings = [s for s in random_strings(rng, args.batch_size + 8, args.min_len, args.max_len)
                   if s not in excluded][:args.batch_size]
        src, tgt_in, targets = (mt.from_numpy(a) for a in encode_batch(strings, args.max_len))
        _, loss = model(src, tgt_in, targets)
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
    print(f"test exact match: {test_acc:.2%} on {len(test)} held-out strings "
          f"({exact_match(model, longest, args.max_len):.2%} on the {len(longest)} of "
          f"length {args.max_len}); trained {step} steps in {train_time:.0f}s")
    for digits in test[:3]:
        src, _, _ = encode_batch([digits], args.max_len)
        out = model.generate(mt.from_numpy(src), args.max_len + 1, bos_id=BOS, eos_id=EOS)
        decoded = "".join(str(t - FIRST_DIGIT) for t in out.numpy()[0, 1:] if t >= FIRST_DIGIT)
        print(f"  {''.join(map(str, digits)):>{args.max_len}} -> {decoded}")
    return 0 if test_acc >= 0.99 else 1


if __name__ == "__main__":
    sys.exit(main())
