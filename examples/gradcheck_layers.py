"""Gradient-check every building block of models/ and a tiny model of each family.

Everything runs in float64 at tiny sizes. For each case the analytic gradient
(backward of a random upstream gradient) is compared with central differences
element by element, and the verdict comes from mt.gradcheck. Models take int64 token
ids, so for them the checked inputs are parameters: mt.gradcheck perturbs a tensor in
place, and a parameter perturbed in place is seen by the model's next forward.

The second-order columns (2nd abs, 2nd rel) check gradients of gradients the same way
(mt.gradgradcheck's comparison): the gradient of the first-order backward, built with
create_graph=True, against central differences of it; by default along a few random
directions (fast mode), with --second_order full at every element.

    python examples/gradcheck_layers.py            # the whole table, exits 1 on a failure
    python examples/gradcheck_layers.py -k gpt     # only cases whose name contains "gpt"

tests/test_models.py runs the same CASES table through mt.gradcheck.
"""
import time

if __name__ == "__main__":
    # (tests load this file by path, without examples/ on sys.path: they need no _cli)
    import _cli
    _cli.script(__name__)   # from here on, Ctrl-C exits quietly

import numpy as np  # noqa: E402

import microtensor as mt  # noqa: E402
from microtensor.autograd.gradcheck import compare_gradients, first_order_vjp  # noqa: E402
from models import (GPT, GPTConfig, MultiHeadAttention,  # noqa: E402
                    SinusoidalPositionalEncoding, LearnedPositionalEmbedding, RotaryEmbedding,
                    FeedForward, TransformerBlock, Encoder, EncoderDecoder)

# CPU seconds of the whole table (one thread, so on an idle core also the wall clock), as
# measured by docs/regenerate.py, which rewrites this line and the docs that quote it.
DEFAULT_RUN_SECONDS = 38

# tiny sizes: a central difference costs two forwards per checked element
B, T, C, NH = 2, 5, 8, 2      # batch, sequence, width, heads (head size 4)
S = 4                         # context length for cross-attention
VOCAB, BLOCK = 7, 6
EPS, ATOL, RTOL = 1e-6, 1e-5, 1e-3
SECOND_ORDER_DIRECTIONS = 6   # random directions of the second-order check (fast mode)


def leaf(*shape):
    """A float64 input that requires grad."""
    return mt.randn(*shape, dtype=mt.float64, requires_grad=True)


def key_padding_mask(batch, length):
    """(B, 1, 1, length) bool: row b sees its first length - b keys (the rest is padding)."""
    keep = np.arange(length)[None, :] < (length - np.arange(batch))[:, None]  # (B, length)
    return mt.from_numpy(keep[:, None, None, :])


def params(module, *names):
    """Parameters by dotted name, skipping names the module does not have (a bias when
    bias=False, wpe when pos='rope', ...)."""
    table = dict(module.named_parameters())
    return [table[n] for n in names if n in table], [n for n in names if n in table]


# ---- the cases: each returns (fn, inputs, names of the inputs) -------------------------

def mha_case(causal=False, rope=False, cross=False, masked=False, bias=True):
    def build():
        mha = MultiHeadAttention(C, NH, causal=causal, bias=bias, rope=rope).double()
        x = leaf(B, T, C)
        ctx = leaf(B, S, C) if cross else None
        mask = key_padding_mask(B, S if cross else T) if masked else None
        ps, names = params(mha, "c_attn.weight", "c_attn.bias", "c_proj.weight")
        inputs = [x] + ([ctx] if cross else []) + ps
        fn = lambda x, *rest: mha(x, context=rest[0] if cross else None, mask=mask)
        return fn, inputs, ["x"] + (["context"] if cross else []) + names
    return build


def sinusoidal_case():
    pe = SinusoidalPositionalEncoding(C, max_len=16).double()
    x = leaf(B, T, C)
    return (lambda x: pe(x, offset=3)), [x], ["x"]


def learned_case():
    pe = LearnedPositionalEmbedding(BLOCK, C).double()
    x = leaf(B, T, C)
    return (lambda x, w: pe(x, offset=1)), [x, pe.weight], ["x", "weight"]


