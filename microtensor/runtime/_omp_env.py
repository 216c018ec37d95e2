"""OpenMP's waiting policy, chosen before the OpenMP runtime starts.

The OpenMP runtime (GNU libgomp, linked by every extension of microtensor) reads its
environment once, when the first extension is loaded; after that no setting of it can
change. So microtensor/__init__.py imports this module first, before any extension.

What a thread does between two parallel regions is the question. libgomp's default lets
an idle worker spin for a while (GOMP_SPINCOUNT, 300,000 iterations, a millisecond or
more) before it sleeps, so that the next region starts without a wake-up. On a machine
whose other cores are busy (a browser, a second experiment), that spinning thread holds a
core someone else wants, and when the OS has given the core to someone else every region
waits for the thread's turn: a small training step, which enters hundreds of regions, ran
300x slower at 2 threads than at 1 (issue 23's table). Sleeping at once
(OMP_WAIT_POLICY=PASSIVE, the earlier default) fixed that, but on a quiet virtual machine
waking a sleeping worker can cost 100 us (its virtual CPU has to be woken by the host): a
GELU of 2^15 elements took 18 us on one thread and 114 us on two, and a tiny GPT step
was 1.65x slower on two threads than on one (docs/BENCHMARKS.md, "Waiting threads").

microtensor asks for GOMP_SPINCOUNT=10000: an idle worker spins briefly (long enough to
cover the gap between two kernels of a step, tens to hundreds of microseconds), then
sleeps. A busy machine is handled by the team (kernels/_common.pxd: while other processes
hold the cores, kernels run on one thread and open no region, so nothing spins): with a
spinning process beside it, the 2-thread step stays level with the 1-thread step. The
commands are `python benchmarks/bench_busy.py` and `... --busy 1`, with `--env
GOMP_SPINCOUNT=...` or `--env OMP_WAIT_POLICY=PASSIVE` to compare.

For this process only: the user's environment is left as it was. The variable is put in
os.environ, the OpenMP runtime the extensions link (libgomp.so.1, found in the core's
list of libraries) is loaded, which reads it as it starts, and the variable is taken out
again, so a subprocess the user starts sees the environment they gave. When that runtime
was already started by another library, or the extensions link another OpenMP runtime
(or none), nothing is set, and `settings()` says so.

A variable the user has set is left alone: an explicit OMP_WAIT_POLICY or
GOMP_SPINCOUNT (which overrides the policy's spin count in libgomp) wins, and then
microtensor sets neither. MICROTENSOR_OMP_DEFAULTS=0 (off, false, no, or empty) turns the
whole thing off; a value it does not know warns and leaves it on.
"""
import ctypes
import mmap
import os
import sys

from microtensor.runtime._variables import switch

# name -> the value microtensor sets when the user has set none of these variables
OMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
# the variables that decide the same thing: when any is set, microtensor sets nothing
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
RUNTIME = "libgomp.so.1"

# name -> "microtensor" or "user", filled in by apply_defaults()
SOURCES = {}
APPLIED = {}        # name -> value the runtime was started with by microtensor
STATE = {"runtime": None, "reason": "not applied yet"}
_runtime = []       # the runtime, loaded (kept for the life of the process)


def _links_libgomp():
    """Does microtensor's core link libgomp (GNU's OpenMP runtime)? Read from the
    extension's file without loading it."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("microtensor.core._core")
        with open(spec.origin, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(RUNTIME.encode()) >= 0
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        return False


def _loaded_already():
    """Is a libgomp in this process already (started by another library, too late for its
    environment)? threadpoolctl lists the OpenMP and BLAS libraries loaded."""
    from threadpoolctl import threadpool_info
    return any(lib.get("prefix") == "libgomp" for lib in threadpool_info())


def apply_defaults(environ=None):
    """Start OpenMP's runtime with OMP_DEFAULTS unless the user has set any of the
    waiting variables. With a dict `environ`, only say what would be set (and set it in
    that dict). Returns {name: 'microtensor' | 'user'} for each variable."""
    env = os.environ if environ is None else environ
    sources = {name: "user" for name in _WAIT_VARIABLES if name in env}
    chosen = {}
    # NOTE: set but empty turns the defaults off, as it always has; unset means on
    if (not sources and env.get("MICROTENSOR_OMP_DEFAULTS") != ""
            and switch(env, "MICROTENSOR_OMP_DEFAULTS")):
        chosen = dict(OMP_DEFAULTS)
    if environ is not None:
        environ.update(chosen)
        return dict(sources, **{name: "microtensor" for name in chosen})
    if not chosen:
        reason = "set by the user" if sources else "MICROTENSOR_OMP_DEFAULTS=off"
    elif not sys.platform.startswith("linux") or not _links_libgomp():
        chosen, reason = {}, "the extensions do not link libgomp"
    elif _loaded_already():
        chosen, reason = {}, "libgomp was started by another library before microtensor"
    else:
        reason = None
        try:
            os.environ.update(chosen)
            _runtime.append(ctypes.CDLL(RUNTIME))      # its constructor reads the variables
        except OSError as e:
            chosen, reason = {}, f"libgomp did not load ({e})"
        finally:
            for name in OMP_DEFAULTS:                  # none was set by the user
                os.environ.pop(name, None)
    SOURCES.clear()
    SOURCES.update(sources)
    SOURCES.update({name: "microtensor" for name in chosen})
    APPLIED.clear()
    APPLIED.update(chosen)
    STATE.update(runtime=RUNTIME if chosen else None,
                 reason=reason or "libgomp started with these settings, for this process only")
    return dict(SOURCES)


def settings():
    """{name: {'value': ..., 'source': 'microtensor (this process only)' | 'user' |
    'runtime default'}} for the variables that decide how OpenMP threads wait."""
    out = {}
    for name in _WAIT_VARIABLES + ("OMP_DYNAMIC",):
        value = os.environ.get(name)
        if name in APPLIED and value is None:
            out[name] = {"value": APPLIED[name], "source": "microtensor (this process only)"}
        elif value is None:
            out[name] = {"value": "unset", "source": "runtime default"}
        else:
            out[name] = {"value": value, "source": "user"}
    return out
