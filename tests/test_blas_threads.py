"""mt.set_blas_threads / get_blas_threads / blas_info / set_threads, found through
threadpoolctl, and scipy's OpenBLAS pinned to one thread by microtensor.kernels._blas."""
import pytest
from threadpoolctl import ThreadpoolController

import microtensor as mt
from microtensor.kernels import _blas


def openblas():
    return ThreadpoolController().select(internal_api="openblas").lib_controllers


@pytest.fixture
def restore():
    before = {lib.filepath: lib.num_threads for lib in openblas()}
    n = mt.get_num_threads()
    yield
    for lib in openblas():
        lib.set_num_threads(before[lib.filepath])
    mt.set_num_threads(n)


def test_blas_info_lists_every_openblas_numpy_first():
    info = mt.blas_info()
    libs = openblas()
    if not libs:
        pytest.skip("no OpenBLAS loaded (numpy on another BLAS)")
    assert sorted(i["path"] for i in info) == sorted(lib.filepath for lib in libs)
    if any("numpy" in lib.filepath for lib in libs):
        assert "numpy" in info[0]["path"]
    for i in info:
        assert set(i) == {"path", "num_threads", "corename", "config"}
        assert i["num_threads"] >= 1
        assert i["config"] is None or "OpenBLAS" in i["config"]


def test_scipys_openblas_is_pinned_to_one_thread():
    scipy_libs = [lib for lib in openblas() if "numpy" not in lib.filepath]
    assert _blas.pin_blas_threads() == bool(scipy_libs)
    assert all(lib.num_threads == 1 for lib in scipy_libs)


def test_set_and_get_numpys_blas_threads(restore):
    if not any("numpy" in lib.filepath for lib in openblas()):
        pytest.skip("numpy does not use its own OpenBLAS here")
    for n in (1, 2, 1):
        assert mt.set_blas_threads(n) == 1
        assert mt.get_blas_threads() == n
    # only numpy's: scipy's stays pinned
    assert all(lib.num_threads == 1 for lib in openblas() if "numpy" not in lib.filepath)


def test_set_threads_sets_both(restore):
    assert mt.set_threads(1) == 1
    assert mt.get_num_threads() == 1
    if any("numpy" in lib.filepath for lib in openblas()):
        assert mt.get_blas_threads() == 1


def test_library_filter_and_bad_counts(restore):
    assert mt.set_blas_threads(1, library="no-such-library") == 0
    assert mt.set_blas_threads(1, library="all") == len(openblas())
    with pytest.raises(ValueError, match="at least 1"):
        mt.set_blas_threads(0)