def rope_case():
    rope = RotaryEmbedding(4)
    x = leaf(B, NH, T, 4)
    return (lambda x: rope(x, offset=2)), [x], ["x (B, nh, T, hs)"]


def ffn_case(activation, bias=True):
    def build():
        ffn = FeedForward(C, 12, activation=activation, bias=bias).double()
        x = leaf(B, T, C)
        ps, names = params(ffn, "c_fc.weight", "c_fc.bias", "c_proj.weight")
        return (lambda x, *p: ffn(x)), [x] + ps, ["x"] + names
    return build


def block_case(**options):
    def build():
        block = TransformerBlock(C, NH, d_ff=12, **options).double()
        x = leaf(B, T, C)
        ps, names = params(block, "ln_1.weight", "ln_1.bias", "attn.c_attn.weight",
                           "ln_2.weight", "mlp.c_fc.weight", "mlp.c_proj.bias")
        return (lambda x, *p: block(x)), [x] + ps, ["x"] + names
    return build


def decoder_block_case(prenorm):
    def build():
        block = TransformerBlock(C, NH, d_ff=12, prenorm=prenorm, cross_attention=True).double()
        x, ctx = leaf(B, T, C), leaf(B, S, C)
        mask = key_padding_mask(B, S)
        ps, names = params(block, "ln_cross.weight", "cross_attn.c_attn.weight")
        fn = lambda x, ctx, *p: block(x, context=ctx, context_mask=mask)
        return fn, [x, ctx] + ps, ["x", "context"] + names
    return build


def gpt_case(**options):
    def build():
        cfg = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=NH, n_embd=C,
                        d_ff=12, **options)
        model = GPT(cfg).double()
        idx = mt.randint(0, VOCAB, (B, T))
        targets = mt.randint(0, VOCAB, (B, T))
        ps, names = params(model, "transformer.wte.weight", "transformer.wpe.weight",
                           "transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.weight",
                           "transformer.h.1.attn.c_proj.bias", "transformer.h.1.mlp.c_fc.weight",
                           "transformer.h.1.ln_2.weight", "transformer.ln_f.weight",
                           "lm_head.weight")
        seeded = cfg.dropout > 0

        def fn(*p):
            if seeded:
                mt.manual_seed(0)  # the same dropout masks in every forward
            return model(idx, targets)  # (logits, loss): both get a random upstream gradient
        return fn, ps, names
    return build


def encoder_case(prenorm):
    def build():
        enc = Encoder(VOCAB, d_model=C, n_head=NH, n_layer=2, d_ff=12, prenorm=prenorm).double()
        src = mt.randint(0, VOCAB, (B, T))
        src_mask = mt.from_numpy(np.arange(T)[None, :] < np.array([[T], [T - 2]]))  # (B, T)
        ps, names = params(enc, "embed.weight", "layers.0.attn.c_attn.weight",
                           "layers.1.ln_1.weight", "layers.1.mlp.c_fc.weight")
        return (lambda *p: enc(src, src_mask)), ps, names
    return build


def encoder_decoder_case(prenorm, tie_weights=True):
    def build():
        model = EncoderDecoder(VOCAB, VOCAB, d_model=C, n_head=NH, n_layer=1, d_ff=12,
                               dropout=0.0, prenorm=prenorm, tie_weights=tie_weights,
                               pad_id=0).double()
        src = mt.tensor([[3, 4, 5, 6, 2], [5, 6, 2, 0, 0]])
        tgt = mt.tensor([[1, 6, 5, 4, 3], [1, 2, 6, 5, 0]])
        targets = mt.tensor([[6, 5, 4, 3, 2], [2, 6, 5, 2, 0]])
        ps, names = params(model, "encoder.embed.weight", "encoder.layers.0.attn.c_attn.weight",
                           "decoder.embed.weight", "decoder.layers.0.cross_attn.c_attn.weight",
                           "decoder.layers.0.ln_2.weight", "lm_head.weight")
        return (lambda *p: model(src, tgt, targets)), ps, names
    return build


