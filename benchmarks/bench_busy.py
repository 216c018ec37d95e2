"""The default thread count against one thread, on a machine that is busy.

A learner's script runs at the library's default thread count while a browser, an editor
or a second experiment also runs. This times training loops written as a user writes
them, each in a fresh process, at the default thread count and at one thread, with
`--busy N` processes spinning (`while True: pass`) beside them, and prints the median
step of each and their ratio:

    python benchmarks/bench_busy.py                        # quiet machine
    python benchmarks/bench_busy.py --busy 1               # one core taken (2-core machine)
    python benchmarks/bench_busy.py --busy 1 --env OMP_WAIT_POLICY=ACTIVE
                                                           # the runtime's own spin-wait

--env NAME=VALUE (repeatable) sets a variable in the children, e.g. to compare OpenMP
wait policies (microtensor sets its own default only when the variable is unset).
The loops:

    mlp-small  MLP 32->64->64->1, batch 64, Adam
    mlp-wide   MLP 32->512->512->1, batch 64, Adam
    gpt-tiny   GPT 2 layers, 64 wide, T=32, batch 16, AdamW (bench_train's tiny)
    gpt-cpu    GPT 4 layers, 128 wide, T=64, batch 12, AdamW (bench_train's cpu)
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = ("mlp-small", "mlp-wide", "gpt-tiny", "gpt-cpu")
# (steps timed, warmup) per loop: one to two seconds each at one thread on a 2-core
# machine (a tenth of a second, as mlp-small had, measured where the scheduler put the
# fresh process more than the loop: medians 0.24-0.33 ms for the same step)
STEPS = {"mlp-small": (4000, 200), "mlp-wide": (500, 20), "gpt-tiny": (150, 5),
         "gpt-cpu": (25, 3)}


def _mlp_step(width):
    import numpy as np
    import microtensor as mt
    mt.manual_seed(0)
    model = mt.nn.Sequential(mt.nn.Linear(32, width), mt.nn.ReLU(), mt.nn.Linear(width, width),
                             mt.nn.ReLU(), mt.nn.Linear(width, 1))
    opt = mt.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = mt.tensor(rng.standard_normal((64, 32)).astype(np.float32))
    y = mt.tensor(rng.standard_normal((64, 1)).astype(np.float32))

    def step():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _gpt_step(config):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_train
    import _common as C
    cfg = C.CONFIGS[config]
    data, vocab_size = bench_train.encode_corpus(C.load_text()[0])
    (x, y), = bench_train.make_batches(data, 1, cfg["batch_size"], cfg["block_size"], seed=0)
    _, step = bench_train.build_mt(cfg, vocab_size, seed=0)
    return lambda: step(x, y)


def child(loop, threads):
    """Time one loop in this process; print one JSON line."""
    import microtensor as mt
    if threads is not None:
        mt.set_num_threads(threads)
    step = {"mlp-small": lambda: _mlp_step(64), "mlp-wide": lambda: _mlp_step(512),
            "gpt-tiny": lambda: _gpt_step("tiny"), "gpt-cpu": lambda: _gpt_step("cpu")}[loop]()
    n, warmup = STEPS[loop]
    for _ in range(warmup):
        step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"loop": loop, "threads": mt.get_num_threads(),
                      "ms_median": 1e3 * times[len(times) // 2]}))


def run_child(loop, threads, env):
    argv = [sys.executable, os.path.abspath(__file__), "--child", loop]
    if threads is not None:
        argv += ["--child-threads", str(threads)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated: " + ", ".join(LOOPS))
    p.add_argument("--busy", type=int, default=0, help="spinning processes beside the loops")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--rounds", type=int, default=1, help="default/1-thread pairs per loop")
    p.add_argument("--json", action="store_true", help="one JSON line of all results at the end")
    p.add_argument("--child", choices=LOOPS, help=argparse.SUPPRESS)
    p.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.child_threads)
    env = dict(os.environ)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    from microtensor.buildinfo import cpu_model
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    results = []
    try:
        time.sleep(0.5 if busy else 0)
        load_before = os.getloadavg()
        print(f"# {cpu_model()}; {args.busy} busy process(es); env {args.env or 'as is'}; "
              f"load average {tuple(round(x, 2) for x in load_before)}")
        print("| loop | default | 1 thread | ratio |\n|---|---:|---:|---:|")
        for loop in args.loops.split(","):
            d, o = [], []
            for r in range(args.rounds):
                # NOTE: the order alternates: a child that follows the other kind's child
                # was measurably slower (0.36 against 0.25 ms, mlp-small, one busy
                # process), a bias that always hit the default when it ran first
                for threads in ((None, 1) if r % 2 == 0 else (1, None)):
                    (d if threads is None else o).append(run_child(loop, threads, env))
            md = sorted(r["ms_median"] for r in d)[len(d) // 2]
            mo = sorted(r["ms_median"] for r in o)[len(o) // 2]
            results.append({"loop": loop, "default_threads": d[0]["threads"],
                            "default_ms": md, "one_thread_ms": mo})
            print(f"| {loop} ({d[0]['threads']} threads) | {md:.2f} ms | {mo:.2f} ms | "
                  f"{md / mo:.2f} |", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"# load average after {tuple(round(x, 2) for x in os.getloadavg())}")
    if args.json:
        print(json.dumps({"busy": args.busy, "env": args.env, "load_before": load_before,
                          "results": results}))


if __name__ == "__main__":
    main()
