"""Data-parallel training over MPI: tokens/s for 1, 2, ... ranks, and the MPI all-reduce.

Each rank runs one thread and trains the GPT of a benchmark config (_common.CONFIGS) on
its own batch of batch_size sequences, wrapped in DistributedDataParallel (weak
scaling: N ranks process N times the tokens of one). A timed step is forward +
backward (which ends with the gradient all-reduce) + clip + AdamW, the step of
bench_train.py. Reported per rank count:

  * ms/step and tokens/s of the whole job, speed-up and efficiency against 1 rank;
  * comm alone: the same buckets all-reduced back to back with nothing else running;
  * exposed: the time backward spent waiting for the all-reduces (the least over the
    ranks: the others also wait for the slowest rank, which is not communication);
  * hidden = 1 - exposed / comm alone: the share of communication that overlapped
    the rest of backward.

    python benchmarks/bench_ddp.py                            # config cpu, 1 and 2 ranks
    python benchmarks/bench_ddp.py --config tiny,cpu --ranks 1,2,4 --steps 20
    python benchmarks/bench_ddp.py --allreduce --ranks 2      # latency, bandwidth, model
    python benchmarks/bench_ddp.py --model 5,1.5              # the model for alpha, beta

The parent process starts every measurement with `mpiexec -n N` (the one beside this
Python first, then PATH) and prints the tables; --json FILE appends the results.
The data are random tokens: the speed of a step does not depend on the text.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import numpy as np  # noqa: E402

VOCAB = 65                        # tinyshakespeare's characters
DEFAULT_STEPS = {"tiny": 30, "cpu": 10, "mid": 2}
DEFAULT_WARMUP = {"tiny": 5, "cpu": 2, "mid": 1}
RESULT = "RESULT "                # prefix of the worker's JSON line
ALLREDUCE_SIZES = [4 ** k for k in range(1, 14)]   # 4 B .. 64 MiB


def find_mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


# ---- workers: one per rank, started by mpiexec -----------------------------------------

def gather(obj):
    import microtensor.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def train_worker(args):
    import microtensor as mt
    import microtensor.distributed as dist
    from models import GPT, GPTConfig
    rank, world = dist.init()
    C.setup_threads(1)
    cfg = C.CONFIGS[args.config]
    B, T = cfg["batch_size"], cfg["block_size"]
    mt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=cfg["n_layer"],
                          n_head=cfg["n_head"], n_embd=cfg["n_embd"]))
    ddp = mt.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    params = list(model.parameters())
    optimizer = mt.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    rng = np.random.default_rng([0, rank])
    steps = args.steps or DEFAULT_STEPS[args.config]
    warmup = DEFAULT_WARMUP[args.config] if args.warmup is None else args.warmup

    def step():
        data = rng.integers(0, VOCAB, size=(B, T + 1))
        x, y = mt.from_numpy(data[:, :-1].copy()), mt.from_numpy(data[:, 1:].copy())
        t0 = time.perf_counter()
        _, loss = ddp(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        mt.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t2 - t1, time.perf_counter() - t0

    for _ in range(warmup):
        step()
    dist.barrier()
    wait0 = ddp.stats["wait_s"]
    start = time.perf_counter()
    times = [step() for _ in range(steps)]
    total = time.perf_counter() - start
    wait = (ddp.stats["wait_s"] - wait0) / steps

    # the same all-reduces with nothing else running: what overlap could hide
    comm_alone = 0.0
    if world > 1:
        MPI = dist._state.MPI
        buffers = [np.zeros_like(b.flat) for b in ddp._buckets]
        samples = []
        for _ in range(max(3, min(steps, 10))):
            dist.barrier()
            t0 = time.perf_counter()
            requests = [dist._state.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                        for buf in buffers]
            dist.wait(requests, "benchmark all-reduce")
            samples.append(time.perf_counter() - t0)
        comm_alone = float(np.median(samples))

    mine = dict(wait=wait, backward=float(np.median([t[0] for t in times])),
                step=float(np.median([t[1] for t in times])))
    everyone = gather(mine)
    if rank == 0:
        n_params = sum(p.numel() for p in params)
        result = dict(
            kind="ddp", config=args.config, ranks=world, params=n_params,
            batch_per_rank=B, block_size=T, steps=steps, hook_mode=ddp.hook_mode,
            buckets=ddp.stats["buckets"], bytes_per_sync=ddp.stats["bytes_per_sync"],
            started_early=ddp.stats["started_early"],
            ms_per_step=1e3 * total / steps,
            tokens_per_s=world * B * T * steps / total,
            backward_ms=1e3 * max(r["backward"] for r in everyone),
            exposed_ms=1e3 * min(r["wait"] for r in everyone),
            comm_alone_ms=1e3 * comm_alone)
        print(RESULT + json.dumps(result), flush=True)


def allreduce_worker(args):
    """Time of one all-reduce of n bytes (float32) through the path DDP uses
    (Iallreduce, then polling with a deadline) and through a blocking Allreduce."""
    import microtensor.distributed as dist
    rank, world = dist.init()
    MPI, comm = dist._state.MPI, dist._state.comm
    rows = []
    for nbytes in ALLREDUCE_SIZES:
        buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
        reps = int(min(200, max(5, 2e7 / max(nbytes, 1))))
        timings = {}
        for how in ("blocking", "ddp"):
            for _ in range(3):                        # warm-up
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            samples = []
            for _ in range(reps):
                comm.Barrier()
                t0 = time.perf_counter()
                if how == "blocking":
                    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                else:
                    dist.wait([comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)], "all-reduce")
                samples.append(time.perf_counter() - t0)
            # the slowest rank decides when the reduction is complete everywhere
            timings[how] = max(gather(float(np.median(samples))))
        rows.append(dict(bytes=buf.nbytes, blocking_us=1e6 * timings["blocking"],
                         ddp_us=1e6 * timings["ddp"]))
    if rank == 0:
        print(RESULT + json.dumps(dict(kind="allreduce", ranks=world, rows=rows)), flush=True)


# ---- a model of the step time on N machines ---------------------------------------------
#
# One rank per machine, each with its batch (weak scaling). A step is the compute time
# T_c of one rank plus the communication that overlap does not hide. Ring all-reduce of
# S gradient bytes over N ranks: 2(N-1) steps, each a latency alpha plus S/N bytes over
# a link of bandwidth beta, once per bucket for the latency:
#     T_ar(N) = buckets * 2(N-1) * alpha + 2(N-1)/N * S / beta
# No overlap: T(N) = T_c + T_ar(N). Ideal overlap: backward (~2/3 of T_c) hides it,
# T(N) = T_c + max(0, T_ar(N) - 2/3 T_c). Efficiency = T_c / T(N): tokens/s of N ranks
# divided by N times one rank's.

# compute per rank and step at one thread: tiny, cpu and mid are the 1-thread medians of
# docs/BENCHMARKS.md (quiet machine); example (train_char.py's defaults, vocabulary 103)
# and gpt2 (GPT-2 small, one 1024-token sequence per rank) come from their matmul FLOPs
# at the GFLOP/s measured for cpu (79.4) and mid (104.9).
MODEL_CONFIGS = {
    "example": dict(n_layer=2, n_embd=128, block_size=32, batch_size=64, vocab=103,
                    gflops=79.4),
    "tiny": dict(n_layer=2, n_embd=64, block_size=32, batch_size=16, vocab=65, step_s=6.3e-3),
    "cpu": dict(n_layer=4, n_embd=128, block_size=64, batch_size=12, vocab=65, step_s=50.0e-3),
    "mid": dict(n_layer=6, n_embd=384, block_size=256, batch_size=12, vocab=65, step_s=2.077),
    "gpt2": dict(n_layer=12, n_embd=768, block_size=1024, batch_size=1, vocab=50257,
                 gflops=104.9),
}
# links: this machine's measurement is passed in; the others are typical published
# figures for MPI over those networks, assumed, not measured here
NETWORKS = {"10 GbE (assumed)": (50e-6, 1.1e9), "100 Gb/s InfiniBand (assumed)": (3e-6, 11e9)}


def gpt_params(c):
    """nanoGPT's GPT with biases and tied embeddings: wte + wpe + blocks + ln_f."""
    C, L = c["n_embd"], c["n_layer"]
    return c["vocab"] * C + c["block_size"] * C + L * (12 * C * C + 13 * C) + 2 * C


