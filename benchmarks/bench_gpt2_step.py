"""One training step of GPT-2 small (124M) at llm.c's CPU size (batch 4, 64 tokens,
vocabulary 50,257), side by side: microtensor, PyTorch eager, and llm.c's CPU trainer
(train_gpt2.c); each one's peak memory; and the step's own matrix products, timed alone
through microtensor's BLAS, as a share of microtensor's step (what is not a product is
what is left to win).

Each engine runs in a child process of its own (its peak memory is the child's
ru_maxrss, read with wait4), at each --threads count:
  microtensor  GPT(GPTConfig.gpt2()), AdamW (weight decay on matrices), gradient
               clipping at 1.0, as benchmarks/bench_train.py's step;
  torch        the same model in PyTorch eager (benchmarks/torch_gpt.py, its own init:
               the model build column is each library's), the same optimizer and clipping;
  llm.c        train_gpt2.c, built in a temporary folder with its Makefile's flags
               (-Ofast -march=native -fopenmp -DOMP), OMP_NUM_THREADS threads, fed random
               weights written in its checkpoint format (gpt2_124M.bin: a 256-int header,
               then the float32 parameters in its order) and random tokens in its data
               format; its own per-step time ("took ... ms") is parsed from its output,
               and it is stopped once enough steps are read. Its step is AdamW without
               weight decay or clipping. llm.c's source is not part of this repository:
               --llmc DIR names a folder holding train_gpt2.c, llmc/ and its Makefile,
               e.g. from a clone of github.com/karpathy/llm.c (or a git mirror:
                 mkdir -p /tmp/llmc/llmc && cd /tmp/llmc &&
                 for f in Makefile train_gpt2.c llmc/utils.h llmc/tokenizer.h
                          llmc/dataloader.h llmc/rand.h; do
                   git --git-dir=MIRROR show HEAD:$f > $f; done).
               Without it, or when it does not build, the table says so and the others run.
  products     every matrix product of the step (benchmarks/_common.py, matmul_shapes:
               the Linear layers forward and backward, the lm_head's, attention's
               batched products), operands laid out as the step stores them, each timed
               alone through microtensor's gemm/batched_gemm: their sum is the step's
               products' time.

    python benchmarks/bench_gpt2_step.py --threads 1,2 --llmc /tmp/llmc
    python benchmarks/bench_gpt2_step.py --threads 1 --profile      # where the step's time goes
    python benchmarks/bench_gpt2_step.py --small --allow-busy       # a quick check of the benchmark
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# NOTE: the benchmarks' folder only: microtensor and models come from where they are
# installed (the repository's root first would hide an installed copy behind unbuilt sources)
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

import numpy as np  # noqa: E402

# GPT-2 small at llm.c's CPU size; --small: the same structure, tiny (a check, not a figure)
GPT2 = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
SMALL = dict(vocab_size=1000, block_size=128, n_layer=2, n_head=4, n_embd=64)
BATCH, TOKENS = 4, 64
LLMC_MAX_STEPS = 19        # llm.c evaluates at step 20 and generates 63 tokens: stop before


def batches(vocab_size, n, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, vocab_size, (n, BATCH, TOKENS + 1), dtype=np.int64)
    return [(d[:, :-1].copy(), d[:, 1:].copy()) for d in data]


# ---- the children: one engine each -------------------------------------------------------

def child_step(engine, shape, threads, warmup, steps, seed):
    """Time `steps` training steps after `warmup` of one engine: {"times": [s, ...]}."""
    import bench_train
    torch = C.try_import_torch() if engine == "torch" else None
    C.setup_threads(threads, torch)
    cfg = dict(block_size=shape["block_size"], n_layer=shape["n_layer"],
               n_head=shape["n_head"], n_embd=shape["n_embd"])
    t0 = time.perf_counter()
    if engine == "torch":
        # torch's own init (not a copy of microtensor's model: that would count its
        # memory here too); the step's time does not depend on the values
        torch.manual_seed(seed)
        model, step = bench_train.build_torch(torch, cfg=cfg, vocab_size=shape["vocab_size"])
    else:
        model, step = bench_train.build_mt(cfg, shape["vocab_size"], seed)
    build = time.perf_counter() - t0
    data = batches(shape["vocab_size"], warmup + steps, seed)
    times, losses = [], []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        losses.append(step(x, y))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "losses": losses, "build_s": build}


def child_products(shape, threads, repeats):
    """The step's matrix products, each alone through microtensor's gemm (median of
    `repeats`): {"seconds": total per step, "rows": [(name, count, seconds)]}."""
    import microtensor as mt
    from microtensor.kernels import _blas
    C.setup_threads(threads)
    cfg = dict(batch_size=BATCH, block_size=TOKENS, n_layer=shape["n_layer"],
               n_head=shape["n_head"], n_embd=shape["n_embd"])
    rng = np.random.default_rng(0)
    rows, total = [], 0.0
    for s in C.matmul_shapes(cfg, shape["vocab_size"]):
        lead = () if s["batch"] is None else (s["batch"],)
        a = rng.standard_normal(lead + ((s["k"], s["m"]) if s["ta"] else (s["m"], s["k"])),
                                dtype=np.float32)
        b = rng.standard_normal(lead + ((s["n"], s["k"]) if s["tb"] else (s["k"], s["n"])),
                                dtype=np.float32)
        a = np.swapaxes(a, -1, -2) if s["ta"] else a           # a view, passed as a 'T' flag
        b = np.swapaxes(b, -1, -2) if s["tb"] else b
        nt = mt.get_num_threads()
        if s["batch"] is None:
            fn = (lambda a=a, b=b: _blas.gemm(a, b, num_threads=nt))
        else:
            fn = (lambda a=a, b=b: _blas.batched_gemm(a, b, num_threads=nt))
        fn()
        number = C.calibrate(fn, 0.02)
        t = C.median([C.time_once(fn, number) for _ in range(repeats)])
        rows.append((s["name"], s["count"], t))
        total += s["count"] * t
    return {"seconds": total, "rows": rows, "flops": C.step_flops(cfg, shape["vocab_size"])}


def child_profile(shape, threads, steps, top):
    """microtensor's step by op (mt.profiler), as a text table."""
    import bench_train
    from microtensor.profiler import Profiler
    C.setup_threads(threads)
    cfg = dict(block_size=shape["block_size"], n_layer=shape["n_layer"],
               n_head=shape["n_head"], n_embd=shape["n_embd"])
    _, step = bench_train.build_mt(cfg, shape["vocab_size"], 0)
    data = batches(shape["vocab_size"], steps + 1, 0)
    step(*data[0])
    with Profiler() as prof:
        for x, y in data[1:]:
            step(x, y, prof)
    return {"table": prof.table(steps=steps, top=top)}


