"""mt.inspect rides on the engine's own hooks: Module's forward hooks for the calls, the
engine's per-node backward hook for the skip split (and it shares that hook with the
profiler)."""
import numpy as np
import pytest

import microtensor as mt
from microtensor import inspect as mti
from microtensor import nn
from microtensor.inspect import residual
from microtensor.profiler import Profiler


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(x).tanh()


def test_calls_are_seen_through_forward_hooks_and_the_hooks_go_away():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    with mti.track_modules(model) as calls:
        assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1
                   for m in model.modules())
        model(mt.randn(2, 3, requires_grad=True))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert [c.name for c in calls.calls] == ["0", "1", ""]
    assert calls.calls[0].parent is calls.calls[2] and calls.calls[0].depth == 1


def test_a_forward_that_raises_leaves_the_nesting_intact():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fail = True

        def forward(self, x):
            if self.fail:
                raise ValueError("once")
            return x * 2.0

    flaky = Flaky()
    model = nn.Sequential(nn.Linear(3, 3), flaky)
    with mti.track_modules(model) as calls:
        with pytest.raises(ValueError):
            model(mt.randn(2, 3))
        flaky.fail = False
        model(mt.randn(2, 3))
    closed = [(c.name, c.parent.name if c.parent else None) for c in calls.calls]
    assert closed == [("0", ""), ("0#1", "#1"), ("1#1", "#1"), ("#1", None)]


def test_the_split_shares_the_engine_hook_with_the_profiler():
    block = Residual(4).double()
    x = mt.randn(3, 4, dtype=mt.float64, requires_grad=True)
    rec = mti.GradientRecorder(block, keep_grads=True)
    with Profiler() as prof:
        with rec:
            y = block(x)
        y.retain_grad()
        (y * mt.randn(3, 4, dtype=mt.float64)).sum().backward()
        assert residual._streams == []           # the split has finished and let go
        seen = sum(c for (_, op), (c, _) in prof.stats.items() if op == "AddBackward")
        (block(x) * 1.0).sum().backward()        # the profiler still sees every node
        after = sum(c for (_, op), (c, _) in prof.stats.items() if op == "AddBackward")
    assert seen >= 1 and after == seen + 1
    np.testing.assert_allclose(rec[""].grads["skip"], y.grad.numpy(), rtol=1e-12)
    assert rec[""].branch_norm > 0


def test_no_hook_is_left_in_the_engine_after_a_split():
    block = Residual(4).double()
    x = mt.randn(3, 4, dtype=mt.float64, requires_grad=True)
    rec = mti.GradientRecorder(block)
    with rec:
        y = block(x)
    calls = []
    original = residual.SkipStream.step

    def counting(self, node):
        calls.append(node.name())
        return original(self, node)
    residual.SkipStream.step = counting
    try:
        y.sum().backward()
        n = len(calls)
        assert n > 0 and residual._streams == []
        (block(x) * 1.0).sum().backward()        # a later pass runs without the hook
        assert len(calls) == n
    finally:
        residual.SkipStream.step = original


def test_the_split_under_create_graph():
    # create_graph=True runs the engine's create-graph rules instead of the per-node hook;
    # the split rides on those the same way
    block = Residual(4).double()
    x = mt.randn(3, 4, dtype=mt.float64, requires_grad=True)
    rec = mti.GradientRecorder(block, keep_grads=True)
    with rec:
        y = block(x)
    (gx,) = mt.autograd.grad((y * y).sum(), x, create_graph=True)
    assert gx.requires_grad
    g = rec[""].grads
    np.testing.assert_allclose(g["skip"], 2.0 * y.detach().numpy(), rtol=1e-12)   # dL/dy
    np.testing.assert_allclose(g["skip"] + g["branch"], gx.detach().numpy(), rtol=1e-12,
                               atol=1e-15)
    assert residual._streams == []
    (again,) = mt.autograd.grad((block(x) ** 2).sum(), x, create_graph=True)
    np.testing.assert_allclose(again.detach().numpy(), gx.detach().numpy(), rtol=1e-12)