def gpt_step_flops(c):
    """docs/BENCHMARKS.md's count of a step's matrix-product FLOPs."""
    B, T, C, L, V = c["batch_size"], c["block_size"], c["n_embd"], c["n_layer"], c["vocab"]
    M = B * T
    return 3 * (L * (24 * M * C * C + 4 * B * T * T * C) + 2 * M * C * V)


def ring_allreduce_s(n, nbytes, alpha, beta, buckets):
    if n == 1:
        return 0.0
    return buckets * 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def efficiency(n, step_s, nbytes, alpha, beta, buckets, overlap):
    comm = ring_allreduce_s(n, nbytes, alpha, beta, buckets)
    exposed = max(0.0, comm - 2 / 3 * step_s) if overlap else comm
    return step_s / (step_s + exposed)


def bend(step_s, nbytes, alpha, beta, buckets, overlap, level):
    """The smallest N (up to 2^20) whose efficiency is below `level`, or None."""
    n = 2
    while n <= 2 ** 20:
        if efficiency(n, step_s, nbytes, alpha, beta, buckets, overlap) < level:
            lo = n // 2 + 1 if n > 2 else 2
            for m in range(lo, n + 1):       # refine between powers of two
                if efficiency(m, step_s, nbytes, alpha, beta, buckets, overlap) < level:
                    return m
        n *= 2
    return None


