"""What a plan must tell apart before it replays (microtensor/capture/guards.py): every
Python scalar eager tells apart (-0.0 from 0.0, NaN from numbers, 2 from 2.0 from True),
wherever the function gets it (an argument, a keyword, a nested argument, a global, a
closure cell, a module's attribute); the grad mode a call leaves; a module's hooks and
submodules; functions whose call returns a generator or coroutine; results the caller
may change. Each test compares every call with eager."""
import asyncio
import collections
import math
import warnings

import numpy as np
import pytest

import microtensor as mt


def _np(t):
    return t.numpy() if isinstance(t, mt.Tensor) else np.asarray(t)


def _same(a, b):
    """Bit for bit: the sign of a zero counts, NaN equals NaN; tuples item by item."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    a, b = _np(a), _np(b)
    return (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
            and np.array_equal(np.signbit(a), np.signbit(b)))


def _calls(g, f, values, make_call):
    """Call g and f alternately with each value (each value twice in a row, so that a
    plan is recorded for it), and compare."""
    for v in values:
        for _ in range(3):
            got, want = make_call(g, v), make_call(f, v)
            assert _same(got, want), (v, _np(got), _np(want))


# values that eager tells apart and that compare (or hash) equal in Python
SIGNED = [0.0, -0.0, 0.0, -0.0]
KINDS = [2, 2.0, True, 1, 1.0, 2, True]
NANS = [float("nan"), 1.0, float("nan"), math.inf, -math.inf]


def _sensitive(x, s):
    """Results that differ for -0.0 and 0.0, inf and -inf, NaN, and int / float / bool."""
    t = x * s
    return mt.stack([(1.0 / t).sum(), mt.clamp(x, max=s).sum(), (x * 0 + s).sum(),
                     mt.tensor(s).float() * 1.0, (x * 0 + s).sum() * 0.0]), mt.full((2,), s)


@pytest.mark.parametrize("values", [SIGNED, KINDS, NANS], ids=["signed zero", "types", "nan"])
def test_a_scalar_argument_keys_the_plan(values):
    f = lambda x, s: _sensitive(x, s)                  # noqa: E731
    g = mt.compile(f)
    x = mt.ones(3)
    _calls(g, f, values, lambda fn, v: fn(x, v))
    _calls(g, f, values, lambda fn, v: fn(x, s=v))     # as a keyword
    _calls(g, f, values, lambda fn, v: fn(x, [v])[0] if False else fn(x, v))
    # nested in a tuple and a dict
    h = lambda x, cfg: _sensitive(x, cfg["s"][0])      # noqa: E731
    gh = mt.compile(h)
    _calls(gh, h, values, lambda fn, v: fn(x, {"s": (v,)}))
    assert g.calls["replayed"] > 0


def test_numpy_scalars_key_by_sign_and_type():
    f = lambda x, s: x * s                              # noqa: E731
    g = mt.compile(f)
    x = mt.ones(2)
    vals = [np.float32(0.0), np.float32(-0.0), np.float64(-0.0), np.float64(0.0),
            np.float32(-0.0)]
    for v in vals:
        for _ in range(3):
            assert _same(g(x, v), f(x, v)), v


@pytest.mark.parametrize("values", [SIGNED, KINDS, NANS], ids=["signed zero", "types", "nan"])
def test_a_global_scalar_is_guarded(values):
    g = mt.compile(_reads_global)
    x = mt.ones(3)
    for v in values:
        for _ in range(3):
            globals()["SCALE"] = v
            assert _same(g(x), _reads_global(x)), v


SCALE = 1.0


def _reads_global(x):
    return _sensitive(x, SCALE)


@pytest.mark.parametrize("values", [SIGNED, KINDS, NANS], ids=["signed zero", "types", "nan"])
def test_a_closure_scalar_is_guarded(values):
    s = values[0]

    def f(x):
        return _sensitive(x, s)
    g = mt.compile(f)
    x = mt.ones(3)
    for v in values:
        s = v                                          # noqa: F841 - read through the cell
        for _ in range(3):
            assert _same(g(x), f(x)), v


@pytest.mark.parametrize("values", [SIGNED, KINDS, NANS], ids=["signed zero", "types", "nan"])
def test_a_module_attribute_is_guarded(values):
    class Scaled(mt.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = mt.nn.Linear(3, 3)
            self.s = values[0]

        def forward(self, x):
            return _sensitive(self.lin(x), self.s)
    m = Scaled()
    g = mt.compile(m)
    x = mt.ones(2, 3)
    for v in values:
        m.s = v
        for _ in range(3):
            assert _same(g(x), m(x)), v


def test_two_recordings_that_differ_only_in_a_zeros_sign_do_not_make_a_plan():
    """A value the guards cannot see (an item of a list) gives 0.0 on the first call and
    -0.0 on the second: the comparison of the recordings must see the sign."""
    box = [0.0]

    def f(x):
        s = box[0]
        box[0] = -0.0 if s == 0 and math.copysign(1, s) > 0 else 0.0
        return 1.0 / (x * s)
    g = mt.compile(f)
    x = mt.ones(2)
    for _ in range(5):
        before = box[0]
        got = g(x)
        box[0] = before
        assert _same(got, f(x))
    assert g.calls["replayed"] == 0


# -- grad mode: a plan reproduces the mode the function leaves -----------------------------
def _leaves_off(x):
    y = x * 2
    mt.set_grad_enabled(False)
    return y


def _enters_no_grad(x):
    with mt.no_grad():
        y = x * 2
    return y + 1


def _leaves_on(x):
    mt.set_grad_enabled(True)
    return x * 3


def _off_then_on(x):
    mt.set_grad_enabled(False)
    y = x * 2
    mt.set_grad_enabled(True)
    return y


def _enable_grad_inside(x):
    with mt.enable_grad():
        y = x * 2
    return y.sum()


@pytest.mark.parametrize("fn", [_leaves_off, _enters_no_grad, _leaves_on, _off_then_on,
                                _enable_grad_inside])
@pytest.mark.parametrize("start", [True, False])
def test_a_replay_leaves_the_grad_mode_the_function_left(fn, start):
    g = mt.compile(fn)
    x = mt.ones(3, requires_grad=True)
    try:
        for i in range(5):
            mt.set_grad_enabled(start)
            want_out = fn(x)
            want = mt.is_grad_enabled()
            mt.set_grad_enabled(start)
            got_out = g(x)
            assert mt.is_grad_enabled() == want, (fn.__name__, start, i)
            assert got_out.requires_grad == want_out.requires_grad
            assert _same(got_out.detach(), want_out.detach())
        assert g.calls["replayed"] == 3
    finally:
        mt.set_grad_enabled(True)


def test_two_recordings_that_leave_different_grad_modes_make_no_plan():
    """Only the mode at the end differs (no op runs after the switch)."""
    n = [0]

    def f(x):
        n[0] += 1
        y = x * 2
        mt.set_grad_enabled(n[0] % 2 == 0)
        return y
    g = mt.compile(f)
    x = mt.ones(2)
    try:
        for i in range(6):
            mt.set_grad_enabled(True)
            g(x)
            assert mt.is_grad_enabled() == (n[0] % 2 == 0), i
        assert g.calls["replayed"] == 0
        assert any("grad mode" in r for r in g.eager_reasons.values())
    finally:
        mt.set_grad_enabled(True)


@pytest.mark.parametrize("where", ["first op", "middle op", "last op"])
def test_two_recordings_that_differ_in_one_calls_grad_mode_make_no_plan(where):
    """The two recordings run the same ops on the same arguments and leave the same grad
    mode; only one op's mode differs (a flag in a list, which no guard reads). Trusting
    the second recording would replay its mode for every later call."""
    mode = [True]
    position = ["first op", "middle op", "last op"].index(where)

    def f(x):
        y = x
        for i in range(3):
            with mt.set_grad_enabled(mode[0] if i == position else True):
                y = y * 2.0 + 1.0 if i == 1 else y * 3.0
        return y.sum()
    g = mt.compile(f)
    x = mt.ones(3, requires_grad=True)
    for i in range(6):
        mode[0] = i % 2 == 0                       # the two recordings differ
        got, want = g(x), f(x)
        assert mt.is_grad_enabled()
        assert got.requires_grad == want.requires_grad, (where, i)
        assert (got.grad_fn is None) == (want.grad_fn is None), (where, i)
        assert _same(got.detach(), want.detach())
    assert g.calls["replayed"] == 0
    assert any("grad mode" in r for r in g.eager_reasons.values()), g.eager_reasons


# -- modules: hooks and submodules ---------------------------------------------------------
class _Block(mt.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.lin = mt.nn.Linear(4, 4)
        self.k = k

    def forward(self, x):
        return self.lin(x).tanh() * self.k


class _Model(mt.nn.Module):
    def __init__(self):
        super().__init__()
        self.h = mt.nn.ModuleList([_Block(1.0), _Block(2.0)])
        self.lm_head = mt.nn.Linear(4, 2)

    def forward(self, x):
        for b in self.h:
            x = b(x)
        return self.lm_head(x)


def _double_output(module, args, output):
    return output * 2


def _pre_negate(module, args):
    return (-args[0],)


CHANGES = {
    "forward hook on a block": lambda m: m.h[0].register_forward_hook(_double_output),
    "forward hook on the model": lambda m: m.register_forward_hook(_double_output),
    "forward pre-hook": lambda m: m.h[1].register_forward_pre_hook(_pre_negate),
    "hook with kwargs": lambda m: m.lm_head.register_forward_hook(
        lambda mod, a, kw, out: out + 1, with_kwargs=True),
    "block replaced": lambda m: m.h.__setitem__(0, _Block(3.0)),
    "head replaced": lambda m: setattr(m, "lm_head", mt.nn.Linear(4, 2)),
    "block appended": lambda m: m.h.append(_Block(0.5)),
    "parameter replaced": lambda m: setattr(m.h[1].lin, "weight",
                                            mt.nn.Parameter(mt.ones(4, 4))),
    "train": lambda m: m.h[1].train(),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("compiled", ["model", "function"])
def test_a_change_to_the_module_tree_records_a_new_plan(change, compiled):
    mt.manual_seed(0)
    model = _Model()
    model.eval()
    g = mt.compile(model) if compiled == "model" else mt.compile(lambda x: model(x) * 1)
    ref = (lambda x: model(x)) if compiled == "model" else (lambda x: model(x) * 1)
    x = mt.randn(3, 4)
    for _ in range(3):
        assert _same(g(x), ref(x))
    assert g.calls["replayed"] == 1
    handle = CHANGES[change](model)
    for _ in range(4):
        assert _same(g(x), ref(x)), change
    assert g.calls["replayed"] >= 2 and len(g.plans) == 2
    if hasattr(handle, "remove"):            # removed again: the first plan holds again
        handle.remove()
        replayed = g.calls["replayed"]
        assert _same(g(x), ref(x)) and g.calls["replayed"] == replayed + 1


class _WithTensors(mt.nn.Module):
    """Plain tensor attributes, neither parameters nor buffers, read by forward."""

    def __init__(self):
        super().__init__()
        self.lin = mt.nn.Linear(4, 4)
        self.scale = mt.tensor(5.0)
        self.lin.offset = mt.zeros(4)          # on a submodule
        self.extra = None                      # None, or a tensor to add

    def forward(self, x):
        y = self.lin(x) * self.scale + self.lin.offset
        return y if self.extra is None else y + self.extra


TENSOR_CHANGES = {
    "attribute replaced": lambda m: setattr(m, "scale", mt.tensor(7.0)),
    "same value, another tensor": lambda m: setattr(m, "scale", mt.tensor(5.0)),
    "another dtype": lambda m: setattr(m, "scale", mt.tensor(5.0, dtype=mt.float64)),
    "requires grad": lambda m: setattr(m, "scale", mt.tensor(5.0, requires_grad=True)),
    "submodule's attribute": lambda m: setattr(m.lin, "offset", mt.ones(4)),
    "None to a tensor": lambda m: setattr(m, "extra", mt.full((4,), 3.0)),
    "a view of it": lambda m: setattr(m, "scale", m.scale.view(1)[0]),
}


@pytest.mark.parametrize("change", sorted(TENSOR_CHANGES))
@pytest.mark.parametrize("compiled", ["model", "function"])
def test_a_module_tensor_attribute_is_guarded(change, compiled):
    """m.scale = mt.tensor(...) between calls: the replay must not read the old one."""
    mt.manual_seed(0)
    model = _WithTensors()
    g = mt.compile(model) if compiled == "model" else mt.compile(lambda x: model(x) * 1)
    ref = (lambda x: model(x)) if compiled == "model" else (lambda x: model(x) * 1)
    x = mt.randn(3, 4)
    for _ in range(3):
        assert _same(g(x).detach(), ref(x).detach())
    assert g.calls["replayed"] == 1
    TENSOR_CHANGES[change](model)
    for i in range(4):
        got, want = g(x), ref(x)
        assert _same(got.detach(), want.detach()), (change, i)
        assert got.requires_grad == want.requires_grad
    assert g.calls["replayed"] >= 2 and len(g.plans) == 2, (g.calls, len(g.plans))
    # the values of the tensor a plan holds are read at each replay: no new plan
    with mt.no_grad():
        model.lin.offset.add_(1.0)
    assert _same(g(x).detach(), ref(x).detach()) and len(g.plans) == 2


def test_a_hook_registered_and_removed_inside_the_function_replays():
    model = _Model()
    outs = []

    def f(x):
        handle = model.lm_head.register_forward_hook(_double_output)
        y = model(x)
        handle.remove()
        return y
    g = mt.compile(f)
    for i in range(5):
        x = mt.full((2, 4), float(i))
        outs.append(_same(g(x), f(x)))
    assert all(outs) and g.calls["replayed"] == 3


def test_a_module_counter_in_forward_runs_eagerly():
    class Counting(mt.nn.Module):
        def __init__(self):
            super().__init__()
            self.n = 0

        def forward(self, x):
            self.n += 1
            return x * 2
    m = Counting()
    g = mt.compile(lambda x: m(x) + m.n)
    ref = Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(6):
            assert _same(g(mt.ones(2)), ref(mt.ones(2)) + ref.n)


# -- generator and async functions, returned iterators -------------------------------------
def _gen(x):
    yield x * 2
    yield x * 3


async def _coro(x):
    return x * 2


async def _agen(x):
    yield x * 2


def test_a_generator_function_runs_eagerly_with_one_warning():
    g = mt.compile(_gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            x = mt.full((2,), float(i))
            got = list(g(x))
            assert len(got) == 2 and all(_same(a, b) for a, b in zip(got, _gen(x)))
    assert g.calls["replayed"] == 0
    assert len([w for w in caught if "generator function" in str(w.message)]) == 1


def test_an_async_function_runs_eagerly():
    g = mt.compile(_coro)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            x = mt.full((2,), float(i))
            assert _same(asyncio.run(g(x)), x * 2)
    assert any("async" in str(w.message) for w in caught)

    ga = mt.compile(_agen)

    async def collect(x):
        return [y async for y in ga(x)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            x = mt.full((2,), float(i))
            got = asyncio.run(collect(x))
            assert len(got) == 1 and _same(got[0], x * 2)


@pytest.mark.parametrize("make", [
    lambda x: (x * k for k in (2, 3)),
    lambda x: iter([x * 2, x * 3]),
    lambda x: map(lambda k: x * k, (2, 3)),
], ids=["generator expression", "iter", "map"])
def test_a_returned_iterator_is_never_replayed(make):
    g = mt.compile(make)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(5):
            x = mt.full((2,), float(i))
            got = list(g(x))
            assert len(got) == 2 and _same(got[0], x * 2) and _same(got[1], x * 3), i


def test_a_generator_function_wrapped_in_partial_runs_eagerly():
    import functools
    g = mt.compile(functools.partial(_gen))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            x = mt.full((2,), float(i))
            assert len(list(g(x))) == 2
    assert g.calls["replayed"] == 0


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize("kind", ["namedtuple", "list", "dict", "nested"])
def test_results_are_rebuilt_by_each_replay(kind):
    def f(x):
        if kind == "namedtuple":
            return Pair(x * 2, x + 1)
        if kind == "list":
            return [x * 2, x + 1]
        if kind == "dict":
            return {"a": x * 2, "b": x + 1}
        return (x * 2, [x + 1, {"c": [x * 3]}])
    g = mt.compile(f)
    for i in range(5):
        x = mt.full((2,), float(i))
        got, want = g(x), f(x)
        assert type(got) is type(want)
        flat_got, flat_want = _flatten(got), _flatten(want)
        assert len(flat_got) == len(flat_want)
        assert all(_same(a, b) for a, b in zip(flat_got, flat_want)), (kind, i)
        if isinstance(got, list):
            got.append("changed by the caller")          # the next replay is not affected
        elif isinstance(got, dict):
            got["z"] = 1
    assert g.calls["replayed"] == 3


def _flatten(v):
    if isinstance(v, dict):
        return [y for k in sorted(v) for y in _flatten(v[k])]
    if isinstance(v, (tuple, list)):
        return [y for x in v for y in _flatten(x)]
    return [v]


def test_a_result_object_holding_tensors_runs_eagerly():
    class Out:
        def __init__(self, t):
            self.t = t
    g = mt.compile(lambda x: Out(x * 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            x = mt.full((2,), float(i))
            assert _same(g(x).t, x * 2)