GPT_OPTIONS = [
    dict(),
    dict(norm="rmsnorm"),
    dict(prenorm=False),
    dict(pos="sinusoidal"),
    dict(pos="rope"),
    dict(pos="none"),
    dict(mlp="relu"),
    dict(mlp="swiglu"),
    dict(residual=False),
    dict(bias=False),
    dict(tie_weights=False),
    dict(dropout=0.1),
    dict(norm="rmsnorm", prenorm=False, pos="rope", mlp="swiglu", bias=False),
    dict(prenorm=False, pos="sinusoidal", mlp="relu", residual=False, tie_weights=False),
]


def describe(options):
    return ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"


CASES = [
    ("mha bidirectional", mha_case()),
    ("mha causal", mha_case(causal=True)),
    ("mha padding mask", mha_case(masked=True)),
    ("mha causal+mask", mha_case(causal=True, masked=True)),
    ("mha causal rope", mha_case(causal=True, rope=True)),
    ("mha cross+mask", mha_case(cross=True, masked=True)),
    ("mha no bias", mha_case(causal=True, bias=False)),
    ("sinusoidal pe", sinusoidal_case),
    ("learned pe", learned_case),
    ("rotary", rope_case),
    ("ffn gelu", ffn_case("gelu")),
    ("ffn relu", ffn_case("relu")),
    ("ffn swiglu", ffn_case("swiglu")),
    ("ffn swiglu no bias", ffn_case("swiglu", bias=False)),
    ("block prenorm layernorm", block_case()),
    ("block postnorm layernorm", block_case(prenorm=False)),
    ("block prenorm rmsnorm", block_case(norm="rmsnorm")),
    ("block postnorm rmsnorm", block_case(norm="rmsnorm", prenorm=False)),
    ("block no residual", block_case(residual=False)),
    ("block postnorm no residual", block_case(prenorm=False, residual=False)),
    ("block no bias", block_case(bias=False)),
    ("block bidirectional rope", block_case(causal=False, rope=True)),
    ("decoder block prenorm", decoder_block_case(True)),
    ("decoder block postnorm", decoder_block_case(False)),
] + [(f"gpt {describe(o)}", gpt_case(**o)) for o in GPT_OPTIONS] + [
    ("encoder postnorm", encoder_case(False)),
    ("encoder prenorm", encoder_case(True)),
    ("encoder-decoder postnorm", encoder_decoder_case(False)),
    ("encoder-decoder prenorm untied", encoder_decoder_case(True, tie_weights=False)),
]


# ---- measuring ---------------------------------------------------------------------------

def measure(comparisons):
    """(max abs error, max rel error, passed) over (index, analytic, numeric) triples."""
    worst_abs = worst_rel = 0.0
    passed = True
    for _, analytic, numeric in comparisons:
        err = np.abs(analytic - numeric)
        worst_abs = max(worst_abs, float(err.max(initial=0.0)))
        passed = passed and bool((err <= ATOL + RTOL * np.abs(numeric)).all())
        # relative error only where the gradient is not ~0 (there it is all noise)
        big = np.abs(numeric) > ATOL
        if big.any():
            worst_rel = max(worst_rel, float((err[big] / np.abs(numeric[big])).max()))
    return worst_abs, worst_rel, passed


def errors(fn, inputs):
    """(max abs error, max rel error, passed) of the analytic against the central-difference
    gradients (mt.gradcheck's comparison, one pass of central differences)."""
    return measure(compare_gradients(fn, inputs, eps=EPS))


