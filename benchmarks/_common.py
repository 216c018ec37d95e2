"""Helpers shared by the benchmark scripts: threads, timing, statistics, tables,
machine description, the corpus, and peak-RSS measurement in child processes.

Timing rules used everywhere:
  * every number is a median over several repetitions;
  * engines are measured in alternation (A B A B ...) in one process, so a burst of
    load from another process on this shared machine hits both rather than one;
  * each repetition runs the callable `number` times and divides, with `number`
    calibrated so a repetition lasts long enough for the clock to be meaningful.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the corpus of the benchmarks: shared/ sits beside the repository
DEFAULT_DATA = os.path.normpath(os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt"))


# ---- optional torch ------------------------------------------------------------

def try_import_torch():
    """torch, or None when it is not installed (every script then runs microtensor
    and numpy alone)."""
    try:
        import torch
        return torch
    except ImportError:
        return None


# ---- threads ---------------------------------------------------------------------

def setup_threads(n, torch=None, scipy_blas_threads=None):
    """Give every engine the same thread budget: microtensor's kernels and matmuls
    (one OpenMP pool, mt.set_num_threads), numpy's BLAS (numpy's own `@`, the numpy
    column of bench_ops / bench_matmul), and torch's intra-op pool.

    NOTE: scipy's OpenBLAS is left alone: microtensor calls its gemm from inside its
    own threads and pins it to one thread. `scipy_blas_threads` overrides that, for
    experiments only."""
    import microtensor as mt
    from microtensor.threads import set_blas_threads
    mt.set_num_threads(n)
    set_blas_threads(n, library="numpy")
    if scipy_blas_threads is not None:
        set_blas_threads(scipy_blas_threads, library="scipy.libs")
    if torch is not None:
        torch.set_num_threads(n)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # can only be set before torch's first parallel work
            pass


def available_cpus():
    """The logical CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


# ---- timing ----------------------------------------------------------------------

def _helper_threads_cpu_ns():
    """CPU time (ns) used so far by each thread of this process but the calling one."""
    me = str(threading.get_native_id())
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            if tid == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    out[tid] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    return out


def quiesce(window=0.02, max_wait=0.5):
    """Wait until no helper thread of this process is burning CPU.

    NOTE: after a call, OpenBLAS's worker threads busy-wait for ~0.1 s (2^28 cycles,
    OPENBLAS_THREAD_TIMEOUT) before they sleep, and OpenMP workers spin briefly too.
    On 2 cores, a spinning pool left by one engine slows the next engine several
    fold, which would bias any side-by-side comparison. So before each timed
    repetition we wait (at most `max_wait`) until, over a `window`, the other
    threads used under 10% of it (the kernel updates those counters every ~4 ms, hence
    the 20 ms window). Inside a repetition nothing is changed: an engine
    that mixes its own thread pools pays for their contention, as it would in use.
    Returns the seconds waited.
    """
    t0 = time.perf_counter()
    while True:
        before = _helper_threads_cpu_ns()
        time.sleep(window)
        after = _helper_threads_cpu_ns()
        busy = sum(after[k] - before.get(k, 0) for k in after) * 1e-9
        waited = time.perf_counter() - t0
        if busy < 0.1 * window or waited >= max_wait:
            return waited


def calibrate(fn, min_time=0.02, max_number=100000):
    """How many calls of fn make one repetition last at least `min_time` seconds."""
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time or number >= max_number:
            return number
        # aim a bit past min_time so the next try usually succeeds
        number = min(max_number, max(number * 2, int(number * 1.2 * min_time / max(dt, 1e-9))))