def run_child(args, what, threads, extra=()):
    argv = [os.path.abspath(__file__), "--child", what, "--threads", str(threads),
            "--warmup", str(args.warmup), "--steps", str(args.steps), *extra]
    if args.small:
        argv.append("--small")
    peak, out = C.run_child_peak_rss(argv)
    return peak, json.loads(out.strip().splitlines()[-1])


# ---- llm.c -----------------------------------------------------------------------------

def build_llmc(src, workdir):
    """train_gpt2 built in workdir from a copy of src with its Makefile (CC: clang as the
    Makefile asks, else cc); (path, None) or (None, why not)."""
    if src is None:
        return None, "no --llmc folder given"
    if not os.path.exists(os.path.join(src, "train_gpt2.c")):
        return None, f"{src} holds no train_gpt2.c"
    build = os.path.join(workdir, "src")
    shutil.copytree(src, build, ignore=shutil.ignore_patterns(".git", "dev", "build"))
    cc = "clang" if shutil.which("clang") else "cc"
    if os.path.exists(os.path.join(build, "Makefile")):
        cmd = ["make", "train_gpt2", f"CC={cc}", "NO_USE_MPI=1"]
    else:
        cmd = [cc, "-Ofast", "-march=native", "-fopenmp", "-DOMP", "train_gpt2.c", "-lm",
               "-o", "train_gpt2"]
    proc = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
    binary = os.path.join(build, "train_gpt2")
    if proc.returncode != 0 or not os.path.exists(binary):
        return None, f"llm.c did not build ({' '.join(cmd)}): {proc.stderr.strip()[-300:]}"
    flags = re.search(r"^(clang|cc|gcc)\s.*train_gpt2\.c.*$", proc.stdout, re.M)
    return binary, flags.group(0) if flags else " ".join(cmd)