def second_order_errors(fn, inputs, full=False):
    """The same for gradients of gradients (mt.gradgradcheck's comparison): the gradient of
    the first-order VJP (x, u) -> d<u, fn(x)>/dx, built with create_graph=True, against
    central differences of it, with respect to the inputs and the upstream gradients u.
    By default along SECOND_ORDER_DIRECTIONS random directions (fast mode: two passes per
    direction); full=True: every element (two passes per element, minutes per model)."""
    mt.manual_seed(0)
    outputs = fn(*inputs)
    outputs = [outputs] if isinstance(outputs, mt.Tensor) else list(outputs)
    rng = np.random.default_rng(1)
    upstream = [mt.tensor(rng.standard_normal(o.shape), requires_grad=True)
                for o in outputs if o.dtype.kind == "f"]
    vjp = first_order_vjp(fn, inputs, upstream)
    return measure(compare_gradients(vjp, list(inputs) + upstream, eps=EPS,
                                     directions=None if full else SECOND_ORDER_DIRECTIONS))


def run_case(name, build, second_order="fast"):
    """Both checks of one case; second_order: "fast", "full" or "off" (None errors)."""
    mt.manual_seed(0)
    fn, inputs, names = build()
    n_elements = sum(t.numel() for t in inputs)
    abs_err, rel_err, passed = errors(fn, inputs)
    second = None
    if second_order != "off":
        second = second_order_errors(fn, inputs, full=second_order == "full")
    return names, n_elements, abs_err, rel_err, passed, second


def main(argv=None):
    import _cli
    parser = _cli.ArgumentParser(
        prog="gradcheck_layers.py",
        description=__doc__.split("\n\n")[0] + " The whole table takes about "
                    f"{_cli.minutes(DEFAULT_RUN_SECONDS)} on one CPU core (measured: "
                    f"{DEFAULT_RUN_SECONDS} s of CPU time); it exits with status 1 if a case "
                    "fails.")
    parser.add_argument("-k", default="", help="only cases whose name contains this "
                                               "(default: every case)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list the checked tensors of each case")
    parser.add_argument("--threads", type=_cli.nonnegative_int, default=0,
                        help="microtensor kernel threads (default: 0 = the library's "
                             "default, the physical cores; tensors this small run on one)")
    parser.add_argument("--second_order", choices=["fast", "full", "off"], default="fast",
                        help="the gradgradcheck column: fast checks "
                             f"{SECOND_ORDER_DIRECTIONS} random directions per case, full "
                             "every element (many minutes), off skips it (default: fast)")
    args = parser.parse_args(argv)
    args.threads = _cli.resolve_threads(parser.prog, args.threads)
    if args.threads > 0:
        mt.set_num_threads(args.threads)
    cases = [(n, b) for n, b in CASES if args.k in n]
    if not cases:
        parser.error(f"no case name contains {args.k!r}")
    t0 = time.time()
    failures = 0
    width = max(len(n) for n, _ in cases)
    print(f"{'layer':<{width}}  {'checked (tensors, elements)':>27}  {'max abs':>9}  "
          f"{'max rel':>9}  {'2nd abs':>9}  {'2nd rel':>9}  result")
    for name, build in cases:
        names, n, abs_err, rel_err, passed, second = run_case(name, build, args.second_order)
        if second is None:
            second_text = f"{'-':>9}  {'-':>9}"
        else:
            second_text = f"{second[0]:9.2e}  {second[1]:9.2e}"
            passed = passed and second[2]
        failures += not passed
        print(f"{name:<{width}}  {f'{len(names)}, {n}':>27}  {abs_err:9.2e}  {rel_err:9.2e}  "
              f"{second_text}  {'pass' if passed else 'FAIL'}", flush=True)
        if args.verbose:
            print("    " + ", ".join(names))
    how = {"fast": f"along {SECOND_ORDER_DIRECTIONS} random directions through the inputs and "
                   "the upstream gradients", "full": "every element of the inputs and the "
                   "upstream gradients", "off": "not checked"}[args.second_order]
    print(f"{len(cases) - failures}/{len(cases)} passed in {time.time() - t0:.1f}s "
          f"(float64, eps={EPS}; pass: |analytic - numeric| <= {ATOL} + {RTOL} * |numeric| "
          f"everywhere; max rel is over elements with |numeric| > {ATOL}; 2nd: gradients of "
          f"gradients (create_graph=True), {how})")
    return 1 if failures else 0


if __name__ == "__main__":
    _cli.run(main)
