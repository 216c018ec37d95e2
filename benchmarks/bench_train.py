"""Training speed of the GPT: microtensor (eager and mt.compile) vs PyTorch (eager and
torch.compile), side by side.

The same nanoGPT-architecture model (pre-norm LayerNorm, learned positions, GELU MLP,
tied embedding / output weights, biases) trained on the same character corpus with
the same hyper-parameters, the same batches and the same initial weights (microtensor's
state_dict copied into the torch model). A timed step is forward + backward + gradient
clipping at 1.0 + AdamW. After warm-up the engines alternate in rounds (A B A B ...)
in one process, so both see the same machine; before each round the process waits
until no thread pool left spinning by the other engine is still burning CPU
(_common.quiesce).

Engines (--engines, default all four; --no-torch drops both torch ones):
  mt              microtensor eager
  mt-compiled     mt.compile of the whole step (forward, zero_grad, backward, clip, AdamW;
                  the loss tensor is returned, .item() runs after the call); at least 3
                  untimed calls (record, record and compare, replay) before the timing
  torch           PyTorch eager
  torch-compiled  torch.compile(model) (inductor: forward and, through AOTAutograd, the
                  backward; zero_grad, clip and AdamW eager). Its first call (compilation)
                  is timed alone and printed; if it raises, the engine shows as n/a with
                  the reason and the rest goes on. Not in a thread sweep.
Every engine starts from the same weights and times the same batches, so the losses of
mt and mt-compiled must be bitwise equal ("mt compiled == eager: True").

Reported per engine: median ms/step and its spread (IQR), tokens/s, the ratio of each
engine to PyTorch eager (and to torch.compile), and achieved GFLOP/s of the step's
matrix products:

    FLOPs/step = 3 * (n_layer * (24*M*C^2 + 4*B*T^2*C) + 2*M*C*V),  M = B*T

(each Linear 2*M*K*N forward and twice that backward: c_attn C->3C, c_proj C->C,
c_fc C->4C, mlp c_proj 4C->C, lm_head C->V; attention's q@k^T and P@v 2*B*T^2*C each
forward and twice that backward; elementwise work is not counted).

    python benchmarks/bench_train.py --config cpu                  # timing table
    python benchmarks/bench_train.py --config tiny,cpu,mid --json out.jsonl
    python benchmarks/bench_train.py --config cpu --memory         # peak RSS per engine
    python benchmarks/bench_train.py --config cpu --profile        # microtensor by op
    python benchmarks/bench_train.py --config tiny,cpu,mid --threads 1,2,4,8,16 \
        --rounds 3 --json sweep.jsonl --plot scaling.png           # thread sweep

A sweep (--threads with several counts) runs in one process: each config's two models
are built once, and every round visits every thread count, both engines at each (1: A B,
2: A B, ...), so a change of load hits every cell; the warm-up steps run at every
thread count before the first round. It prints the scaling table
(ms per step of both engines, their ratio, GFLOP/s of matmul work and the config's
matmul ceiling at that thread count) and draws tokens/s against threads, one panel per
config (--plot; by default out-bench/scaling_<configs>.png). Thread counts above the
CPUs this process may run on are skipped, with a note. --plot-from redraws the picture
(and reprints the table) from the JSON of earlier sweeps, e.g. one taken on another
machine, or one run per config:

    python benchmarks/bench_train.py --plot-from sweep.jsonl --plot docs/img/scaling_x.png
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402

# the training hyper-parameters (nanoGPT's shakespeare-char settings, dropout off)
LR = 1e-3
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
DEFAULT_STEPS = {"tiny": 40, "cpu": 20, "mid": 6}   # timed steps per engine
DEFAULT_WARMUP = {"tiny": 5, "cpu": 3, "mid": 1}


# ---- data ------------------------------------------------------------------------

def encode_corpus(text):
    """Character vocabulary and the corpus as int64 token ids."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return np.array([stoi[c] for c in text], dtype=np.int64), len(chars)


