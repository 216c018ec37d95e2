import os

import numpy as np
import pytest

import microtensor as mt


@pytest.fixture(autouse=True, scope="session")
def _run_outside_the_source_tree(tmp_path_factory):
    """Tests (and the `python -c` children they start) run in a scratch directory, not at
    the repository root: there, in a fresh clone, the unbuilt source folder `microtensor/`
    would hide the installed package from a child's `import microtensor`."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    mt.manual_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes: one thread is fastest, and immune to a machine busy with other work
    (waking a second thread on an overloaded core costs more than the op). A module asks
    for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = mt.get_num_threads()
    mt.set_num_threads(1)
    yield
    mt.set_num_threads(before)


def kernel_builds_here():
    """[(name, fused module, attention module)] for every build of the fused kernels this
    CPU runs (baseline always; AVX2+FMA and AVX-512 where the CPU has them), widest first."""
    from microtensor.ops._functional_common import kernel_builds_here as builds
    return builds()
