"""OpenMP's waiting policy, chosen before the OpenMP runtime starts.

The OpenMP runtime (GNU libgomp, linked by every extension of microtensor) reads its
environment once, when the first extension is loaded; after that no setting of it can
change. So microtensor/__init__.py imports this module first, before any extension.

What a thread does between two parallel regions is the question. libgomp's default lets
an idle worker spin for a while (GOMP_SPINCOUNT, 300,000 iterations, about a
millisecond) before it sleeps, so that the next region starts without a wake-up. On a
machine whose other cores are busy (a browser, a second experiment), that spinning
thread holds a core someone else wants, and when the OS has given the core to someone
else every region waits for the thread's turn: a small training step, which enters
hundreds of regions, ran 300x slower at 2 threads than at 1 (issue 23's table).

microtensor sets OMP_WAIT_POLICY=PASSIVE: a worker that has nothing to do sleeps at once
and is woken for the next region (a futex wake, a few microseconds, which the kernel
grants at once to a thread that slept). The measurement behind the choice is in
docs/TRAINING.md ("Threads on a busy machine") and its command is
`python benchmarks/bench_busy.py --busy 1 --env OMP_WAIT_POLICY=...`.

A variable the user has set is left alone: an explicit OMP_WAIT_POLICY or
GOMP_SPINCOUNT (which overrides the policy's spin count in libgomp) wins, and then
microtensor sets neither. MICROTENSOR_OMP_DEFAULTS=0 turns the whole thing off.
"""
import os

# name -> the value microtensor sets when the user has set none of these variables
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# the variables that decide the same thing: when any is set, microtensor sets nothing
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# name -> "microtensor" or "user", filled in by apply_defaults()
SOURCES = {}


def apply_defaults(environ=None):
    """Set OMP_DEFAULTS in `environ` (default os.environ) unless the user has set any of
    the waiting variables. Returns {name: 'microtensor' | 'user'} for each variable."""
    env = os.environ if environ is None else environ
    sources = {name: "user" for name in _WAIT_VARIABLES if name in env}
    if not sources and env.get("MICROTENSOR_OMP_DEFAULTS", "1") not in ("0", ""):
        for name, value in OMP_DEFAULTS.items():
            env[name] = value
            sources[name] = "microtensor"
    if environ is None:
        SOURCES.clear()
        SOURCES.update(sources)
    return sources


def settings():
    """{name: {'value': ..., 'source': 'microtensor' | 'user' | 'runtime default'}} for
    the variables that decide how OpenMP threads wait."""
    out = {}
    for name in _WAIT_VARIABLES + ("OMP_DYNAMIC",):
        value = os.environ.get(name)
        if value is None:
            out[name] = {"value": "unset", "source": "runtime default"}
        else:
            out[name] = {"value": value, "source": SOURCES.get(name, "user")}
    return out