def make_batches(data, n, batch_size, block_size, seed):
    """n (x, y) batches of random windows, as int64 numpy arrays (B, T); y is x
    shifted by one."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ix = rng.integers(0, len(data) - block_size - 1, batch_size)
        x = np.stack([data[i:i + block_size] for i in ix])
        y = np.stack([data[i + 1:i + 1 + block_size] for i in ix])
        out.append((x, y))
    return out


# ---- the two engines -------------------------------------------------------------

def build_mt(cfg, vocab_size, seed, dtype="float32", compiled=False):
    """A microtensor GPT, its AdamW (weight decay on matrices only) and a step fn.

    compiled=True: the step (forward, zero_grad, backward, clip, AdamW) is one function
    under mt.compile, taking the batch tensors and returning the loss tensor; the
    returned step fn converts the batch and calls .item() outside it. The compiled fn
    is the step fn's .compiled (its .plan.summary() splits a replayed step by op)."""
    import microtensor as mt
    from models import GPT, GPTConfig
    mt.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=cfg["block_size"],
                          n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                          n_embd=cfg["n_embd"], dropout=0.0, bias=True))
    if dtype == "float64":
        model.double()
    params = list({id(p): p for p in model.parameters()}.values())
    opt = mt.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=1e-8)
    clip = mt.nn.utils.clip_grad_norm_

    if compiled:
        def train_step(xb, yb):
            opt.zero_grad(set_to_none=True)
            _, loss = model(xb, yb)
            loss.backward()
            # mt.compile records clip_grad_norm_ as one call (capture.recorded_call)
            mt.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            opt.step()
            return loss
        compiled_step = mt.compile(train_step)

        def step(x, y, prof=None):
            return compiled_step(mt.from_numpy(x), mt.from_numpy(y)).item()
        step.compiled = compiled_step
        return model, step

    def step(x, y, prof=None):
        region = prof.region if prof is not None else _no_region
        xb, yb = mt.from_numpy(x), mt.from_numpy(y)
        with region("forward"):
            _, loss = model(xb, yb)
        with region("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with region("backward"):
            loss.backward()
        with region("clip"):
            clip(params, GRAD_CLIP)
        with region("optimizer"):
            opt.step()
        return loss.item()
    return model, step


def build_torch(torch, mt_model=None, cfg=None, vocab_size=None, dtype="float32",
                compiled=False):
    """The torch GPT (weights copied from mt_model when given), AdamW, a step fn.

    compiled=True: the model's forward (and with it the backward, through AOTAutograd)
    runs under torch.compile (inductor); zero_grad, clip and AdamW stay eager."""
    import torch_gpt
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    if mt_model is not None:
        model = torch_gpt.from_microtensor(mt_model, tdtype)
    else:
        model = torch_gpt.TorchGPT(vocab_size, cfg["block_size"], cfg["n_layer"],
                                   cfg["n_head"], cfg["n_embd"]).to(tdtype)
    opt = torch_gpt.configure_optimizer(model, LR, WEIGHT_DECAY, BETAS)
    params = list(model.parameters())
    forward = torch.compile(model) if compiled else model

    def step(x, y, prof=None):
        region = prof.region if prof is not None else _no_region
        xb, yb = torch.from_numpy(x), torch.from_numpy(y)
        with region("forward"):
            _, loss = forward(xb, yb)
        with region("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with region("backward"):
            loss.backward()
        with region("clip"):
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        with region("optimizer"):
            opt.step()
        return loss.item()
    return model, step


# ---- the engines -----------------------------------------------------------------

# --engines names -> the engine's key in tables and JSON (the old keys kept)
ENGINE_KEYS = {"mt": "microtensor", "mt-compiled": "microtensor-compiled",
               "torch": "torch", "torch-compiled": "torch-compiled"}
ENGINE_ORDER = list(ENGINE_KEYS.values())
COMPILED = ("microtensor-compiled", "torch-compiled")
MIN_COMPILED_WARMUP = 3   # untimed calls of a compiled engine: record, record + compare, replay


def parse_engines(text, no_torch=False):
    """'mt,torch' -> ['microtensor', 'torch'] in the canonical order; --no-torch drops
    both torch engines. ValueError on an unknown name."""
    keys = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        key = ENGINE_KEYS.get(part, part if part in ENGINE_ORDER else None)
        if key is None:
            raise ValueError(f"unknown engine {part!r}; choose from {', '.join(ENGINE_KEYS)}")
        keys.append(key)
    if no_torch:
        keys = [k for k in keys if not k.startswith("torch")]
    keys = [k for k in ENGINE_ORDER if k in keys]
    if not keys:
        raise ValueError("no engine left to run (--engines / --no-torch)")
    return keys


def effective_warmup(name, args, engines):
    """The untimed steps of every engine: the config's default (or --warmup), at least
    MIN_COMPILED_WARMUP when a compiled engine runs. All engines get the same number, so
    they time the same batches from the same weights (and the two microtensor engines
    compute the same losses)."""
    warmup = DEFAULT_WARMUP[name] if args.warmup is None else args.warmup
    if any(e in COMPILED for e in engines):
        warmup = max(warmup, MIN_COMPILED_WARMUP)
    return warmup


def build_engines(cfg, vocab, seed, selected, torch):
    """(mt_model, {engine: step fn}) for the selected engines that can run: every model
    starts from the same weights (microtensor's, at `seed`); torch engines need torch."""
    mt_model, mt_step = build_mt(cfg, vocab, seed)
    engines = {}
    for e in selected:
        if e == "microtensor":
            engines[e] = mt_step
        elif e == "microtensor-compiled":
            _, engines[e] = build_mt(cfg, vocab, seed, compiled=True)
        elif torch is not None:
            _, engines[e] = build_torch(torch, mt_model, compiled=(e == "torch-compiled"))
    return mt_model, engines


def first_call(engines, name, x, y, notes):
    """The first call of engine `name`, timed; a torch.compile that fails there is
    dropped from `engines` with its reason in notes (the benchmark goes on)."""
    step = engines[name]
    t0 = time.perf_counter()
    try:
        step(x, y)
    except Exception as exc:  # noqa: BLE001  (any failure of the compiler)
        if name != "torch-compiled":
            raise
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        notes["torch_compile"] = {"error": reason}
        del engines[name]
        print(f"# torch.compile: n/a ({reason})", flush=True)
        return None
    dt = time.perf_counter() - t0
    if name == "torch-compiled":
        notes["torch_compile"] = {"first_call_s": dt}
        print(f"# torch.compile first call: {dt:.1f} s", flush=True)
    return dt


def compiled_equal(losses):
    """Whether the compiled microtensor engine's losses equal eager's bitwise (None when
    one of them did not run)."""
    a, b = losses.get("microtensor"), losses.get("microtensor-compiled")
    if a is None or b is None:
        return None
    return len(a) == len(b) and np.array_equal(np.array(a, dtype=np.float64),
                                               np.array(b, dtype=np.float64))


def add_ratios(result, ms):
    """The ratio keys of a result, from {engine: median ms} (the old key kept)."""
    t, tc = ms.get("torch"), ms.get("torch-compiled")
    m, mc = ms.get("microtensor"), ms.get("microtensor-compiled")
    if t and m:
        result["ratio_mt_over_torch"] = m / t
    if t and mc:
        result["ratio_mt_compiled_over_torch"] = mc / t
    if t and tc:
        result["ratio_torch_compiled_over_torch"] = tc / t
    if tc and mc:
        result["ratio_mt_compiled_over_torch_compiled"] = mc / tc
    if tc and m:
        result["ratio_mt_over_torch_compiled"] = m / tc


class _NoRegion:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_REGION = _NoRegion()


def _no_region(name):
    return _NO_REGION


class RegionTimer:
    """Wall time per region, for the torch side of --profile."""

    def __init__(self):
        self.regions = {}

    def region(self, name):
        timer = self

        class _R:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.regions[name] = timer.regions.get(name, 0.0) + time.perf_counter() - self.t0
        return _R()


def loss_curve(config, steps, seed=0, dtype="float32", engine="microtensor", text=None,
               torch=None):
    """The training losses of `steps` steps (used by the tests: same seed, same curve)."""
    cfg = C.CONFIGS[config] if isinstance(config, str) else config
    text = text if text is not None else C.load_text(None)[0]
    data, vocab = encode_corpus(text)
    batches = make_batches(data, steps, cfg["batch_size"], cfg["block_size"], seed)
    mt_model, mt_step = build_mt(cfg, vocab, seed, dtype)
    if engine == "microtensor":
        step = mt_step
    else:
        _, step = build_torch(torch, mt_model, dtype=dtype)
    return [step(x, y) for x, y in batches]


# ---- timing ----------------------------------------------------------------------

def time_engines(engines, batches, warmup, steps, rounds, notes=None):
    """Per engine, the wall time of each timed step. engines: {name: step fn}; every
    engine runs the same batches in the same order. The first warm-up call of each
    engine is timed alone (a compiler's first call: notes); an engine whose
    torch.compile fails there is dropped from `engines`."""
    notes = {} if notes is None else notes
    for name in list(engines):
        for i, (x, y) in enumerate(batches[:warmup]):
            if i == 0:
                if first_call(engines, name, x, y, notes) is None:
                    break
            else:
                engines[name](x, y)
    per_round = max(1, steps // rounds)
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    done = 0
    while done < steps:
        n = min(per_round, steps - done)
        for name, step in engines.items():
            C.quiesce()
            for i in range(done, done + n):
                x, y = batches[warmup + i]
                t0 = time.perf_counter()
                losses[name].append(step(x, y))
                times[name].append(time.perf_counter() - t0)
        done += n
    return times, losses


def _result_engine(s, losses, flops, tokens):
    return {"ms_median": s["median"] * 1e3, "ms_q1": s["q1"] * 1e3, "ms_q3": s["q3"] * 1e3,
            "ms_min": s["min"] * 1e3, "ms_max": s["max"] * 1e3,
            "tokens_per_s": tokens / s["median"], "gflops": flops / s["median"] / 1e9,
            "first_losses": losses[:3], "last_loss": losses[-1]}


def run_config(name, args, text, torch):
    cfg = C.CONFIGS[name]
    data, vocab = encode_corpus(text)
    steps = args.steps or DEFAULT_STEPS[name]
    warmup = effective_warmup(name, args, args.engines)
    batches = make_batches(data, warmup + steps, cfg["batch_size"], cfg["block_size"], args.seed)
    mt_model, engines = build_engines(cfg, vocab, args.seed, args.engines, torch)
    notes = {}
    times, losses = time_engines(engines, batches, warmup, steps, args.rounds, notes)
    flops = C.step_flops(cfg, vocab)
    tokens = cfg["batch_size"] * cfg["block_size"]
    stats = {e: C.summary(ts) for e, ts in times.items()}
    result = {"config": name, "cfg": cfg, "vocab_size": vocab, "steps": steps,
              "warmup": warmup, "rounds": args.rounds, "step_gflop": flops / 1e9,
              "params": mt_model.num_parameters(), "engines": {}, **notes}
    for e, s in stats.items():
        result["engines"][e] = _result_engine(s, losses[e], flops, tokens)
    add_ratios(result, {e: s["median"] for e, s in stats.items()})
    eq = compiled_equal(losses)
    if eq is not None:
        result["mt_compiled_equals_eager"] = bool(eq)
    compiled_fn = getattr(engines.get("microtensor-compiled"), "compiled", None)
    if compiled_fn is not None:
        result["mt_compiled_calls"] = dict(compiled_fn.calls)
        result["mt_compiled_eager_reasons"] = [str(r) for r in compiled_fn.eager_reasons.values()]
    if args.ceiling:
        import bench_matmul
        ceiling, _, _ = bench_matmul.step_ceiling(cfg, vocab, torch, repeats=3)
        result["matmul_ceiling"] = {e: {"ms": c[0] * 1e3, "gflops": c[1]} for e, c in ceiling.items()}
    return result


def _ratio(r, key):
    return f"{r[key]:.2f}" if key in r else ""


def print_results(results):
    headers = ["config", "params", "engine", "ms/step (median)", "IQR ms", "min-max ms",
               "tokens/s", "GFLOP/s", "/ torch eager", "/ torch.compile"]
    vs_torch = {"microtensor": "ratio_mt_over_torch",
                "microtensor-compiled": "ratio_mt_compiled_over_torch",
                "torch-compiled": "ratio_torch_compiled_over_torch"}
    vs_compile = {"microtensor": "ratio_mt_over_torch_compiled",
                  "microtensor-compiled": "ratio_mt_compiled_over_torch_compiled"}
    rows = []
    for r in results:
        for e, s in r["engines"].items():
            rows.append([
                r["config"], f"{r['params'] / 1e6:.2f}M" if r["params"] else "", e, f"{s['ms_median']:.1f}",
                f"{s['ms_q1']:.1f}-{s['ms_q3']:.1f}", f"{s['ms_min']:.1f}-{s['ms_max']:.1f}",
                f"{s['tokens_per_s']:,.0f}", f"{s['gflops']:.1f}",
                _ratio(r, vs_torch[e]) if e in vs_torch else "",
                _ratio(r, vs_compile[e]) if e in vs_compile else ""])
            if e == "torch" and "error" in r.get("torch_compile", {}):
                rows.append([r["config"], "", "torch-compiled", "n/a", "", "", "", "", "", ""])
    print(C.table(headers, rows))
    for r in results:
        line = (f"{r['config']}: {r['step_gflop']:.3f} GFLOP of matmul per step; "
                f"{r['steps']} timed steps per engine in {r['rounds']} rounds after "
                f"{r['warmup']} warm-up")
        if "matmul_ceiling" in r:
            # each engine against its own library's ceiling: microtensor's matmuls run on
            # numpy's OpenBLAS kernels (via scipy's copy), torch's on its own
            own = {"microtensor": "numpy", "microtensor-compiled": "numpy",
                   "torch": "torch", "torch-compiled": "torch"}
            for e, s in r["engines"].items():
                c = r["matmul_ceiling"].get(own[e])
                if c:
                    line += (f"; {e}: {s['gflops']:.1f} GFLOP/s = {100 * s['gflops'] / c['gflops']:.0f}% "
                             f"of the {own[e]} matmul ceiling {c['gflops']:.1f} GFLOP/s "
                             f"({c['ms']:.1f} ms)")
        print(line)
        tc = r.get("torch_compile", {})
        if "first_call_s" in tc:
            print(f"  torch.compile first call: {tc['first_call_s']:.1f} s")
        elif "error" in tc:
            print(f"  torch.compile: n/a ({tc['error']})")
        losses = {e: s["first_losses"] for e, s in r["engines"].items()}
        print(f"  first losses: {json.dumps({e: [round(v, 5) for v in ls] for e, ls in losses.items()})}")
        if "mt_compiled_calls" in r:
            c = r["mt_compiled_calls"]
            print(f"  mt.compile calls: {c['recorded']} recorded, {c['replayed']} replayed, "
                  f"{c['eager']} eager" + (" (the plan fell back to eager: "
                                           + "; ".join(r["mt_compiled_eager_reasons"])[:300] + ")"
                                           if c["eager"] else ""))
        if "mt_compiled_equals_eager" in r:
            print(f"  mt compiled == eager: {r['mt_compiled_equals_eager']} "
                  f"(losses of the {r['steps']} timed steps, compared bitwise)")


# ---- peak memory (child processes) ------------------------------------------------

def child_main(args):
    """One engine's training loop alone in this process; prints a JSON line with the
    wall time of each step after the first `--warmup` ones.

    For --memory the torch child builds its model with its own init (so it never
    imports microtensor's model code); for --isolate (args.same_init) it copies
    microtensor's initial weights, as the in-process comparison does."""
    engine = args.child
    torch = C.try_import_torch() if engine.startswith("torch") else None
    import microtensor as mt  # noqa: F401  (the mt child never imports torch)
    C.setup_threads(args.threads, torch, args.scipy_blas_threads)
    text, _ = C.load_text(args.data)
    cfg = C.CONFIGS[args.config]
    data, vocab = encode_corpus(text)
    steps = args.steps or DEFAULT_STEPS[args.config]
    warmup = args.warmup or 0
    if engine in COMPILED:   # the peak covers the recording and the replays
        warmup = max(warmup, MIN_COMPILED_WARMUP)
    batches = make_batches(data, warmup + steps, cfg["batch_size"], cfg["block_size"], args.seed)
    rss_before = C.current_rss()
    compiled = engine in COMPILED
    if engine.startswith("microtensor"):
        _, step = build_mt(cfg, vocab, args.seed, compiled=compiled)
    elif args.same_init:
        mt_model, _ = build_mt(cfg, vocab, args.seed)
        _, step = build_torch(torch, mt_model, compiled=compiled)
        del mt_model
    else:
        _, step = build_torch(torch, cfg=cfg, vocab_size=vocab, compiled=compiled)
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        try:
            losses.append(step(x, y))
        except Exception as exc:  # noqa: BLE001  (a torch.compile that fails)
            if not (i == 0 and engine == "torch-compiled"):
                raise
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            print(json.dumps({"engine": engine, "error": reason}))
            return
        if i == 0:
            first_s = time.perf_counter() - t0
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"engine": engine, "rss_before_model": rss_before,
                      "rss_end": C.current_rss(), "times": times, "losses": losses,
                      "first_call_s": first_s}))


