"""Greedy generation, side by side: microtensor's GPT.generate (KV cache) and
transformers' GPT2LMHeadModel.generate(do_sample=False) on PyTorch, same weights, same
prompt, in one process, tokens per second and their ratio at each thread count.

The model is GPT-2 small's shape (GPTConfig.gpt2(): 124M parameters) with random
weights: transformers draws them (GPT2Config, its own init), and they are copied into
microtensor's GPT (the Conv1D weights, stored (in, out), transposed to Linear's (out,
in); the key names are the same, nanoGPT's). Both use the exact (erf) GELU, microtensor's
only one (GPT2Config(activation_function="gelu"); the checkpoints' "gelu_new" is the
tanh form), so the two compute the same function and must produce the same tokens:
the benchmark checks that on every thread count and says so in the table.

A generation is a 64-token prompt (random ids) and 128 new tokens, greedy; its time
includes the prompt's forward (as both libraries' generate does) and tokens/s counts
the new tokens. Each round times each engine once, alternating (A B A B ...); the
table gives medians over --rounds.

    python benchmarks/bench_generate.py --threads 1,2 --rounds 5
    python benchmarks/bench_generate.py --threads 1 --profile   # where a token's time goes
    python benchmarks/bench_generate.py --small --rounds 1 --allow-busy   # a quick check
"""
import argparse
import os
import sys
import time

# NOTE: the benchmarks' folder only: microtensor and models come from where they are
# installed (the repository's root first would hide an installed copy behind unbuilt sources)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402

# GPT-2 small; --small is a model of the same structure that runs in a second (a check
# of the benchmark itself, not a figure)
GPT2 = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
SMALL = dict(vocab_size=1000, block_size=256, n_layer=2, n_head=4, n_embd=64)