def print_model(alpha, beta, label, speedup=1.0):
    """The table of docs/DISTRIBUTED.md: per config and link, the all-reduce time, the
    efficiency at 2, 16 and 128 ranks, the plateau the bandwidth term sets (for large
    N, T_ar -> 2 S / beta + latency), and the N where efficiency falls below 50%
    (without overlap / with ideal overlap). `speedup` divides every T_c (faster
    machines, more threads per rank)."""
    networks = {label: (alpha, beta), **NETWORKS}
    rows = []
    for name, c in MODEL_CONFIGS.items():
        n_params = gpt_params(c)
        nbytes = 4 * n_params
        step_s = (c.get("step_s") or gpt_step_flops(c) / (c["gflops"] * 1e9)) / speedup
        first = 1024 * 1024
        buckets = 1 + (max(0, nbytes - first) + 25 * 2 ** 20 - 1) // (25 * 2 ** 20)
        for net, (a, b) in networks.items():
            def eff(n, overlap=False):
                return f"{efficiency(n, step_s, nbytes, a, b, buckets, overlap):.0%}"

            def n50(overlap):
                n = bend(step_s, nbytes, a, b, buckets, overlap, 0.5)
                return "> 1M" if n is None else f"{n:,}"
            plateau = step_s / (step_s + 2 * nbytes / b)
            rows.append([name, f"{n_params / 1e6:.2f}M", f"{nbytes / 1e6:.1f}",
                         f"{step_s * 1e3:,.0f}", net,
                         f"{ring_allreduce_s(2, nbytes, a, b, buckets) * 1e3:.2f}",
                         f"{eff(2)} / {eff(16)} / {eff(128)}", f"{plateau:.0%}",
                         f"{n50(False)} / {n50(True)}"])
    print(C.table(["config", "params", "grad MB", "T_c ms", "link", "T_ar(2) ms",
                   "eff. N=2 / 16 / 128", "bandwidth plateau", "N at 50% (no / ideal overlap)"],
                  rows))


# ---- the parent: launches, tables -----------------------------------------------------

def launch(n, worker_args, mpiexec):
    cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker",
           *worker_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"mpiexec -n {n} failed (status {proc.returncode}):\n{proc.stdout}\n"
                 f"{proc.stderr}")
    return json.loads(lines[-1][len(RESULT):])


def fit_allreduce(rows, ranks):
    """The ring model's latency per step alpha (s) and link bandwidth beta (bytes/s):
    t(n) = 2(N-1) alpha + 2(N-1)/N * n / beta. alpha from the three smallest messages,
    beta by least squares over the messages of 1 MiB and more."""
    steps = 2 * (ranks - 1)
    alpha = float(np.median([r["ddp_us"] for r in rows[:3]])) * 1e-6 / steps
    big = [r for r in rows if r["bytes"] >= 2 ** 20]
    moved = np.array([2 * (ranks - 1) / ranks * r["bytes"] for r in big])
    excess = np.array([r["ddp_us"] * 1e-6 - steps * alpha for r in big])
    beta = float((moved * moved).sum() / (moved * excess).sum())
    return alpha, beta