def _child_argv(engine, name, args, steps=None, warmup=None, same_init=False):
    argv = [os.path.abspath(__file__), "--child", engine, "--config", name,
            "--threads", str(args.threads), "--seed", str(args.seed)]
    steps = steps or args.steps
    if steps:
        argv += ["--steps", str(steps)]
    if warmup:
        argv += ["--warmup", str(warmup)]
    if args.data:
        argv += ["--data", args.data]
    if args.scipy_blas_threads is not None:
        argv += ["--scipy-blas-threads", str(args.scipy_blas_threads)]
    if same_init:
        argv += ["--same-init"]
    return argv


def isolated(name, args, torch):
    """The comparison with each engine in its own process (no shared thread pools):
    the rounds alternate child processes A B A B ...; each child warms up first."""
    cfg = C.CONFIGS[name]
    steps = args.steps or DEFAULT_STEPS[name]
    warmup = effective_warmup(name, args, args.engines)
    per_round = max(1, steps // args.rounds)
    engines = [e for e in args.engines if torch is not None or not e.startswith("torch")]
    times = {e: [] for e in engines}
    losses = {e: [] for e in engines}
    notes = {}
    done = 0
    while done < steps:
        n = min(per_round, steps - done)
        for e in list(engines):
            _, out = C.run_child_peak_rss(_child_argv(e, name, args, n, warmup, same_init=True))
            child = json.loads(out.strip().splitlines()[-1])
            if "error" in child:
                notes["torch_compile"] = {"error": child["error"]}
                print(f"# torch.compile: n/a ({child['error']})", flush=True)
                engines.remove(e)
                del times[e], losses[e]
                continue
            if e == "torch-compiled" and "torch_compile" not in notes:
                notes["torch_compile"] = {"first_call_s": child["first_call_s"]}
                print(f"# torch.compile first call: {child['first_call_s']:.1f} s", flush=True)
            times[e] += child["times"]
            losses[e] += child["losses"]
        done += n
    text, _ = C.load_text(args.data)
    vocab = len(set(text))
    flops = C.step_flops(cfg, vocab)
    tokens = cfg["batch_size"] * cfg["block_size"]
    result = {"config": name, "cfg": cfg, "vocab_size": vocab, "steps": steps, "warmup": warmup,
              "rounds": args.rounds, "step_gflop": flops / 1e9, "isolated": True,
              "params": None, "engines": {}, **notes}
    for e in engines:
        result["engines"][e] = _result_engine(C.summary(times[e]), losses[e], flops, tokens)
    add_ratios(result, {e: s["ms_median"] for e, s in result["engines"].items()})
    eq = compiled_equal(losses)
    if eq is not None:
        result["mt_compiled_equals_eager"] = bool(eq)
    return result


def memory(names, args):
    rows, out = [], {}
    have_torch = C.try_import_torch() is not None
    engines = [e for e in args.engines if have_torch or not e.startswith("torch")]
    for name in names:
        out[name] = {}
        for e in engines:
            peak, stdout = C.run_child_peak_rss(_child_argv(e, name, args))
            child = json.loads(stdout.strip().splitlines()[-1])
            if "error" in child:
                print(f"# torch.compile: n/a ({child['error']})", flush=True)
                out[name][e] = {"error": child["error"]}
                continue
            out[name][e] = {"peak_rss": peak, "rss_before_model": child["rss_before_model"]}
        for e in engines:
            m = out[name][e]
            if "error" in m:
                rows.append([name, e, "n/a", "", "", ""])
                continue
            ratio = ""
            if e.startswith("microtensor") and "peak_rss" in out[name].get("torch", {}):
                ratio = f"{m['peak_rss'] / out[name]['torch']['peak_rss']:.2f}"
            rows.append([name, e, f"{m['peak_rss'] / 2**20:.0f}",
                         f"{m['rss_before_model'] / 2**20:.0f}",
                         f"{(m['peak_rss'] - m['rss_before_model']) / 2**20:.0f}", ratio])
    print("\n## peak resident memory of each engine's training loop (own child process)\n")
    print(C.table(["config", "engine", "peak RSS MiB", "RSS before model MiB",
                   "growth MiB", "peak / torch eager peak"], rows))
    return out


# ---- profile ---------------------------------------------------------------------

def profile(name, args, text, torch):
    from microtensor.profiler import Profiler, wrapper_cost
    cfg = C.CONFIGS[name]
    data, vocab = encode_corpus(text)
    warmup, steps = 2, args.profile_steps
    batches = make_batches(data, warmup + steps, cfg["batch_size"], cfg["block_size"], args.seed)
    mt_model, mt_step = build_mt(cfg, vocab, args.seed)
    for x, y in batches[:warmup]:
        mt_step(x, y)
    C.quiesce()
    prof = Profiler()
    with prof:
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            mt_step(x, y, prof)
        wall = (time.perf_counter() - t0) / steps
    print(f"\n## microtensor profile, config {name} ({cfg}), {steps} steps, "
          f"{wall * 1e3:.1f} ms/step with the profiler on (wrappers add "
          f"~{wrapper_cost() * 1e6:.1f} us per op call)\n")
    print(prof.table(steps=steps, top=args.profile_top))
    ops, regions = prof.summary(steps)
    result = {"config": name, "steps": steps, "ms_per_step": wall * 1e3, "regions": regions,
              "ops": [{"region": r, "op": o, "calls": c, "ms": ms} for r, o, c, ms in ops]}
    if "microtensor-compiled" in args.engines:
        # the same steps under mt.compile: MIN_COMPILED_WARMUP untimed calls (record,
        # record + compare, replay), then the replays the plan times by op
        _, c_step = build_mt(cfg, vocab, args.seed, compiled=True)
        c_batches = make_batches(data, MIN_COMPILED_WARMUP + steps, cfg["batch_size"],
                                 cfg["block_size"], args.seed)
        for x, y in c_batches[:MIN_COMPILED_WARMUP]:
            c_step(x, y)
        plan = c_step.compiled.plan
        base = plan.replays
        for rec in plan.records:      # count the timed replays only
            rec.calls, rec.seconds = 0, 0.0
        plan.replays = 0
        C.quiesce()
        t0 = time.perf_counter()
        for x, y in c_batches[MIN_COMPILED_WARMUP:]:
            c_step(x, y)
        c_wall = (time.perf_counter() - t0) / steps
        print(f"\n## microtensor compiled (mt.compile), config {name}, {steps} replays, "
              f"{c_wall * 1e3:.1f} ms/step (after {MIN_COMPILED_WARMUP} untimed calls, "
              f"{base} of them replays)\n")
        print(plan.summary())
        result["compiled"] = {"ms_per_step": c_wall * 1e3, "summary": plan.summary()}
    if torch is not None:
        _, t_step = build_torch(torch, mt_model)
        for x, y in batches[:warmup]:
            t_step(x, y)
        C.quiesce()
        timer = RegionTimer()
        for x, y in batches[warmup:]:
            t_step(x, y, timer)
        print("\nPyTorch eager, same steps, wall ms per step by region: " + ", ".join(
            f"{k} {v * 1e3 / steps:.2f}" for k, v in timer.regions.items()))
        result["torch_regions_ms"] = {k: v * 1e3 / steps for k, v in timer.regions.items()}
        if args.torch_ops:
            from torch.profiler import profile as tprofile, ProfilerActivity
            with tprofile(activities=[ProfilerActivity.CPU]) as tp:
                for x, y in batches[warmup:]:
                    t_step(x, y)
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return result


# ---- thread sweep ----------------------------------------------------------------

def parse_threads(text):
    """'1,2,4' -> [1, 2, 4] (order kept, duplicates dropped); ValueError on anything else."""
    counts = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--threads takes positive integers separated by commas, got {text!r}")
        if int(part) not in counts:
            counts.append(int(part))
    if not counts:
        raise ValueError("--threads needs at least one count")
    return counts


def usable_thread_counts(counts, cpus=None):
    """(kept, skipped): the counts that fit in the CPUs this process may run on."""
    cpus = len(C.available_cpus()) if cpus is None else cpus
    return [n for n in counts if n <= cpus], [n for n in counts if n > cpus]


def _engine_stats(times, losses, flops, tokens):
    s = C.summary(times)
    return {"ms_median": s["median"] * 1e3, "ms_q1": s["q1"] * 1e3, "ms_q3": s["q3"] * 1e3,
            "ms_min": s["min"] * 1e3, "ms_max": s["max"] * 1e3, "n": s["n"],
            "tokens_per_s": tokens / s["median"], "gflops": flops / s["median"] / 1e9,
            "last_loss": losses[-1]}


def sweep_config(name, counts, args, text, torch):
    """One config at every thread count in `counts`: the models are built once; each
    round visits every count and, at each, times both engines (A B) for its share of the
    steps. Returns the config's record with one entry per thread count."""
    cfg = C.CONFIGS[name]
    data, vocab = encode_corpus(text)
    steps = args.steps or DEFAULT_STEPS[name]
    # torch.compile's kernels keep the thread count of their compilation: no sweep
    selected = [e for e in args.engines if e != "torch-compiled"]
    warmup = effective_warmup(name, args, selected)
    batches = make_batches(data, max(1, warmup + steps), cfg["batch_size"],
                           cfg["block_size"], args.seed)
    mt_model, engines = build_engines(cfg, vocab, args.seed, selected, torch)
    first = {e: [] for e in engines}   # the first losses each engine computes: same weights,
    cursor = {e: 0 for e in engines}   # same batches, so they agree across engines

    def run(e):
        x, y = batches[cursor[e] % len(batches)]
        cursor[e] += 1
        t0 = time.perf_counter()
        loss = engines[e](x, y)
        dt = time.perf_counter() - t0
        if len(first[e]) < 3:
            first[e].append(loss)
        return dt, loss

    for n in counts:                      # warm-up at every thread count
        C.setup_threads(n, torch, args.scipy_blas_threads)
        for e in engines:
            for _ in range(warmup):
                run(e)
    times = {(n, e): [] for n in counts for e in engines}
    losses = {(n, e): [] for n in counts for e in engines}
    per_round = max(1, steps // args.rounds)
    done, current = 0, counts[-1]
    while done < steps:
        k = min(per_round, steps - done)
        for n in counts:
            if n != current:
                C.setup_threads(n, torch, args.scipy_blas_threads)
                current = n
            for e in engines:
                C.quiesce()
                for _ in range(k):
                    dt, loss = run(e)
                    times[(n, e)].append(dt)
                    losses[(n, e)].append(loss)
        done += k
        print(f"# {name}: {done}/{steps} timed steps per engine and thread count "
              f"(load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    flops = C.step_flops(cfg, vocab)
    tokens = cfg["batch_size"] * cfg["block_size"]
    result = {"config": name, "cfg": cfg, "vocab_size": vocab, "steps": steps,
              "warmup": warmup, "rounds": args.rounds, "step_gflop": flops / 1e9,
              "tokens_per_step": tokens, "params": mt_model.num_parameters(),
              "first_losses": first, "by_threads": []}
    for n in counts:
        entry = {"threads": n, "engines": {
            e: _engine_stats(times[(n, e)], losses[(n, e)], flops, tokens) for e in engines}}
        add_ratios(entry, {e: s["ms_median"] for e, s in entry["engines"].items()})
        eq = compiled_equal({e: losses[(n, e)] for e in engines})
        if eq is not None:
            entry["mt_compiled_equals_eager"] = bool(eq)
        result["by_threads"].append(entry)
    if not args.no_ceiling:
        import bench_matmul
        for entry in result["by_threads"]:
            C.setup_threads(entry["threads"], torch, args.scipy_blas_threads)
            ceiling, _, _ = bench_matmul.step_ceiling(cfg, vocab, torch,
                                                      repeats=args.ceiling_repeats,
                                                      min_time=args.ceiling_min_time)
            entry["matmul_ceiling"] = {
                lib: {"ms": c[0] * 1e3, "gflops": c[1], "tokens_per_s": tokens / c[0]}
                for lib, c in ceiling.items()}
    return result


def print_sweep(results):
    """The long table (one row per config and thread count) and the compact one."""
    headers = ["config", "threads", "mt ms/step", "mt IQR", "torch ms/step", "torch IQR",
               "mt/torch", "mt GFLOP/s", "torch GFLOP/s", "ceiling GFLOP/s (numpy / torch)",
               "mt speed-up", "torch speed-up"]
    rows = []
    for r in results:
        base = r["by_threads"][0]["engines"]
        for t in r["by_threads"]:
            m, tt = t["engines"].get("microtensor"), t["engines"].get("torch")
            ceil = t.get("matmul_ceiling", {})
            if m is None:
                continue
            rows.append([
                r["config"], t["threads"], f"{m['ms_median']:.1f}",
                f"{m['ms_q1']:.1f}-{m['ms_q3']:.1f}",
                f"{tt['ms_median']:.1f}" if tt else "",
                f"{tt['ms_q1']:.1f}-{tt['ms_q3']:.1f}" if tt else "",
                f"{t['ratio_mt_over_torch']:.2f}" if "ratio_mt_over_torch" in t else "",
                f"{m['gflops']:.1f}", f"{tt['gflops']:.1f}" if tt else "",
                " / ".join(f"{ceil[lib]['gflops']:.1f}"
                           for lib in ("numpy", "torch") if lib in ceil),
                f"{base['microtensor']['ms_median'] / m['ms_median']:.2f}x",
                f"{base['torch']['ms_median'] / tt['ms_median']:.2f}x" if tt else ""])
    print(C.table(headers, rows))
    if any("microtensor-compiled" in t["engines"] for r in results for t in r["by_threads"]):
        print("\nmicrotensor compiled (mt.compile):\n")
        rows = []
        for r in results:
            for t in r["by_threads"]:
                c = t["engines"].get("microtensor-compiled")
                if c is None:
                    continue
                rows.append([r["config"], t["threads"], f"{c['ms_median']:.1f}",
                             f"{c['ms_q1']:.1f}-{c['ms_q3']:.1f}",
                             _ratio(t, "ratio_mt_compiled_over_torch"),
                             f"{t['engines']['microtensor']['ms_median'] / c['ms_median']:.2f}x"
                             if "microtensor" in t["engines"] else "",
                             t.get("mt_compiled_equals_eager", "")])
        print(C.table(["config", "threads", "mt-compiled ms/step", "IQR",
                       "mt-compiled/torch", "speed-up over mt eager",
                       "mt compiled == eager"], rows))
    if any("torch" in t["engines"] and "microtensor" in t["engines"]
           for r in results for t in r["by_threads"]):
        print("\nms per step, microtensor / torch (ratio):\n")
        counts = sorted({t["threads"] for r in results for t in r["by_threads"]})
        rows = []
        for n in counts:
            row = [n]
            for r in results:
                t = {t["threads"]: t for t in r["by_threads"]}.get(n)
                row.append(f"{t['engines']['microtensor']['ms_median']:.1f} / "
                           f"{t['engines']['torch']['ms_median']:.1f} "
                           f"({t['ratio_mt_over_torch']:.2f})"
                           if t and "ratio_mt_over_torch" in t else "")
            rows.append(row)
        print(C.table(["threads"] + [f"{r['config']} mt/torch ms" for r in results], rows))
    for r in results:
        print(f"{r['config']}: {r['step_gflop']:.3f} GFLOP of matmul per step; {r['steps']} timed "
              f"steps per engine and thread count in {r['rounds']} rounds after {r['warmup']} "
              f"warm-up; first losses " + json.dumps(
                  {e: [round(v, 5) for v in ls] for e, ls in r["first_losses"].items()}))


def plot_sweep(results, path, title=""):
    """tokens/s against threads, one panel per config: both engines (median, IQR bars)
    and the matmul ceiling (the step's products alone) as lines. Returns the path, or
    None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot")
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False)
    style = {"microtensor": dict(color="tab:blue", marker="o"),
             "microtensor-compiled": dict(color="tab:green", marker="^"),
             "torch": dict(color="tab:orange", marker="s"),
             "torch-compiled": dict(color="tab:red", marker="v")}
    for ax, r in zip(axes[0], results):
        counts = [t["threads"] for t in r["by_threads"]]
        tokens = r["tokens_per_step"]
        for e in r["by_threads"][0]["engines"]:
            st = [t["engines"][e] for t in r["by_threads"]]
            y = [s["tokens_per_s"] for s in st]
            lo = [yi - tokens / (s["ms_q3"] / 1e3) for yi, s in zip(y, st)]
            hi = [tokens / (s["ms_q1"] / 1e3) - yi for yi, s in zip(y, st)]
            ax.errorbar(counts, y, yerr=[lo, hi], capsize=3, label=e, **style[e])
        for lib, ls, color in (("numpy", "--", "tab:blue"), ("torch", ":", "tab:orange")):
            if all(lib in t.get("matmul_ceiling", {}) for t in r["by_threads"]):
                ax.plot(counts, [t["matmul_ceiling"][lib]["tokens_per_s"] for t in r["by_threads"]],
                        ls, color=color, alpha=0.7,
                        label=f"matmul ceiling ({'microtensor' if lib == 'numpy' else 'torch'})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(n) for n in counts])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("threads")
        ax.set_title(f"{r['config']} ({r['params'] / 1e6:.2f}M params)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens / s (training step)")
    axes[0][-1].legend(fontsize=8, loc="best")
    if title:
        import textwrap
        fig.suptitle(textwrap.fill(title, width=55 * len(results)), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep(names, counts, args, text, torch, info):
    results = [sweep_config(n, counts, args, text, torch) for n in names]
    print(f"\n## training step (forward + backward + clip + AdamW), thread sweep "
          f"{','.join(map(str, counts))}, both engines in this process\n")
    print_sweep(results)
    out = {"threads": counts, "results": results}
    if not args.no_plot:
        path = args.plot or os.path.join("out-bench", f"scaling_{'_'.join(names)}.png")
        load = ", ".join(f"{x:.1f}" for x in info.get("loadavg", ()))
        title = (f"{info['cpu']}, {info['cpus_available']} CPUs, BLAS kernel "
                 f"{info['blas_corename']}; load average at start {load}")
        if plot_sweep(results, path, title):
            print(f"# plot: {path}")
            out["plot"] = path
    return out


def replot(paths, plot):
    """The table and the picture of sweeps recorded with --json (one config per panel;
    a config recorded twice: the last record)."""
    by_config, machine = {}, None
    for path in paths:
        with open(path) as f:
            for line in f:
                rec = json.loads(line) if line.strip() else {}
                for r in rec.get("sweep", {}).get("results", []):
                    by_config.pop(r["config"], None)
                    by_config[r["config"]] = r
                    machine = rec.get("machine", machine)
    if not by_config:
        raise SystemExit(f"no thread sweep recorded in {', '.join(paths)}")
    results = list(by_config.values())
    print_sweep(results)
    title = ""
    if machine:
        title = (f"{machine['cpu']}, {machine.get('cpus_available', machine['cores'])} CPUs, "
                 f"BLAS kernel {machine['blas_corename']}")
    if plot_sweep(results, plot, title):
        print(f"# plot: {plot}")
    return {"results": results, "plot": plot}


# ---- main ------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny,cpu", help="comma-separated: tiny, cpu, mid")
    p.add_argument("--data", default=None, help="text corpus (default: tinyshakespeare if "
                   "present, else Python's documentation text)")
    p.add_argument("--threads", default="2",
                   help="thread count, or several separated by commas for a sweep (1,2,4,8,16)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per engine first")
    p.add_argument("--rounds", type=int, default=5, help="alternations A B per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="drop both torch engines")
    p.add_argument("--engines", default=",".join(ENGINE_KEYS),
                   help="comma-separated engines to run: mt (microtensor eager), mt-compiled "
                   "(mt.compile of the whole step), torch (PyTorch eager), torch-compiled "
                   "(torch.compile of the model, inductor); default all four")
    p.add_argument("--scipy-blas-threads", type=int, default=None,
                   help="experiment: threads of scipy's BLAS alone (microtensor calls its gemm inside "
                   "its own threads and pins it to 1; default: leave that pin)")
    p.add_argument("--ceiling", action="store_true",
                   help="also measure the config's matmul ceiling (bench_matmul)")
    p.add_argument("--memory", action="store_true", help="peak RSS of each engine, in children")
    p.add_argument("--profile", action="store_true", help="microtensor's step by op")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--torch-ops", action="store_true", help="with --profile: torch.profiler table")
    p.add_argument("--no-ceiling", action="store_true",
                   help="sweep: skip the matmul ceiling at each thread count")
    p.add_argument("--ceiling-repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--ceiling-min-time", type=float, default=0.05, help=argparse.SUPPRESS)
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="sweep: where to draw tokens/s against threads "
                   "(default out-bench/scaling_<configs>.png)")
    p.add_argument("--no-plot", action="store_true", help="sweep: draw nothing")
    p.add_argument("--plot-from", nargs="+", metavar="JSONL", default=None,
                   help="print the table and draw --plot from the sweeps recorded in these "
                   "--json files (their configs in order; the last record of a config wins)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    C.add_load_flags(p, " (benchmarks/run_16core.sh passes it). Without it, a busy "
                        "machine gets a warning and tables marked DRY RUN")
    p.add_argument("--isolate", action="store_true",
                   help="run each engine in its own child process (rounds alternate "
                   "processes) instead of both in this one")
    p.add_argument("--child", choices=ENGINE_ORDER, help=argparse.SUPPRESS)
    p.add_argument("--same-init", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        counts = parse_threads(args.threads)
    except ValueError as e:
        p.error(str(e))
    args.threads = counts[0]
    try:
        args.engines = parse_engines(args.engines, args.no_torch)
    except ValueError as e:
        p.error(str(e))

    if args.child:
        args.config = args.config.split(",")[0]
        return child_main(args)
    if args.plot_from:
        return replot(args.plot_from, args.plot or os.path.join("out-bench", "scaling.png"))

    names = args.config.split(",")
    for n in names:
        if n not in C.CONFIGS:
            p.error(f"unknown config {n!r}; choose from {', '.join(C.CONFIGS)}")
    if len(counts) > 1 and (args.memory or args.profile or args.isolate):
        p.error("--memory, --profile and --isolate take one thread count")
    sweep = len(counts) > 1
    kept, skipped = usable_thread_counts(counts) if sweep else (counts, [])
    if not kept:
        p.error(f"no thread count of {','.join(map(str, counts))} fits the "
                f"{len(C.available_cpus())} CPUs this process may run on")
    # the load before anything of ours runs (--memory times nothing)
    load_before = None if args.memory else C.check_quiet(args.allow_busy, p.prog,
                                                         strict=args.strict_quiet)
    wants_torch = any(e.startswith("torch") for e in args.engines)
    torch = C.try_import_torch() if wants_torch else None
    if wants_torch and torch is None:
        print("# torch is not installed: the torch engines do not run")
    if sweep and "torch-compiled" in args.engines:
        print("# torch-compiled is left out of a thread sweep (its kernels keep the thread "
              "count they were compiled at); run one --threads per process for it")
    C.setup_threads(kept[0], torch, args.scipy_blas_threads)
    info = C.machine_info(kept if sweep else args.threads, torch)
    info["scipy_blas_threads"] = args.scipy_blas_threads
    C.print_machine(info)
    text, source = C.load_text(args.data)
    print(f"# corpus: {source} ({len(text):,} chars, vocab {len(set(text))})")
    record = {"bench": "train", "machine": info, "corpus": source, "load_before": load_before,
              "dry_run": load_before is not None and load_before > C.QUIET_LOAD}
    if skipped:
        print(f"# skipped threads {', '.join(map(str, skipped))}: more than the "
              f"{len(C.available_cpus())} CPUs this process may run on")

    if sweep:
        record["sweep"] = run_sweep(names, kept, args, text, torch, info)
        record["sweep"]["skipped_threads"] = skipped
    elif args.memory:
        record["memory"] = memory(names, args)
    elif args.profile:
        record["profile"] = [profile(n, args, text, torch) for n in names]
    else:
        if args.isolate:
            results = [isolated(n, args, torch) for n in names]
        else:
            results = [run_config(n, args, text, torch) for n in names]
        how = "each engine in its own process" if args.isolate else "all engines in this process"
        dry = " (DRY RUN: not for the docs)" if record["dry_run"] else ""
        print(f"\n## training step (forward + backward + clip + AdamW), threads={args.threads}, "
              f"{how}{dry}\n")
        print_results(results)
        record["results"] = results
    if record["dry_run"]:
        print(f"# DRY RUN: timed at a load average of {load_before:.2f} (above {C.QUIET_LOAD}), "
              "with other work on the CPUs: not for the docs")
    record["load_after"] = C.print_load_after()
    if args.json is not None:
        C.emit_json(record, args.json)
    return record


if __name__ == "__main__":
    main()
