"""What a process does around microtensor: fork after a parallel kernel, the MICROTENSOR_*
variables, and the profiler's wrappers standing in for the functions they wrap."""
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _blas
from microtensor.profiler import Profiler
from microtensor.runtime import _variables


def python(code, env_extra=None, timeout=120):
    """Run code in a fresh interpreter that imports this microtensor."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=timeout)


# ---- fork ---------------------------------------------------------------------------------

# Every family of parallel kernel, at sizes far above their thresholds (so that the parent
# really runs a region with two threads) and odd (so the split is uneven); the child runs
# them all again and must give the parent's bits.
FORK = r"""
import os, sys, numpy as np, microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _blas
mt.set_num_threads(2)
mt.manual_seed(0)
x = mt.randn(1 << 20 | 3)
a = mt.randn(515, 517)
q, k, v = (mt.randn(3, 4, 257, 64) for _ in range(3))
rows = mt.randn(4099, 515)
target = mt.randint(0, 515, (4099,))
def run():
    return [F.gelu(x), a @ a.T, F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.layer_norm(rows, (515,)), F.cross_entropy(rows, target), F.softmax(rows, -1)]
{parent}
want = [t.numpy().copy() for t in run()]
pid = os.fork()
if pid == 0:
    try:
        got = [t.numpy() for t in run()]
        same = all(np.array_equal(g, w) for g, w in zip(got, want))
        print("CHILD", same, _blas.forked_child_runs_alone(), mt.get_num_threads(), flush=True)
    finally:
        os._exit(0)
_, status = os.waitpid(pid, 0)
print("PARENT", status)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.parametrize("before_fork", ["parallel", "serial"])
def test_a_forked_child_runs_its_kernels_and_never_hangs(before_fork):
    # "parallel": the parent ran regions with two threads (the adaptive team off, so that a
    # busy machine cannot shrink it to one), so libgomp's worker threads exist there and
    # not in the child, whose first two-thread region used to wait for them forever.
    # "serial": the parent never went parallel, and the child keeps its threads.
    parent = "" if before_fork == "parallel" else "_blas.set_team(limit=1)"
    code = FORK.replace("{parent}", parent)
    if before_fork == "serial":
        code = code.replace("pid = os.fork()", "_blas.set_team(limit=0)\npid = os.fork()")
    try:
        r = python(code, {"MICROTENSOR_ADAPTIVE_THREADS": "0"}, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked child hung in its first parallel kernel")
    assert r.returncode == 0, r.stderr
    child = next(line for line in r.stdout.splitlines() if line.startswith("CHILD")).split()
    assert child[1] == "True", "the child's kernels gave other numbers than the parent's"
    assert child[2] == ("True" if before_fork == "parallel" else "False"), child
    assert child[3] == "2", "the child keeps the configured split"
    assert "PARENT 0" in r.stdout


# ---- MICROTENSOR_* variables --------------------------------------------------------------

@pytest.mark.parametrize("value,adaptive", [
    ("0", 0), ("off", 0), ("OFF", 0), ("false", 0), ("no", 0), (" No ", 0),
    ("1", 1), ("on", 1), ("true", 1), ("yes", 1), ("auto", 1), ("", 1),
])
def test_adaptive_threads_reads_every_spelling_of_on_and_off(value, adaptive):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _blas._adaptive_setting({"MICROTENSOR_ADAPTIVE_THREADS": value}) == adaptive


@pytest.mark.parametrize("value", ["2", "offf", "disable", "-1"])
def test_adaptive_threads_warns_on_a_value_it_does_not_know(value):
    with pytest.warns(RuntimeWarning, match=f"MICROTENSOR_ADAPTIVE_THREADS={value!r}"):
        assert _blas._adaptive_setting({"MICROTENSOR_ADAPTIVE_THREADS": value}) == 1


def test_adaptive_threads_off_reaches_the_team():
    r = python("from microtensor.kernels import _blas; print(_blas.team_info()['adaptive'])",
               {"MICROTENSOR_ADAPTIVE_THREADS": "off"})
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr
    r = python("from microtensor.kernels import _blas; print(_blas.team_info()['adaptive'])",
               {"MICROTENSOR_ADAPTIVE_THREADS": "sometimes"})
    assert r.stdout.split() == ["True"] and "MICROTENSOR_ADAPTIVE_THREADS='sometimes'" in r.stderr


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("no", False),
                                      ("false", False), ("1", True), ("on", True)])
def test_omp_defaults_reads_every_spelling(value, on):
    from microtensor.runtime import _omp_env
    chosen = _omp_env.apply_defaults({"MICROTENSOR_OMP_DEFAULTS": value})
    assert bool(chosen) == on, chosen


