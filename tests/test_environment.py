"""Every environment variable microtensor reads, each value, each spelling and each rule
of precedence, in a fresh child process (the variables are read once, at import):

  MICROTENSOR_MALLOC   auto | default (off, 0); MALLOC_*_ and GLIBC_TUNABLES win
  MICROTENSOR_BLAS     auto | openblas | mkl, in any case
  MICROTENSOR_KERNELS  auto | avx512 | avx2 | baseline, in any case: never a wider build
                       than the one named
  OMP_NUM_THREADS      the kernels' thread count (lowered to the CPUs, with a warning)
  OMP_WAIT_POLICY, GOMP_SPINCOUNT, MICROTENSOR_OMP_DEFAULTS (tests/test_threads_defaults.py
                       checks what the OpenMP runtime took)

and in every case `import microtensor` leaves os.environ as it found it, so that a
process the user starts sees the user's environment."""
import json
import os
import subprocess
import sys

import pytest

import microtensor as mt
from microtensor.runtime import _blas_choice
from microtensor.runtime import _malloc
from microtensor.ops import _functional_common as C

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))
READ = ("MICROTENSOR_MALLOC", "MICROTENSOR_BLAS", "MICROTENSOR_KERNELS", "OMP_NUM_THREADS",
        "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MICROTENSOR_OMP_DEFAULTS", "GLIBC_TUNABLES",
        "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

CHILD = r"""
import json, os, subprocess, sys, warnings
before = dict(os.environ)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import microtensor as mt
    import microtensor.nn.functional as F
    from microtensor.runtime import _malloc
    from microtensor.kernels import _blas
after = dict(os.environ)
grandchild = json.loads(subprocess.run(
    [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
    capture_output=True, text=True).stdout)
print(json.dumps({
    "changed": sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)),
    "grandchild_changed": sorted(k for k in before.keys() | grandchild.keys()
                                 if before.get(k) != grandchild.get(k)),
    "malloc": _malloc.state, "blas": _blas.blas_choice(),
    "kernels": F._kernels.fused.__name__, "attention": F._kernels.attention.__name__,
    "threads": mt.get_num_threads(),
    "warnings": [str(w.message) for w in caught]}))
"""


def child(**env):
    full = {k: v for k, v in os.environ.items() if k not in READ}
    full.update(env, PYTHONPATH=PACKAGE_ROOT)
    run = subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # whatever was asked, the user's environment is as they gave it, here and in a child
    assert got["changed"] == [], got
    assert got["grandchild_changed"] == [], got
    return got


GLIBC = _malloc._glibc() is not None


# ---- MICROTENSOR_MALLOC and the user's own malloc settings ------------------------------
@pytest.mark.parametrize("value, tuned", [
    (None, True), ("auto", True), ("AUTO", True), (" Auto ", True), ("", True),
    ("default", False), ("DEFAULT", False), ("Default", False), ("off", False),
    ("OFF", False), ("0", False),
])
def test_microtensor_malloc_each_value_and_case(value, tuned):
    got = child(**({} if value is None else {"MICROTENSOR_MALLOC": value}))
    assert got["malloc"]["tuned"] is (tuned and GLIBC), got["malloc"]
    if not tuned:
        assert got["malloc"]["reason"] == "MICROTENSOR_MALLOC=default"
    assert not any("MICROTENSOR_MALLOC" in w for w in got["warnings"])


def test_an_unknown_microtensor_malloc_warns_and_means_auto():
    got = child(MICROTENSOR_MALLOC="sometimes")
    assert got["malloc"]["tuned"] is GLIBC
    assert any("MICROTENSOR_MALLOC='sometimes'" in w for w in got["warnings"]), got


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings")
@pytest.mark.parametrize("var, value", [
    ("MALLOC_MMAP_THRESHOLD_", "1048576"), ("MALLOC_TRIM_THRESHOLD_", "1048576"),
    ("MALLOC_TOP_PAD_", "1048576"), ("MALLOC_MMAP_MAX_", "65536"),
    ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576"),
])
def test_the_users_malloc_setting_wins(var, value):
    got = child(**{var: value})
    assert got["malloc"]["tuned"] is False
    assert var in got["malloc"]["reason"], got["malloc"]
    # MICROTENSOR_MALLOC=auto does not override the user's own setting
    assert child(**{var: value, "MICROTENSOR_MALLOC": "auto"})["malloc"]["tuned"] is False


def test_malloc_default_is_named_before_the_users_setting():
    got = child(MICROTENSOR_MALLOC="default", MALLOC_TOP_PAD_="0")
    assert got["malloc"] == {"tuned": False, "reason": "MICROTENSOR_MALLOC=default"}


def test_malloc_readers_in_process():
    assert _malloc.user_settings({}) == []
    assert _malloc.user_settings({"MALLOC_TOP_PAD_": "0"}) == ["MALLOC_TOP_PAD_"]
    assert _malloc.user_settings({"GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=1"}) == []
    for raw, want in [("Auto", "auto"), ("OFF", "default"), ("0", "default"), ("", "auto")]:
        assert _malloc.request({"MICROTENSOR_MALLOC": raw}) == want


# ---- MICROTENSOR_BLAS ---------------------------------------------------------------------
MKL = _blas_choice.find_mkl() is not None
INTEL = _blas_choice._cpu_vendor() == "GenuineIntel"


@pytest.mark.parametrize("value", ["openblas", "OpenBLAS", "OPENBLAS", " openblas ",
                                   "mkl", "MKL", "Mkl", "auto", "AUTO", ""])
def test_microtensor_blas_each_value_and_case(value):
    got = child(MICROTENSOR_BLAS=value)
    request = value.strip().lower() or "auto"
    assert got["blas"]["request"] == request, got["blas"]
    if request == "openblas":
        want = "openblas"
    elif request == "mkl":
        want = "mkl" if MKL else "openblas"
    else:
        want = "mkl" if MKL and INTEL else "openblas"
    assert got["blas"]["name"] == want, got["blas"]
    assert not any("is not one of" in w for w in got["warnings"]), got["warnings"]


def test_an_unknown_microtensor_blas_warns_and_means_auto():
    got = child(MICROTENSOR_BLAS="atlas")
    assert got["blas"]["request"] == "auto"
    assert any("MICROTENSOR_BLAS='atlas'" in w for w in got["warnings"])


# ---- MICROTENSOR_KERNELS --------------------------------------------------------------------
NAMES = [b[0] for b in C.KERNEL_BUILDS]
RUNS = {name: runs() for name, _, _, runs in C.KERNEL_BUILDS}


def _expected_build(request):
    """The widest build the CPU runs, no wider than the one named."""
    start = 0 if request == "auto" else NAMES.index(request)
    for name, fused, attention, _ in C.KERNEL_BUILDS[start:]:
        if RUNS[name]:
            return fused, attention
    return "_fused", "_fused_attention"


@pytest.mark.parametrize("value", ["auto", "AUTO", "", "avx512", "AVX512", "avx2", "AVX2",
                                   "Avx2", " avx2 ", "baseline", "BASELINE"])
def test_microtensor_kernels_loads_the_build_named_never_a_wider_one(value):
    got = child(MICROTENSOR_KERNELS=value)
    fused, attention = _expected_build(value.strip().lower() or "auto")
    assert got["kernels"] == "microtensor.kernels." + fused, got
    assert got["attention"] == "microtensor.kernels." + attention, got
    assert not any("MICROTENSOR_KERNELS" in w for w in got["warnings"])


def test_an_unknown_microtensor_kernels_warns_and_means_auto():
    got = child(MICROTENSOR_KERNELS="sse9")
    assert got["kernels"] == "microtensor.kernels." + _expected_build("auto")[0]
    assert any("MICROTENSOR_KERNELS='sse9'" in w for w in got["warnings"])


# ---- OMP_NUM_THREADS --------------------------------------------------------------------------
def test_omp_num_threads_each_form():
    from microtensor.threads import _allowed_cpus, default_num_threads
    cpus = len(_allowed_cpus())
    unset = child()["threads"]
    assert unset >= 1
    assert child(OMP_NUM_THREADS="1")["threads"] == 1
    assert child(OMP_NUM_THREADS="1,4")["threads"] == 1          # a nested list: the first
    assert child(OMP_NUM_THREADS=" 1 ")["threads"] == 1
    for ignored in ("0", "abc", ""):                              # not a positive count
        assert child(OMP_NUM_THREADS=ignored)["threads"] == unset, ignored
    many = child(OMP_NUM_THREADS=str(cpus + 7))
    assert many["threads"] == cpus
    assert any("OMP_NUM_THREADS" in w for w in many["warnings"]), many["warnings"]


# ---- OpenMP's waiting variables: the environment is never changed -----------------------------
@pytest.mark.parametrize("env", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                 {"GOMP_SPINCOUNT": "1000"}, {"MICROTENSOR_OMP_DEFAULTS": "0"}])
def test_omp_wait_variables_leave_the_environment_alone(env):
    child(**env)           # child() asserts the environment and a grandchild's unchanged
