"""glibc's malloc tuned at import (microtensor/_malloc.py): a loop that allocates and
frees the same large arrays stops taking fresh pages from the kernel; the environment's
own settings and MICROTENSOR_MALLOC=default leave glibc alone; show_config says which."""
import json
import os
import subprocess
import sys

import pytest

from microtensor import _malloc

# the microtensor this process imported (a build in place, or an installed one)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(_malloc.__file__)))
GLIBC = _malloc._glibc() is not None

# A linear layer's forward and backward in a loop (the arrays of a training step: 1.5 MB
# outputs, freed before the next call), counting the process's minor page faults.
PROBE = r"""
import json, resource
import numpy as np
import microtensor as mt
import microtensor.nn.functional as F
from microtensor import _malloc
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
    # each call takes ~5 MB of fresh arrays: ~1,200 pages when nothing is reused
    assert default["faults"] > 200, default
    assert tuned["faults"] < 20, tuned


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
        assert "kept for reuse" in line and "32 MiB" in line
    else:
        assert c["malloc"]["reason"] in line