def build_models(shape, seed):
    """(transformers' model, microtensor's GPT) holding the same random weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    import microtensor as mt
    from models import GPT, GPTConfig
    torch.manual_seed(seed)
    hf_config = GPT2Config(vocab_size=shape["vocab_size"], n_positions=shape["block_size"],
                           n_layer=shape["n_layer"], n_head=shape["n_head"],
                           n_embd=shape["n_embd"], activation_function="gelu",
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=None, eos_token_id=None)
    hf = GPT2LMHeadModel(hf_config).eval()
    # no end-of-text token: both generate exactly max_new_tokens
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    model = GPT(GPTConfig(**shape, dropout=0.0, bias=True))
    model.eval()
    model.load_state_dict(microtensor_state(hf.state_dict(), mt))
    return hf, model


def microtensor_state(hf_state, mt):
    """transformers' GPT-2 state_dict as microtensor's: the Conv1D weights (in, out) of
    c_attn, c_proj and c_fc transposed to Linear's (out, in); the attention's mask
    buffers (older checkpoints' attn.bias / attn.masked_bias) left out."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    out = {}
    for key, value in hf_state.items():
        if key.endswith((".attn.masked_bias", ".attn.bias")):
            continue
        a = value.detach().numpy()
        if key.endswith(conv1d):
            a = a.T
        out[key] = mt.from_numpy(np.ascontiguousarray(a))
    return out


def engines(hf, model, prompt, new_tokens):
    """{name: zero-argument generate} and a dict where each keeps its last tokens."""
    import torch
    import microtensor as mt
    last = {}
    idx_mt = mt.from_numpy(prompt)
    idx_torch = torch.from_numpy(prompt)

    def run_mt():
        last["microtensor"] = model.generate(idx_mt, new_tokens, temperature=0).numpy()

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(idx_torch, attention_mask=torch.ones_like(idx_torch),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, num_beams=1)
        last["transformers"] = out.numpy()
    return {"microtensor": run_mt, "transformers": run_hf}, last


def measure(fns, last, rounds, new_tokens):
    """{name: [seconds per generation] * rounds}, alternating, after one untimed run
    each; and whether the two engines' tokens were equal in every round."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    same = True
    for _ in range(rounds):
        for name, fn in fns.items():
            C.quiesce()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        same = same and np.array_equal(last["microtensor"], last["transformers"])
    return times, same


def profile(model, prompt, new_tokens, top):
    """microtensor's generation by op (mt.profiler): the shares of a generated token."""
    import microtensor as mt
    from microtensor.profiler import Profiler
    idx = mt.from_numpy(prompt)
    model.generate(idx, 4, temperature=0)                         # warm
    prompt_only = mt.from_numpy(prompt)
    with Profiler(backward=False) as prof:
        with prof.region("prompt"):
            model.generate(prompt_only, 1, temperature=0)
        with prof.region("generate"):
            model.generate(idx, new_tokens, temperature=0)
    return prof


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="timed generations per engine")
    p.add_argument("--prompt", type=int, default=64, help="prompt length (tokens)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true",
                   help="a 2-layer model of the same structure: a quick check of the "
                   "benchmark, not a figure")
    p.add_argument("--profile", action="store_true",
                   help="after the timings, microtensor's generation by op (shares)")
    p.add_argument("--profile-top", type=int, default=20)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    C.add_load_flags(p)
    args = p.parse_args(argv)
    try:
        counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        p.error(f"--threads takes integers separated by commas, got {args.threads!r}")
    if not counts or min(counts) < 1:
        p.error("--threads: each count must be at least 1")
    torch = C.try_import_torch()
    try:
        import transformers  # noqa: F401
    except ImportError:
        transformers = None
    if torch is None or transformers is None:
        p.error("this benchmark compares with transformers on PyTorch: pip install torch "
                "transformers")
    shape = SMALL if args.small else GPT2
    if args.prompt + args.new_tokens > shape["block_size"]:
        p.error(f"--prompt + --new-tokens must fit the block size ({shape['block_size']})")

    load = C.check_quiet(args.allow_busy, "bench_generate.py", strict=args.strict_quiet)
    C.setup_threads(counts[0], torch)
    info = C.machine_info(counts[0], torch)
    C.print_machine(info)
    print(f"# transformers {transformers.__version__}; model "
          f"{'small (a check, not a figure)' if args.small else 'GPT-2 small (124M)'}: "
          f"n_layer={shape['n_layer']} n_head={shape['n_head']} n_embd={shape['n_embd']} "
          f"vocab={shape['vocab_size']}; prompt {args.prompt} tokens, {args.new_tokens} new, "
          f"greedy; median of {args.rounds} rounds")
    hf, model = build_models(shape, args.seed)
    prompt = np.random.default_rng(args.seed).integers(
        0, shape["vocab_size"], (1, args.prompt), dtype=np.int64)
    fns, last = engines(hf, model, prompt, args.new_tokens)

    rows, results = [], []
    for n in counts:
        C.setup_threads(n, torch)
        times, same = measure(fns, last, args.rounds, args.new_tokens)
        tps = {name: args.new_tokens / C.median(ts) for name, ts in times.items()}
        ratio = tps["microtensor"] / tps["transformers"]
        rows.append([n, f"{tps['microtensor']:.1f}", f"{tps['transformers']:.1f}",
                     f"{ratio:.2f}", "yes" if same else "NO"])
        results.append({"threads": n, "tokens_per_s": tps, "ratio": ratio, "same_tokens": same,
                        "seconds": {k: C.summary(v) for k, v in times.items()}})
    print()
    print(C.table(["threads", "microtensor tok/s", "transformers tok/s",
                   "microtensor / transformers", "same tokens"], rows))
    if not all(r["same_tokens"] for r in results):
        print("# the two engines' tokens differ: see the rows marked NO")
    C.print_load_after()

    if args.profile:
        C.setup_threads(counts[0], torch)
        prof = profile(model, prompt, args.new_tokens, args.profile_top)
        print(f"\n# microtensor's generation by op at {counts[0]} thread(s): 'prompt' is the "
              f"prompt's forward and its first token, 'generate' the whole run of "
              f"{args.new_tokens} tokens (its shares are a generated token's)")
        print(prof.table(steps=1, top=args.profile_top))
    if args.json:
        C.emit_json({"bench": "generate", "machine": info, "load_at_start": load,
                     "small": args.small, "prompt": args.prompt,
                     "new_tokens": args.new_tokens, "rounds": args.rounds,
                     "results": results}, args.json)
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
