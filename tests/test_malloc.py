"""glibc's malloc tuned at import (microtensor/runtime/_malloc.py): a loop that allocates and
frees the same large arrays stops taking fresh pages from the kernel; the environment's
own settings and MICROTENSOR_MALLOC=default leave glibc alone; show_config says which."""
import json
import os
import subprocess
import sys

import pytest

from microtensor.runtime import _malloc

# the microtensor this process imported (a build in place, or an installed one)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_malloc.__file__))))
GLIBC = _malloc._glibc() is not None

# A linear layer's forward and backward in a loop (the arrays of a training step: 1.5 MB
# outputs, freed before the next call), counting the process's minor page faults.
PROBE = r"""
import json, resource
import numpy as np
import microtensor as mt
import microtensor.nn.functional as F
from microtensor.runtime import _malloc
mt.set_num_threads(1)
rng = np.random.default_rng(0)
x = mt.tensor(rng.standard_normal((768, 512), dtype=np.float32), requires_grad=True)
w = mt.tensor(rng.standard_normal((513, 512), dtype=np.float32), requires_grad=True)
def once():
    y = F.linear(x, w)
    y.backward(mt.ones_like(y))
    x.grad = None
    w.grad = None
for _ in range(5):
    once()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    once()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 50
print(json.dumps({"faults": faults, "state": _malloc.state}))
"""


def probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in _malloc.USER_VARIABLES}
    full.update(env, PYTHONPATH=PACKAGE_ROOT)
    run = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_tuned_loop_reuses_memory_and_default_does_not():
    tuned = probe()
    default = probe(MICROTENSOR_MALLOC="default")
    assert tuned["state"]["tuned"] is True
    assert default["state"] == {"tuned": False, "reason": "MICROTENSOR_MALLOC=default"}
    assert tuned["faults"] < 20, tuned
    # each call takes ~5 MB of fresh arrays: ~1,200 pages when nothing is reused. NOTE:
    # glibc's own mmap threshold moves up as mapped blocks are freed, and in a fresh
    # process it may already have risen past these arrays (seen once in a CI run: 0
    # faults); then the defaults keep the memory too, and the comparison proves nothing
    if default["faults"] <= 200:
        pytest.skip(f"glibc's defaults kept this loop's memory by themselves this time "
                    f"({default['faults']:.0f} page faults a call): no contrast to measure")
    assert default["faults"] > 200, default


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
@pytest.mark.parametrize("var", _malloc.USER_VARIABLES)
def test_the_environments_own_setting_wins(var):
    got = probe(**{var: str(1 << 20)})
    assert got["state"]["tuned"] is False
    assert var in got["state"]["reason"]


def test_show_config_says_what_the_allocator_does():
    from microtensor import buildinfo
    c = buildinfo.config()
    line = next(x for x in buildinfo.format_config(c) if x.strip().startswith("memory"))
    assert c["malloc"] == _malloc.state
    if c["malloc"]["tuned"]:
        assert "kept for reuse" in line and f"{_malloc.MMAP_THRESHOLD >> 20} MiB" in line
    else:
        assert c["malloc"]["reason"] in line


# ---- what freed memory the process keeps: measured in a child, numpy's own arrays ------
RSS = r"""
import json, sys
import numpy as np
import microtensor
from microtensor.runtime import _malloc

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024

mib, count, keep, trim = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "trim"
base = rss()
arrays = [np.ones(mib << 18, dtype=np.float32) for _ in range(count)]   # touched: resident
peak = rss() - base
kept = {"last": arrays[-1:], "first": arrays[:1], "middle": arrays[count // 2:count // 2 + 1],
        "none": []}[keep]
del arrays
after = rss() - base
if trim:
    _malloc.trim()
    after = rss() - base
print(json.dumps({"peak": peak, "after": after, "state": _malloc.state}))
"""


def rss_after_free(mib, count, keep, trim=False, **env):
    full = {k: v for k, v in os.environ.items() if k not in _malloc.USER_VARIABLES}
    full.pop("MICROTENSOR_MALLOC", None)
    full.update(env, PYTHONPATH=PACKAGE_ROOT)
    run = subprocess.run([sys.executable, "-c", RSS, str(mib), str(count), keep,
                          "trim" if trim else "keep"], env=full, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


SLACK = 6 << 20          # the interpreter's own small allocations meanwhile
# the ceilings docs/ and microtensor/runtime/_malloc.py promise (written out: a change of the
# constants must be a change of the promise)
DOC_MMAP = 8 << 20
DOC_TRIM = 64 << 20


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
@pytest.mark.parametrize("mib", [20, 8, 64])
@pytest.mark.parametrize("keep", ["last", "first", "middle"])
def test_freed_blocks_at_the_mmap_threshold_or_above_are_never_kept(mib, keep):
    """The issue's case: free 29 of 30 arrays of 20 MiB; the process keeps only the one
    still alive (blocks of MMAP_THRESHOLD or more are given back at free)."""
    assert mib << 20 >= DOC_MMAP
    got = rss_after_free(mib, 30, keep)
    assert got["state"]["tuned"] is True
    assert got["peak"] >= 30 * (mib << 20)
    assert got["after"] <= (mib << 20) + SLACK, got


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_free_memory_at_the_heaps_top_is_kept_up_to_the_trim_threshold():
    """Blocks under the mmap threshold, all freed: the heap's top is given back down to
    at most TRIM_THRESHOLD."""
    mib = 2
    count = 3 * (DOC_TRIM // (mib << 20))
    got = rss_after_free(mib, count, "none")
    # blocks under the mmap threshold may reuse heap the import freed before `base`
    assert got["peak"] >= count * (mib << 20) - SLACK
    assert got["after"] <= DOC_TRIM + SLACK, got


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_blocks_under_a_live_one_are_kept_no_more_than_the_peak_and_trim_gives_them_back():
    """What the docs call (b): small freed blocks below a live block stay (bounded by the
    peak), and _malloc.trim() hands them back."""
    got = rss_after_free(2, 60, "last")
    assert got["after"] <= got["peak"] + SLACK
    trimmed = rss_after_free(2, 60, "last", trim=True)
    assert trimmed["after"] <= (2 << 20) + SLACK, trimmed


def test_the_documented_thresholds_are_the_ones_set():
    assert (_malloc.MMAP_THRESHOLD, _malloc.TRIM_THRESHOLD) == (DOC_MMAP, DOC_TRIM)
    doc = _malloc.__doc__
    assert f"mmap threshold  {_malloc.MMAP_THRESHOLD >> 20} MiB" in doc
    assert f"trim threshold {_malloc.TRIM_THRESHOLD >> 20} MiB" in doc
    if _malloc.state["tuned"]:
        assert _malloc.state["mmap_threshold"] == _malloc.MMAP_THRESHOLD
        assert _malloc.state["trim_threshold"] == _malloc.TRIM_THRESHOLD