def write_llmc_inputs(run_dir, shape, seed):
    """gpt2_124M.bin (random weights, llm.c's checkpoint format: header [20240326, 3,
    maxT, V, L, NH, C, Vp], then wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb,
    ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, lnfw, lnfb) and the token files llm.c reads
    (header [20240520, 1, ntok], then uint16 ids)."""
    V, maxT, L = shape["vocab_size"], shape["block_size"], shape["n_layer"]
    NH, Cd = shape["n_head"], shape["n_embd"]
    Vp = (V + 127) // 128 * 128
    rng = np.random.default_rng(seed)
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, maxT, V, L, NH, Cd, Vp]
    sizes = [("wte", Vp * Cd, 0.02), ("wpe", maxT * Cd, 0.01), ("ln1w", L * Cd, "ones"),
             ("ln1b", L * Cd, 0), ("qkvw", L * 3 * Cd * Cd, 0.02), ("qkvb", L * 3 * Cd, 0),
             ("attprojw", L * Cd * Cd, 0.02), ("attprojb", L * Cd, 0), ("ln2w", L * Cd, "ones"),
             ("ln2b", L * Cd, 0), ("fcw", L * 4 * Cd * Cd, 0.02), ("fcb", L * 4 * Cd, 0),
             ("fcprojw", L * Cd * 4 * Cd, 0.02), ("fcprojb", L * Cd, 0), ("lnfw", Cd, "ones"),
             ("lnfb", Cd, 0)]
    with open(os.path.join(run_dir, "gpt2_124M.bin"), "wb") as f:
        f.write(header.tobytes())
        for _, n, init in sizes:
            if init == "ones":
                a = np.ones(n, np.float32)
            elif init == 0:
                a = np.zeros(n, np.float32)
            else:
                a = rng.standard_normal(n, dtype=np.float32) * np.float32(init)
            f.write(a.tobytes())
    data_dir = os.path.join(run_dir, "dev", "data", "tinyshakespeare")
    os.makedirs(data_dir, exist_ok=True)
    for name in ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"):
        ntok = 1 << 15
        header = np.zeros(256, np.int32)
        header[:3] = [20240520, 1, ntok]
        with open(os.path.join(data_dir, name), "wb") as f:
            f.write(header.tobytes())
            f.write(rng.integers(0, V, ntok, dtype=np.uint16).tobytes())


