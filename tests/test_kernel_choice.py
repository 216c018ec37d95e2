"""The loader of the fused kernels asks twice before it takes a build: numpy's view of the
CPU (`runs_here`, the row's last field) and the build's own compiled check
(`CPU_RUNS_THIS_BUILD`). Either one saying no must be enough: a build that executes a
wider instruction than the CPU has kills the process, so neither check may be skipped."""
import importlib

import pytest

from microtensor.kernels import _choice as choice


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader with nothing loaded yet, and MICROTENSOR_KERNELS at auto; restored after."""
    monkeypatch.delenv("MICROTENSOR_KERNELS", raising=False)
    saved = dict(choice._loaded)
    choice._loaded.clear()
    yield
    choice._loaded.clear()
    choice._loaded.update(saved)


def _builds_here():
    return [name for name, fused, attention, runs_here in choice.KERNEL_BUILDS if runs_here()
            and choice._import_build(fused, attention)]


@pytest.mark.parametrize("refuser", ["numpy", "build"])
def test_either_check_alone_keeps_a_build_out(fresh_loader, monkeypatch, refuser):
    here = _builds_here()
    assert here[-1] == "baseline"
    for refused in here:
        choice._loaded.clear()
        rows = []
        for name, fused, attention, runs_here in choice.KERNEL_BUILDS:
            if name == refused and refuser == "numpy":
                runs_here = lambda: False               # numpy says no, the build says yes
            rows.append((name, fused, attention, runs_here))
        monkeypatch.setattr(choice, "KERNEL_BUILDS", tuple(rows))
        if refuser == "build":                          # the build says no, numpy says yes
            fused = dict((r[0], r[1]) for r in rows)[refused]
            module = importlib.import_module("microtensor.kernels." + fused)
            monkeypatch.setattr(module, "CPU_RUNS_THIS_BUILD", False, raising=False)
        chosen = choice._load_kernels()[0].__name__.rsplit(".", 1)[1]
        names = {r[1]: r[0] for r in rows}
        if refused != "baseline":
            assert names[chosen] != refused, f"{refused} taken though {refuser} refused it"
            # the widest of the other builds the CPU runs is taken instead
            assert names[chosen] == [b for b in here if b != refused][0]
        monkeypatch.undo()
        monkeypatch.delenv("MICROTENSOR_KERNELS", raising=False)


def test_every_row_asks_the_cpu():
    # each row carries its own question (a function), and the widest build's is not a
    # constant: the loader's two checks stay independent
    for name, fused, attention, runs_here in choice.KERNEL_BUILDS:
        assert callable(runs_here), name
    assert choice.KERNEL_BUILDS[-1][0] == "baseline"