def print_ddp_table(results):
    base = {r["config"]: r for r in results if r["ranks"] == 1}
    rows = []
    for r in results:
        one = base.get(r["config"])
        speedup = r["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
        hidden = (max(0.0, min(1.0, 1 - r["exposed_ms"] / r["comm_alone_ms"]))
                  if r["comm_alone_ms"] > 0 else float("nan"))
        rows.append([r["config"], f"{r['params'] / 1e6:.2f}M", r["ranks"],
                     f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     f"{speedup:.2f}x", f"{speedup / r['ranks']:.0%}",
                     f"{r['comm_alone_ms']:.2f}", f"{r['exposed_ms']:.2f}",
                     "-" if hidden != hidden else f"{hidden:.0%}",
                     f"{r['buckets']} ({r['started_early']} early)", r["hook_mode"] or "-"])
    print(C.table(["config", "params", "ranks", "ms/step", "tokens/s", "speed-up",
                   "efficiency", "comm alone ms", "exposed ms", "hidden", "buckets",
                   "hooks"], rows))


def print_allreduce_table(result):
    n = result["ranks"]
    rows = []
    for r in result["rows"]:
        moved = 2 * (n - 1) / n * r["bytes"]
        rows.append([f"{r['bytes']:,}", f"{r['blocking_us']:.1f}", f"{r['ddp_us']:.1f}",
                     f"{moved / (r['ddp_us'] * 1e-6) / 1e9:.2f}"])
    print(C.table(["bytes", "Allreduce us", "Iallreduce+poll us", "bus GB/s"], rows))
    alpha, beta = fit_allreduce(result["rows"], n)
    print(f"ring model fit ({n} ranks): latency per step alpha = {alpha * 1e6:.1f} us, "
          f"link bandwidth beta = {beta / 1e9:.2f} GB/s")
    return alpha, beta


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu", help="comma-separated: tiny, cpu, mid")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default per config)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--bucket_cap_mb", type=float, default=25)
    p.add_argument("--rounds", type=int, default=1,
                   help="launches per rank count, alternating; the median is reported")
    p.add_argument("--allreduce", action="store_true",
                   help="measure MPI all-reduce latency and bandwidth instead, then print "
                        "the step-time model for N machines")
    p.add_argument("--model", default=None, metavar="ALPHA_US,BETA_GBS",
                   help="print only the step-time model for this latency (us) and "
                        "bandwidth (GB/s), e.g. 5,1.5")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="with --model/--allreduce: divide every compute time T_c by this")
    p.add_argument("--json", default=None, help="append the results to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        (allreduce_worker if args.allreduce else train_worker)(args)
        return

    if args.model:
        alpha_us, beta_gbs = (float(v) for v in args.model.split(","))
        print_model(alpha_us * 1e-6, beta_gbs * 1e9, f"{alpha_us:g} us, {beta_gbs:g} GB/s",
                    args.speedup)
        return
    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.exit("mpiexec not found: pip install 'microtensor[mpi]'")
    ranks = [int(n) for n in args.ranks.split(",")]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, one thread per rank")
    if args.allreduce:
        for n in ranks:
            if n > 1:
                result = launch(n, ["--allreduce"], mpiexec)
                alpha, beta = print_allreduce_table(result)
                if args.json:
                    C.emit_json(result, args.json)
        print("\nstep-time model, one rank per machine (see the comments in this script):")
        print_model(alpha, beta, f"this machine ({alpha * 1e6:.1f} us, {beta / 1e9:.2f} GB/s)",
                    args.speedup)
        return

    configs = args.config.split(",")
    for name in configs:
        if name not in C.CONFIGS:
            p.error(f"unknown config {name!r}; choose from {', '.join(C.CONFIGS)}")
    results = []
    for name in configs:
        # rank counts alternate over the rounds (1 2 1 2 ...): a change of load on this
        # shared machine then hits all of them; each row is the median round
        runs = {n: [] for n in ranks}
        for _ in range(args.rounds):
            for n in ranks:
                worker_args = ["--config", name, "--bucket_cap_mb", str(args.bucket_cap_mb)]
                if args.steps:
                    worker_args += ["--steps", str(args.steps)]
                if args.warmup is not None:
                    worker_args += ["--warmup", str(args.warmup)]
                result = launch(n, worker_args, mpiexec)
                runs[n].append(result)
                print(f"  {name}, {n} rank(s): {result['ms_per_step']:.1f} ms/step "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
                if args.json:
                    C.emit_json(result, args.json)
        for n in ranks:
            ordered = sorted(runs[n], key=lambda r: r["ms_per_step"])
            results.append(ordered[len(ordered) // 2])
    print_ddp_table(results)


if __name__ == "__main__":
    main()