def run_llmc(binary, run_dir, threads, warmup, steps):
    """(peak RSS bytes, [seconds per step after warmup]): llm.c's own step times, read
    line by line (stdbuf makes its stdout line-buffered) until warmup + steps are in,
    then it is stopped (its step 20 would evaluate and generate)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = ([shutil.which("stdbuf"), "-oL"] if shutil.which("stdbuf") else []) + [binary]
    proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    times = []
    pattern = re.compile(r"^step (\d+): train loss [-\d.naif]+ \(took ([\d.]+) ms\)")
    for line in proc.stdout:
        m = pattern.match(line)
        if m:
            if int(m.group(1)) >= warmup:
                times.append(float(m.group(2)) / 1e3)
            if len(times) >= steps:
                break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.close()
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss * 1024, times


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps per engine first (each engine's; five, since the "
                        "optimizer's state and the freed memory kept for reuse settle over "
                        "the first steps: microtensor's page faults fall from about 50,000 "
                        "a step to a few hundred by the fifth)")
    p.add_argument("--repeats", type=int, default=5, help="timings of each product")
    p.add_argument("--llmc", default=None, metavar="DIR",
                   help="a folder with llm.c's train_gpt2.c, llmc/ and Makefile")
    p.add_argument("--engines", default="microtensor,torch,llm.c")
    p.add_argument("--small", action="store_true",
                   help="a 2-layer model of the same structure: a check of the benchmark, "
                   "not a figure")
    p.add_argument("--profile", action="store_true",
                   help="microtensor's step by op at the first thread count (shares)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    C.add_load_flags(p)
    p.add_argument("--child", choices=["microtensor", "torch", "products", "profile"],
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        p.error(f"--threads takes integers separated by commas, got {args.threads!r}")
    if not counts or min(counts) < 1:
        p.error("--threads: each count must be at least 1")
    shape = SMALL if args.small else GPT2

    if args.child:
        if args.child in ("microtensor", "torch"):
            result = child_step(args.child, shape, counts[0], args.warmup, args.steps, 0)
        elif args.child == "products":
            result = child_products(shape, counts[0], args.repeats)
        else:
            result = child_profile(shape, counts[0], args.steps, args.profile_top)
        print(json.dumps(result))
        return 0

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"microtensor", "torch", "llm.c"}
    if unknown:
        p.error(f"--engines: unknown {sorted(unknown)}; choose from microtensor, torch, llm.c")
    if args.warmup + args.steps > LLMC_MAX_STEPS and "llm.c" in engines:
        p.error(f"--warmup + --steps must be at most {LLMC_MAX_STEPS} (llm.c evaluates and "
                "generates at its step 20)")
    torch = C.try_import_torch()
    if torch is None and "torch" in engines:
        print("# torch is not installed: its column is left out")
        engines.remove("torch")

    load = C.check_quiet(args.allow_busy, "bench_gpt2_step.py", strict=args.strict_quiet)
    C.setup_threads(counts[0], torch)
    info = C.machine_info(counts[0], torch)
    C.print_machine(info)
    print(f"# model {'small (a check, not a figure)' if args.small else 'GPT-2 small (124M)'}: "
          f"n_layer={shape['n_layer']} n_head={shape['n_head']} n_embd={shape['n_embd']} "
          f"vocab={shape['vocab_size']}; batch {BATCH} x {TOKENS} tokens; median of "
          f"{args.steps} steps after {args.warmup}; each engine in its own process")

    workdir = tempfile.mkdtemp(prefix="bench_gpt2_step_")
    llmc = None
    try:
        if "llm.c" in engines:
            binary, note = build_llmc(args.llmc, workdir)
            if binary is None:
                print(f"# llm.c: not run: {note}")
                engines.remove("llm.c")
            else:
                print(f"# llm.c: built with: {note}")
                run_dir = os.path.join(workdir, "run")
                os.makedirs(run_dir)
                write_llmc_inputs(run_dir, shape, 0)
                llmc = (binary, run_dir)
        results = []
        for n in counts:
            row = {"threads": n, "engines": {}}
            for engine in engines:
                if engine == "llm.c":
                    peak, times = run_llmc(*llmc, n, args.warmup, args.steps)
                    if not times:
                        print(f"# llm.c at {n} thread(s): no step times read")
                        continue
                    row["engines"][engine] = {"step_s": C.median(times), "peak_bytes": peak,
                                              "times": times}
                else:
                    peak, out = run_child(args, engine, n)
                    row["engines"][engine] = {"step_s": C.median(out["times"]),
                                              "peak_bytes": peak, "times": out["times"],
                                              "build_s": out["build_s"]}
            if "microtensor" in row["engines"]:
                _, products = run_child(args, "products", n)
                row["products"] = products
            results.append(row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print_results(results, engines)
    C.print_load_after()
    if args.profile:
        _, out = run_child(args, "profile", counts[0], ("--profile-top", str(args.profile_top)))
        print(f"\n# microtensor's step by op at {counts[0]} thread(s) (shares of the step)")
        print(out["table"])
    if args.json:
        C.emit_json({"bench": "gpt2_step", "machine": info, "load_at_start": load,
                     "small": args.small, "results": results}, args.json)
    return 0


def print_results(results, engines):
    rows = []
    for r in results:
        mt_step = r["engines"].get("microtensor", {}).get("step_s")
        for engine in engines:
            e = r["engines"].get(engine)
            if e is None:
                continue
            rows.append([r["threads"], engine, C.fmt_time(e["step_s"]),
                         C.fmt_ratio(mt_step, e["step_s"]) if mt_step else "n/a",
                         f"{e['peak_bytes'] / 2**30:.2f} GiB",
                         f"{e['build_s']:.2f} s" if "build_s" in e else ""])
    print()
    print(C.table(["threads", "engine", "step (median)", "microtensor / engine",
                   "peak memory", "model build"], rows))
    rows = []
    for r in results:
        if "products" not in r:
            continue
        pr, step = r["products"], r["engines"]["microtensor"]["step_s"]
        rows.append([r["threads"], C.fmt_time(pr["seconds"]), C.fmt_time(step),
                     f"{step / pr['seconds']:.2f}", f"{100 * pr['seconds'] / step:.0f}%",
                     f"{pr['flops'] / step / 1e9:.1f}", f"{pr['flops'] / pr['seconds'] / 1e9:.1f}"])
    if rows:
        print()
        print("# the step's matrix products, each timed alone through microtensor's gemm")
        print(C.table(["threads", "products", "microtensor step", "step / products",
                       "products' share", "step GFLOP/s", "products GFLOP/s"], rows))
        first = next(r for r in results if "products" in r)
        top = sorted(first["products"]["rows"], key=lambda t: -t[1] * t[2])[:6]
        total = first["products"]["seconds"]
        print(f"\n# the largest products at {first['threads']} thread(s), share of all products")
        print(C.table(["product", "per step", "share"],
                      [[name, C.fmt_time(count * t), f"{100 * count * t / total:.0f}%"]
                       for name, count, t in top]))


if __name__ == "__main__":
    raise SystemExit(main())