def time_once(fn, number):
    """Seconds per call of fn over `number` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def alternate(fns, repeats=7, min_time=0.02, warmup=2, settle=True):
    """Time several callables side by side: {name: [seconds per call] * repeats}.

    `fns` maps an engine name to a zero-argument callable. Each engine is warmed up
    and calibrated, then the repetitions run in rounds A B C A B C ... , each after
    quiesce() (see there) when `settle`.
    """
    numbers = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        numbers[name] = calibrate(fn, min_time)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if settle:
                quiesce()
            times[name].append(time_once(fn, numbers[name]))
    return times


def median(xs):
    return statistics.median(xs)


def quartiles(xs):
    """(q1, median, q3); with fewer than 4 samples q1/q3 are the min and max."""
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0], statistics.median(xs), xs[-1]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def summary(xs):
    """A dict of robust statistics of a list of times (seconds)."""
    q1, med, q3 = quartiles(xs)
    return {"median": med, "q1": q1, "q3": q3, "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_time(s):
    """A time in the unit that reads best (ns, us, ms, s)."""
    if s is None:
        return "n/a"
    if s < 1e-6:
        return f"{s * 1e9:.0f} ns"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def fmt_ratio(a, b):
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}"


# ---- tables ----------------------------------------------------------------------

def table(headers, rows):
    """A plain text table (also valid Markdown) with right-aligned number columns."""
    rows = [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def emit_json(obj, dest):
    """Write one JSON line to stdout ('-') or append it to a file."""
    text = json.dumps(obj, sort_keys=True)
    if dest in (None, "-"):
        print(text)
    else:
        with open(dest, "a") as f:
            f.write(text + "\n")


# ---- the machine -----------------------------------------------------------------

def machine_info(threads, torch=None):
    """What the numbers were measured on: CPU model, cores, library versions, the
    BLAS kernel in use, and the environment variables that change it."""
    import numpy as np
    from microtensor.threads import blas_info
    cpu = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    blas = blas_info()
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "blas_corename": blas[0]["corename"] if blas else None,
        "blas_config": blas[0]["config"] if blas else None,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "cpus_available": len(available_cpus()),
    }
    # the OpenMP settings that change how a waiting thread behaves
    for var in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DYNAMIC"):
        if os.environ.get(var) is not None:
            info[var] = os.environ[var]
    try:
        from microtensor.threads import physical_cores
        info["physical_cores"] = physical_cores()
    except ImportError:
        pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    # the kernel build and every BLAS loaded, as mt.show_config() prints them
    from microtensor import buildinfo as mt_config
    c = mt_config.config()
    info["kernel_build"] = c["build"]
    info["blas"] = c["blas"]
    info["gemm"] = c["gemm"]
    info["openmp_wait"] = c["openmp_wait"]
    info["config_lines"] = mt_config.format_config(c)
    return info


def print_machine(info):
    omp = "".join(f" {v}={info[v]};" for v in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                 "GOMP_SPINCOUNT", "OMP_DYNAMIC") if v in info)
    print(f"# machine: {info['cpu']}, {info['cores']} logical CPUs "
          f"({info.get('physical_cores', '?')} physical cores, {info['cpus_available']} "
          f"available); threads={info['threads']};{omp} "
          f"numpy {info['numpy']} (BLAS kernel {info['blas_corename']}); "
          f"torch {info['torch'] or 'not installed'}; "
          f"OPENBLAS_CORETYPE={info['OPENBLAS_CORETYPE']} OPENBLAS_L2_SIZE={info['OPENBLAS_L2_SIZE']}; "
          f"load average {tuple(round(x, 2) for x in info.get('loadavg', ()))}")
    # CPU, kernel build, BLAS, threads, OpenMP waiting: mt.show_config()'s lines
    for line in info.get("config_lines", ())[1:]:
        print("#" + line[1:])


# A timing table for the docs is taken on a quiet machine: above this 1-minute load
# average at the start a benchmark refuses to time (earlier tables, taken at loads of
# 3-5 on 2 cores, came out 1.3-3x slow), unless told it is a dry run.
QUIET_LOAD = 0.3


def add_load_flags(parser, strict_note=""):
    """--allow-busy and --strict-quiet, as every benchmark that warns on a busy machine
    reads them (check_quiet(args.allow_busy, prog, strict=args.strict_quiet))."""
    parser.add_argument("--allow-busy", action="store_true",
                        help=f"time without a warning when the 1-minute load average is above "
                             f"{QUIET_LOAD} (a dry run: its tables are not for the docs)")
    parser.add_argument("--strict-quiet", action="store_true",
                        help=f"refuse to start (exit status 2) when the 1-minute load average "
                             f"is above {QUIET_LOAD}: for tables meant for the docs" + strict_note)


def check_quiet(allow_busy, prog, strict=True):
    """The 1-minute load average (None where the system has none), checked against
    QUIET_LOAD. Above it: with allow_busy, say that the tables are a dry run, not for
    the docs; without it, exit with status 2 when `strict` (what a table for the docs
    needs), else warn on stderr and carry on as a dry run (what a user trying the
    benchmark wants)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if load > QUIET_LOAD:
        if not allow_busy and strict:
            print(f"{prog}: error: the 1-minute load average is {load:.2f}, above "
                  f"{QUIET_LOAD}: timings taken now are not fit for the docs. Wait for a quiet "
                  "machine (run nothing else), or pass --allow-busy for a dry run.",
                  file=sys.stderr)
            raise SystemExit(2)
        if not allow_busy:
            print(f"{prog}: warning: the 1-minute load average is {load:.2f}, above "
                  f"{QUIET_LOAD}: other work shares the CPUs, so these timings come out slow "
                  "and are marked DRY RUN, not fit for the docs (--strict-quiet refuses "
                  "to time instead)", file=sys.stderr, flush=True)
        print(f"# DRY RUN: load average {load:.2f} at the start (above {QUIET_LOAD}): "
              "these timings are not for the docs")
    return load


