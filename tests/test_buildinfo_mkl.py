"""oneMKL is an optional extra: never a dependency (it is used on Intel CPUs only), and
mt.show_config() on an Intel CPU without it says how to get it."""
import os

import pytest

import microtensor as mt
from microtensor.runtime import _blas_choice
from microtensor import buildinfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_mkl_is_an_extra_not_a_dependency():
    project = pyproject()["project"]
    assert not [d for d in project["dependencies"] if d.split(";")[0].strip().startswith("mkl")]
    extra = project["optional-dependencies"]["mkl"]
    assert len(extra) == 1 and extra[0].startswith("mkl")
    # the extra installs nothing off Linux x86-64, where the wheel's library is not looked for
    assert "platform_machine == 'x86_64'" in extra[0]


def lines_for(monkeypatch, vendor, mkl_path, request="auto"):
    """show_config's lines with the BLAS choice made for a CPU of `vendor` with oneMKL at
    `mkl_path` (None: not installed), as _blas_choice.choose() makes it."""
    monkeypatch.setattr(_blas_choice, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(_blas_choice, "find_mkl", lambda: mkl_path)
    choice = _blas_choice.choose(request)
    config = buildinfo.config()
    config["gemm"] = choice
    config["vendor"] = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)
    return "\n".join(buildinfo.format_config(config))


def test_an_intel_cpu_without_onemkl_is_told_how_to_get_it(monkeypatch):
    text = lines_for(monkeypatch, "GenuineIntel", None)
    assert 'pip install "microtensor[mkl]"' in text and "install mkl" in text
    assert "faster on this Intel CPU" in text
    # one hint, on the line under the BLAS line
    lines = text.splitlines()
    at = [i for i, ln in enumerate(lines) if "BLAS (gemm)" in ln][0]
    assert "microtensor[mkl]" in lines[at + 1] and text.count("microtensor[mkl]") == 1


@pytest.mark.filterwarnings("ignore:MICROTENSOR_BLAS=mkl")
@pytest.mark.parametrize("vendor, request_", [("AuthenticAMD", "auto"), ("HygonGenuine", "auto"),
                                              ("AuthenticAMD", "mkl"),
                                              ("GenuineIntel", "openblas")])
def test_no_hint_where_onemkl_would_not_be_used(monkeypatch, vendor, request_):
    text = lines_for(monkeypatch, vendor, None, request_)
    assert "microtensor[mkl]" not in text and "oneMKL makes" not in text


def test_show_config_prints_the_hint(monkeypatch, capsys):
    mt_config = buildinfo.config()
    monkeypatch.setattr(buildinfo, "config", lambda: dict(
        mt_config, vendor="Intel", gemm={"name": "openblas",
                                         "reason": "auto: oneMKL not installed (pip install mkl)"}))
    mt.show_config()
    assert "microtensor[mkl]" in capsys.readouterr().out

