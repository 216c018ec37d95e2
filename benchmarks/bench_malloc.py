"""Page faults and step time of microtensor's training step with glibc's malloc as
microtensor tunes it at import (microtensor/runtime/_malloc.py) and with glibc's defaults.

One process, rounds alternating the two settings (mallopt can be called at any time):
each round runs --steps steps of the GPT's eager training step at one thread and reads
the process's minor page faults (getrusage). Medians of --rounds.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_malloc.py --config tiny,cpu
"""
import argparse
import ctypes
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_train as bt  # noqa: E402

import numpy as np  # noqa: E402

GLIBC_DEFAULT = 128 << 10


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny,cpu")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--allow-busy", action="store_true",
                   help="time even when the 1-minute load average is above 0.3 (a dry run)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = p.parse_args(argv)

    C.check_quiet(args.allow_busy, "bench_malloc.py")
    from microtensor.runtime import _malloc
    libc = _malloc._glibc()
    if libc is None:
        sys.exit("bench_malloc.py: glibc's mallopt is not available here")
    C.setup_threads(1, None)
    info = C.machine_info(1, None)
    C.print_machine(info)
    settings = {
        "glibc default": (GLIBC_DEFAULT, GLIBC_DEFAULT),
        "microtensor": (_malloc.MMAP_THRESHOLD, _malloc.TRIM_THRESHOLD),
    }
    rows, record = [], {"bench": "malloc", "machine": info, "configs": {}}
    rng = np.random.default_rng(0)
    data = rng.integers(0, 65, 200_000)
    for name in args.config.split(","):
        cfg = C.CONFIGS[name]
        _, step = bt.build_mt(cfg, 65, 0)
        batches = bt.make_batches(data, args.steps, cfg["batch_size"], cfg["block_size"], 0)
        for x, y in batches[:3]:
            step(x, y)
        res = {k: [] for k in settings}
        for _ in range(args.rounds):
            for label, (mmap, trim) in settings.items():
                libc.mallopt(_malloc.M_MMAP_THRESHOLD, mmap)
                libc.mallopt(_malloc.M_TRIM_THRESHOLD, trim)
                libc.malloc_trim(0)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                for x, y in batches:
                    step(x, y)
                dt = (time.perf_counter() - t0) / len(batches)
                res[label].append(((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                                   / len(batches), dt))
        med = {k: (C.median([a for a, _ in v]), C.median([b for _, b in v]) * 1e3)
               for k, v in res.items()}
        rows.append([name] + [f"{med[k][0]:,.0f}" for k in settings] +
                    [f"{med[k][1]:.1f}" for k in settings])
        record["configs"][name] = {k: {"faults_per_step": f, "ms_per_step": ms}
                                   for k, (f, ms) in med.items()}
    libc.mallopt(_malloc.M_MMAP_THRESHOLD, _malloc.MMAP_THRESHOLD)
    libc.mallopt(_malloc.M_TRIM_THRESHOLD, _malloc.TRIM_THRESHOLD)
    print(f"\n## eager training step, 1 thread: minor page faults and ms per step (median of "
          f"{args.rounds} rounds of {args.steps} steps)\n")
    print(C.table(["config"] + [f"faults, {k}" for k in settings] + [f"ms, {k}" for k in settings],
                  rows))
    if args.json is not None:
        C.emit_json(record, args.json)
    return record


if __name__ == "__main__":
    main()