def test_omp_defaults_warns_on_a_value_it_does_not_know():
    from microtensor.runtime import _omp_env
    with pytest.warns(RuntimeWarning, match="MICROTENSOR_OMP_DEFAULTS='maybe'"):
        assert _omp_env.apply_defaults({"MICROTENSOR_OMP_DEFAULTS": "maybe"})


# each variable with a value set, one at a time: a value it knows is silent, one it does
# not know warns and names the variable (MICROTENSOR_DIST_TIMEOUT raises where it is read)
KNOWN_AND_BAD = {
    "MICROTENSOR_KERNELS": ("baseline", "avx3"),
    "MICROTENSOR_BLAS": ("openblas", "atlas"),
    "MICROTENSOR_MALLOC": ("default", "jemalloc"),
    "MICROTENSOR_OMP_DEFAULTS": ("off", "sometimes"),
    "MICROTENSOR_ADAPTIVE_THREADS": ("no", "sometimes"),
}


@pytest.mark.parametrize("name", sorted(KNOWN_AND_BAD))
def test_every_runtime_variable_warns_on_a_value_it_does_not_know(name):
    good, bad = KNOWN_AND_BAD[name]
    code = "import warnings; warnings.simplefilter('always'); import microtensor"
    r = python(code, {name: good})
    assert r.returncode == 0 and name not in r.stderr, r.stderr
    r = python(code, {name: bad})
    assert r.returncode == 0, r.stderr
    assert f"{name}={bad!r}" in r.stderr and "RuntimeWarning" in r.stderr, r.stderr


def test_a_variable_microtensor_does_not_read_warns_with_the_nearest_name():
    with pytest.warns(RuntimeWarning, match="did you mean MICROTENSOR_KERNELS"):
        assert _variables.check_names({"MICROTENSOR_KERNEL": "avx2"}) == ["MICROTENSOR_KERNEL"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _variables.check_names({name: "1" for name in _variables.VARIABLES}) == []
        assert _variables.check_names({"PATH": "/bin", "OMP_NUM_THREADS": "2"}) == []
    r = python("import microtensor", {"MICROTENSOR_ADAPTIVE_THREAD": "0"})
    assert "MICROTENSOR_ADAPTIVE_THREAD is set but microtensor reads no such variable" in r.stderr


def test_every_variable_the_sources_read_is_known():
    # a new variable read somewhere must join the list, or setting it would warn
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))
    seen = set()
    for top in ("microtensor", "setup.py", "tests/_browser.py"):
        path = os.path.join(root, top)
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
            if f.endswith((".py", ".pyx", ".pxi"))]
        for f in files:
            if not os.path.exists(f):
                continue
            seen |= set(re.findall(r"MICROTENSOR_[A-Z0-9_]*[A-Z0-9]", open(f).read()))
    assert seen, "no variable found: the walk is broken"
    assert seen <= set(_variables.VARIABLES), sorted(seen - set(_variables.VARIABLES))


# ---- the profiler's wrappers ---------------------------------------------------------------

def test_profiler_wrappers_pass_for_the_functions_they_wrap():
    functions = {"F.linear": lambda: F.linear, "F.gelu": lambda: F.gelu,
                 "F.cross_entropy": lambda: F.cross_entropy, "mt.exp": lambda: mt.exp,
                 "mt.cumsum": lambda: mt.cumsum, "linalg.norm": lambda: mt.linalg.norm}
    originals = {k: get() for k, get in functions.items()}
    with Profiler():
        for name, get in functions.items():
            wrapper, original = get(), originals[name]
            assert wrapper is not original, f"{name} was not wrapped: the test proves nothing"
            assert wrapper.__wrapped__ is original
            for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
                assert getattr(wrapper, attr) == getattr(original, attr), (name, attr)
            # pickle stores a function by reference (module + qualified name)
            assert pickle.loads(pickle.dumps(wrapper)) is wrapper, name
        y = F.linear(mt.randn(3, 4), mt.randn(2, 4))       # and the wrapper still runs
        assert y.shape == (3, 2)
    for name, get in functions.items():
        assert get() is originals[name]
        assert pickle.loads(pickle.dumps(get())) is originals[name]


def test_the_recorders_wrappers_pass_for_the_functions_they_wrap_too():
    # mt.compile's recording wraps the same ops the same way (capture/recorder.py)
    from microtensor.capture import recorder
    from microtensor.ops import _intercept
    original = F.linear
    undo = _intercept.patch_ops(recorder._dispatch, skip=("set_grad_enabled_",))
    try:
        wrapper = F.linear
        assert wrapper is not original and wrapper.__wrapped__ is original
        for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
            assert getattr(wrapper, attr) == getattr(original, attr), attr
        assert pickle.loads(pickle.dumps(wrapper)) is wrapper
    finally:
        _intercept.unpatch(undo)
    assert F.linear is original
