"""The BLAS behind gemm, chosen once at import (microtensor/runtime/_blas_choice.py): every
choice computes the same products, the environment variable is obeyed, a bad or
impossible request says so, and show_config names what runs."""
import json
import os
import subprocess
import sys

import pytest

from microtensor.kernels import _blas
from microtensor.runtime import _blas_choice

# the microtensor this process imported (a build in place, or an installed one)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_blas_choice.__file__))))
# oneMKL is optional (`pip install "microtensor[mkl]"`; .ci/run installs it): the cases
# that need it run wherever it is installed

# Products through every entry of the engine that reaches gemm, in a fresh process with
# the BLAS forced: shapes with odd sizes, transposed operands, a thread split that does
# not divide the rows, both dtypes, attention (which calls gemm from its own module).
PROBE = r"""
import json, sys
import numpy as np
import microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _blas
rng = np.random.default_rng(0)
errors = {}
for dtype in (np.float32, np.float64):
    for (m, k, n) in [(1, 1, 1), (7, 13, 5), (97, 33, 65), (130, 257, 3)]:
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                av, bv = (a.T if ta else a), (b.T if tb else b)
                ref = av.astype(np.float64) @ bv.astype(np.float64)
                for threads in (1, 3):
                    got = _blas.gemm(av, bv, num_threads=threads)
                    key = f"{np.dtype(dtype).name} {m}x{k}x{n} {ta}{tb} t{threads}"
                    errors[key] = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
    x = rng.standard_normal((5, 130, 257)).astype(dtype)
    y = rng.standard_normal((5, 257, 3)).astype(dtype)
    got = _blas.batched_gemm(x, y, num_threads=2)
    ref = x.astype(np.float64) @ y.astype(np.float64)
    errors[f"{np.dtype(dtype).name} batched"] = float(np.abs(got - ref).max() / np.abs(ref).max())
q = mt.tensor(rng.standard_normal((2, 3, 19, 8)).astype(np.float64), requires_grad=True)
out = F.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)
out.backward(mt.ones_like(out))
print(json.dumps({"choice": _blas.blas_choice(), "errors": errors,
                  "attention": out.numpy().tolist(), "grad": q.grad.numpy().tolist()}))
"""


def probe(blas):
    env = dict(os.environ, MICROTENSOR_BLAS=blas, PYTHONPATH=PACKAGE_ROOT)
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def available():
    names = ["openblas"]
    if _blas_choice.find_mkl() is not None:
        names.append("mkl")
    return names


@pytest.fixture(scope="module")
def probes():
    return {name: probe(name) for name in available()}


def test_every_blas_computes_the_products(probes):
    for name, p in probes.items():
        assert p["choice"]["name"] == name
        for key, err in p["errors"].items():
            tol = 1e-5 if key.startswith("float32") else 1e-12
            assert err < tol, (name, key, err)


def test_attention_agrees_across_blas(probes):
    import numpy as np
    base = probes["openblas"]
    for name, p in probes.items():
        np.testing.assert_allclose(p["attention"], base["attention"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(p["grad"], base["grad"], rtol=1e-11, atol=1e-12)


def test_request_is_obeyed_and_named():
    c = _blas_choice.choose("openblas")
    assert (c["name"], c["sgemm"], c["dgemm"], c["request"]) == ("openblas", 0, 0, "openblas")
    assert "MICROTENSOR_BLAS=openblas" in c["reason"]
    if _blas_choice.find_mkl() is not None:
        c = _blas_choice.choose("mkl")
        assert c["name"] == "mkl" and c["sgemm"] and c["dgemm"] and c["sgemm"] != c["dgemm"]


def test_auto_takes_mkl_on_intel_only(monkeypatch):
    monkeypatch.setattr(_blas_choice, "_cpu_vendor", lambda: "AuthenticAMD")
    c = _blas_choice.choose("auto")
    assert c["name"] == "openblas" and "not an Intel CPU" in c["reason"]
    monkeypatch.setattr(_blas_choice, "_cpu_vendor", lambda: "GenuineIntel")
    c = _blas_choice.choose("auto")
    assert c["name"] == ("mkl" if _blas_choice.find_mkl() else "openblas")


def test_bad_value_warns_and_uses_auto(monkeypatch):
    monkeypatch.setenv("MICROTENSOR_BLAS", "atlas")
    with pytest.warns(RuntimeWarning, match="MICROTENSOR_BLAS='atlas' is not one of"):
        c = _blas_choice.choose()
    assert c["request"] == "auto"


def test_mkl_asked_for_but_missing_warns(monkeypatch):
    monkeypatch.setattr(_blas_choice, "find_mkl", lambda: None)
    with pytest.warns(RuntimeWarning, match="oneMKL not installed"):
        c = _blas_choice.choose("mkl")
    assert c["name"] == "openblas" and c["sgemm"] == 0


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_a_threaded_mkl_already_loaded_is_not_used(monkeypatch, vendor):
    """Another library's threaded oneMKL would start threads inside microtensor's. The
    vendor is set, not read: the test holds on whichever CPU runs it (auto stops at the
    vendor on AMD before it looks at oneMKL at all)."""
    monkeypatch.setattr(_blas_choice, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(_blas_choice, "find_mkl", lambda: "/some/libmkl_rt.so.2")
    monkeypatch.setattr(_blas_choice, "_open_mkl",
                        lambda path: (None, "2024.0", "oneMKL was already loaded with a "
                                      "threaded layer by another library"))
    with pytest.warns(RuntimeWarning, match="threaded layer"):
        c = _blas_choice.choose("mkl")
    assert c["name"] == "openblas"
    c = _blas_choice.choose("auto")
    expected = "threaded layer" if vendor == "GenuineIntel" else "not an Intel CPU"
    assert c["name"] == "openblas" and expected in c["reason"]


def test_show_config_names_the_gemm_blas():
    import microtensor as mt
    from microtensor import buildinfo
    c = buildinfo.config()
    assert c["gemm"] == _blas.blas_choice()
    line = next(x for x in buildinfo.format_config(c) if "BLAS (gemm)" in x)
    assert ("oneMKL" in line) == (c["gemm"]["name"] == "mkl")
    assert c["gemm"]["reason"] in line
    assert mt.show_config is buildinfo.show_config
