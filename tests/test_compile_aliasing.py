"""Aliasing is part of what a plan holds for (microtensor/capture/aliasing.py): which tensor
arguments are one object, which overlap in memory, and which are (or overlap) a tensor
the function reaches otherwise (a global, a closure variable, a list item, a module's
parameter, buffer or tensor attribute). A call that aliases otherwise than a plan was
recorded gets another plan; every call is compared with eager."""
import warnings

import numpy as np
import pytest

import microtensor as mt


def _t(*values):
    return mt.tensor(np.array(values, dtype=np.float32))


def _check(g, f, calls):
    """Call g and f on each argument tuple, compare; the calls repeat each pattern."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # aliasing is never a refusal
        for i, make in enumerate(calls):
            args, kwargs = make()
            got = g(*args, **kwargs)
            want = f(*args, **kwargs)
            assert np.array_equal(got.numpy(), want.numpy()), (i, got.numpy(), want.numpy())
    assert not g.eager_reasons


X, Y = _t(1.0), _t(2.0)
G = _t(3.0)                          # a global tensor
BANK = [_t(4.0), _t(5.0)]            # a global list of tensors


def _pattern(aliased, distinct):
    """Aliased calls recorded, then distinct ones, then each again (replays of both)."""
    return [aliased] * 3 + [distinct] * 3 + [aliased, distinct, aliased, distinct]


# -- among the arguments: the same object twice ------------------------------------------
SAME_OBJECT = {
    "two arguments": (lambda a, b: a + 10 * b,
                      lambda: ((X, X), {}), lambda: ((X, Y), {})),
    "keywords": (lambda a, b: a + 10 * b,
                 lambda: ((), {"a": X, "b": X}), lambda: ((), {"b": Y, "a": X})),
    "a list": (lambda items: items[0] + 10 * items[1],
               lambda: (([X, X],), {}), lambda: (([X, Y],), {})),
    "a tuple in a dict": (lambda d: d["p"][0] + 10 * d["q"],
                          lambda: (({"p": (X,), "q": X},), {}),
                          lambda: (({"p": (X,), "q": Y},), {})),
    "an argument and a list item": (lambda a, items: a + 10 * items[1],
                                    lambda: ((X, [Y, X]), {}), lambda: ((X, [X, Y]), {})),
}


@pytest.mark.parametrize("case", sorted(SAME_OBJECT))
@pytest.mark.parametrize("first", ["aliased first", "distinct first"])
def test_arguments_that_are_one_object_key_their_own_plan(case, first):
    f, aliased, distinct = SAME_OBJECT[case]
    g = mt.compile(f)
    calls = _pattern(aliased, distinct) if first == "aliased first" else _pattern(distinct, aliased)
    _check(g, f, calls)
    assert len(g.plans) == 2 and g.calls["replayed"] == 6, (g.calls, len(g.plans))


# -- between the arguments and what the function reaches otherwise ------------------------
def _read_global(a):
    return a + 10 * G


def _read_bank(a):
    return a + 10 * BANK[1]


def _closure():
    c = _t(6.0)

    def f(a):
        return a + 10 * c
    return f, c


class _Scaled(mt.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = mt.nn.Linear(1, 1)
        self.register_buffer("shift", _t(0.5))
        self.scale = _t(7.0)                       # a plain tensor attribute

    def forward(self, a, what):
        other = {"weight": self.lin.weight[0], "buffer": self.shift,
                 "attribute": self.scale}[what]
        return a + 10 * other


_MODULE = _Scaled()


def _reached(case):
    """(f, the tensor f reads otherwise, given as the argument)."""
    if case == "a global":
        return _read_global, G
    if case == "a global list's item":
        return _read_bank, BANK[1]
    if case == "a closure variable":
        return _closure()
    what = case.split("'s ")[1]
    if what == "weight":                          # the parameter itself: (1, 1)
        return (lambda a: a + 10 * _MODULE.lin.weight), _MODULE.lin.weight
    return (lambda a: _MODULE(a, what)), {"buffer": _MODULE.shift,
                                          "attribute": _MODULE.scale}[what]


@pytest.mark.parametrize("case", ["a global", "a global list's item", "a closure variable",
                                  "a module's weight", "a module's buffer",
                                  "a module's attribute"])
@pytest.mark.parametrize("first", ["aliased first", "distinct first"])
def test_an_argument_that_is_a_tensor_the_function_reads_otherwise(case, first):
    f, other = _reached(case)
    aliased = lambda: ((other,), {})                           # noqa: E731
    distinct = lambda: ((mt.ones(*other.shape).mul(2).requires_grad_(other.requires_grad),),  # noqa: E731
                        {})
    g = mt.compile(f)
    calls = _pattern(aliased, distinct) if first == "aliased first" else _pattern(distinct, aliased)
    _check(g, f, calls)
    assert len(g.plans) == 2 and g.calls["replayed"] == 6, (g.calls, len(g.plans))


# -- memory: two objects, one storage ------------------------------------------------------
def _views():
    base = mt.arange(16.0).reshape(4, 4)
    return {
        "x and x[1:]": (base[:3], base[1:]),            # rows 1, 2 in both
        "x and x.T": (base, base.T),
        "x and a view of it": (base, base.view(16).view(4, 4)),   # another object
        "one column in both": (base[:, :2], base[:, 1:3]),
    }


@pytest.mark.parametrize("case", ["x and x[1:]", "x and x.T", "x and a view of it",
                                  "one column in both"])
def test_arguments_that_overlap_in_memory_key_their_own_plan(case):
    a, b = _views()[case]
    fresh = (mt.tensor(a.numpy().copy()), mt.tensor(b.numpy().copy()))
    apart = mt.arange(32.0).reshape(8, 4)             # one storage, no element in common
    apart = (apart[:a.shape[0], :a.shape[1]], apart[4:4 + b.shape[0], :b.shape[1]])
    f = lambda p, q: p * 2 + q                        # noqa: E731
    g = mt.compile(f)
    _check(g, f, [lambda: ((a, b), {})] * 3)          # recorded with the overlap
    _check(g, f, [lambda: (fresh, {})] * 3)           # another key: recorded, replayed
    assert g.calls == {"recorded": 4, "replayed": 2, "eager": 0}
    _check(g, f, [lambda: (apart, {}), lambda: ((a, b), {})])   # both replay a plan
    assert g.calls == {"recorded": 4, "replayed": 4, "eager": 0}


def test_an_argument_that_overlaps_a_global_guards_its_plan():
    f = lambda a: a + G * 0 + 1                        # noqa: E731 - reads the global G
    g = mt.compile(f)
    base = G.view(1, 1)[0]                             # G's memory, another object
    _check(g, f, [lambda: ((X,), {})] * 3)
    _check(g, f, [lambda: ((base,), {})] * 3)          # overlaps G: another plan
    assert g.calls == {"recorded": 4, "replayed": 2, "eager": 0}


def test_overlap_keys_are_exact():
    from microtensor.capture.aliasing import among
    base = mt.arange(24.0).reshape(4, 6)
    assert among([base[:, ::2], base[:, 1::2]]) == ()           # interleaved, no element
    assert among([base[:2], base[2:]]) == ()
    assert among([base[:, ::2], base[:, 2::2]]) == ((1, 0, "overlaps"),)
    assert among([base, base]) == ((1, 0, "same"),)
    assert among([base, X, base[3]]) == ((2, 0, "overlaps"),)
    assert among([mt.zeros(0), mt.zeros(0)]) == ()              # no memory, no overlap


def test_keyword_order_keys_one_plan():
    f = lambda a, b: a - b                              # noqa: E731
    g = mt.compile(f)
    _check(g, f, [lambda: ((), {"a": X, "b": Y}), lambda: ((), {"b": Y, "a": X})] * 2)
    assert g.calls["replayed"] == 2


def test_a_training_step_replays_with_the_aliasing_checks():
    """The common case pays nothing in plans: fresh batches, parameters read as they are."""
    lin = mt.nn.Linear(3, 2)
    opt = mt.optim.SGD(lin.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = (lin(x) - y).square().mean()
        loss.backward()
        opt.step()
        return loss
    g = mt.compile(step)
    rng = np.random.default_rng(0)
    for _ in range(5):
        g(mt.tensor(rng.standard_normal((4, 3)).astype(np.float32)),
          mt.tensor(rng.standard_normal((4, 2)).astype(np.float32)))
    assert g.calls == {"recorded": 2, "replayed": 3, "eager": 0}


def test_recordings_that_alias_otherwise_start_the_pair_again():
    """The first call aliases a global, the second does not: the two recordings are not
    compared (they would differ, and the key would run eagerly for good); the second is
    the first of a new pair."""
    f = _read_global
    g = mt.compile(f)
    aliased, distinct = (lambda: ((G,), {})), (lambda: ((X,), {}))
    _check(g, f, [aliased, distinct, distinct, distinct, aliased, aliased, aliased, distinct])
    assert g.calls == {"recorded": 5, "replayed": 3, "eager": 0}, g.calls


BATCH = None        # a script's global batch, rebound by its loop


def test_a_global_batch_rebound_by_a_script_loop_still_replays():
    """`x = next batch` at a script's top level, then `step(x)`: the argument is a global
    of the function's module, a new object at every call. The function does not read
    the global itself, so no guard holds the old object: the plan replays."""
    global BATCH
    w = mt.ones(3)
    f = lambda a: (a * w).sum()                           # noqa: E731
    g = mt.compile(f)
    rng = np.random.default_rng(0)
    for _ in range(5):
        BATCH = mt.tensor(rng.standard_normal(3).astype(np.float32))
        assert g(BATCH).item() == f(BATCH).item()
    assert g.calls == {"recorded": 2, "replayed": 3, "eager": 0}