def print_load_after():
    try:
        load = os.getloadavg()
    except (AttributeError, OSError):
        return None
    print(f"# load average after: {tuple(round(x, 2) for x in load)}")
    return load


# ---- data ------------------------------------------------------------------------

def load_text(path=None):
    """The training corpus: `path`, else tinyshakespeare when present, else Python's
    own documentation text (always installed)."""
    if path is None and os.path.exists(DEFAULT_DATA):
        path = DEFAULT_DATA
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    from pydoc_data.topics import topics
    return "".join(topics.values()), "pydoc_data.topics"


# ---- peak memory -----------------------------------------------------------------

def run_child_peak_rss(argv, env=None):
    """Run a Python child process; return (peak RSS in bytes, its stdout).

    The peak is the kernel's ru_maxrss of that one child, read with wait4, so it
    covers the whole process (interpreter, libraries, data) and nothing else.
    """
    import tempfile
    with tempfile.TemporaryFile(mode="w+") as errf:
        # NOTE: stderr goes to a file, not a second pipe: reading two pipes one after
        # the other can deadlock, and communicate() would reap the child before wait4.
        proc = subprocess.Popen([sys.executable] + list(argv), stdout=subprocess.PIPE,
                                stderr=errf, env=env, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        errf.seek(0)
        err = errf.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} failed ({proc.returncode}):\n{err[-3000:]}")
    return usage.ru_maxrss * 1024, out  # Linux reports kilobytes


def current_rss():
    """This process's resident memory now, in bytes (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


# ---- the model configs and their matmul FLOPs ----------------------------------------

CONFIGS = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=16),
    "cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12),
    "mid": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=12),
}


def matmul_shapes(cfg, vocab_size):
    """Every matrix product of one training step (forward and backward) of the GPT.

    Each entry: name, count (times per step), batch (None for a 2-D product), m, k, n
    (the product is (m, k) @ (k, n)), and ta / tb: whether that operand is stored
    transposed, as it is in the step (a Linear's weight is (out, in), so forward is
    x @ W^T; dW = g^T @ x reads g transposed).

    Linear (in K, out N) on M = B*T rows:  forward y = x W^T      2*M*K*N
                                           backward dx = g W      2*M*N*K
                                                    dW = g^T x    2*N*M*K
    Attention per layer on B*nh heads:     forward S = q k^T, Y = P v      2 * 2*T*T*hs
                                           backward dP = dY v^T, dv = P^T dY,
                                                    dq = dS k,  dk = dS^T q  4 * 2*T*T*hs
    The causal mask does not shrink the products (the full T x T is computed).
    """
    B, T, C = cfg["batch_size"], cfg["block_size"], cfg["n_embd"]
    L, nh = cfg["n_layer"], cfg["n_head"]
    M, hs, V = B * T, C // nh, vocab_size
    shapes = []

    def linear(name, K, N, count):
        shapes.extend([
            dict(name=f"{name} fwd x@W^T", count=count, batch=None, m=M, k=K, n=N, ta=False, tb=True),
            dict(name=f"{name} bwd dx=g@W", count=count, batch=None, m=M, k=N, n=K, ta=False, tb=False),
            dict(name=f"{name} bwd dW=g^T@x", count=count, batch=None, m=N, k=M, n=K, ta=True, tb=False),
        ])
    linear("attn.c_attn", C, 3 * C, L)
    linear("attn.c_proj", C, C, L)
    linear("mlp.c_fc", C, 4 * C, L)
    linear("mlp.c_proj", 4 * C, C, L)
    linear("lm_head", C, V, 1)
    bh = B * nh
    shapes.extend([
        dict(name="attn fwd q@k^T", count=L, batch=bh, m=T, k=hs, n=T, ta=False, tb=True),
        dict(name="attn fwd P@v", count=L, batch=bh, m=T, k=T, n=hs, ta=False, tb=False),
        dict(name="attn bwd dP=dY@v^T", count=L, batch=bh, m=T, k=hs, n=T, ta=False, tb=True),
        dict(name="attn bwd dv=P^T@dY", count=L, batch=bh, m=T, k=T, n=hs, ta=True, tb=False),
        dict(name="attn bwd dq=dS@k", count=L, batch=bh, m=T, k=T, n=hs, ta=False, tb=False),
        dict(name="attn bwd dk=dS^T@q", count=L, batch=bh, m=T, k=T, n=hs, ta=True, tb=False),
    ])
    return shapes


def shape_flops(s):
    return 2 * (s["batch"] or 1) * s["m"] * s["k"] * s["n"]


def step_flops(cfg, vocab_size):
    """Matmul FLOPs of one training step, forward + backward:
    3 * (n_layer * (24*M*C^2 + 4*B*T^2*C) + 2*M*C*V) with M = B*T."""
    return sum(shape_flops(s) * s["count"] for s in matmul_shapes(cfg, vocab_size))
