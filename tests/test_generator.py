"""mt.Generator and generator= against torch.Generator: the same calls are accepted (each
is run in torch too, with a torch.Generator, and gives the same shape and dtype), one seed
gives one sequence of draws, two generators are independent of each other and of the
default one. (The numbers themselves differ from torch's: another bit generator.)"""
import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")


def _fills(lib, name, *args):
    def draw(g):
        t = lib.zeros(3, 4)
        getattr(t, name)(*args, generator=g)
        return t
    return draw


def _init(lib, name, *args):
    def draw(g):
        t = lib.zeros(5, 4)
        getattr(lib.nn.init, name)(t, *args, generator=g)
        return t
    return draw


P = [[0.1, 0.0, 0.5, 0.4], [0.25, 0.25, 0.25, 0.25]]

# name -> lib -> (generator -> tensor): every place torch takes generator=
CALLS = {
    "randn": lambda lib: lambda g: lib.randn(3, 4, generator=g),
    "rand": lambda lib: lambda g: lib.rand(2, 5, generator=g),
    "randint": lambda lib: lambda g: lib.randint(0, 10, (6,), generator=g),
    "randperm": lambda lib: lambda g: lib.randperm(9, generator=g),
    "multinomial": lambda lib: lambda g: lib.multinomial(lib.tensor(P), 3, generator=g),
    "multinomial_replacement": lambda lib: lambda g: lib.multinomial(
        lib.tensor(P), 7, replacement=True, generator=g),
    "normal": lambda lib: lambda g: lib.normal(lib.zeros(3), lib.ones(3), generator=g),
    "bernoulli": lambda lib: lambda g: lib.bernoulli(lib.full((8,), 0.5), generator=g),
    "poisson": lambda lib: lambda g: lib.poisson(lib.full((5,), 3.0), generator=g),
    "randn_like": lambda lib: lambda g: lib.randn_like(lib.zeros(2, 3), generator=g),
    "rand_like": lambda lib: lambda g: lib.rand_like(lib.zeros(2, 3), generator=g),
    "randint_like": lambda lib: lambda g: lib.randint_like(lib.zeros(4), 0, 9, generator=g),
    "Tensor.normal_": lambda lib: _fills(lib, "normal_", 1.0, 2.0),
    "Tensor.uniform_": lambda lib: _fills(lib, "uniform_", -1.0, 1.0),
    "Tensor.bernoulli_": lambda lib: _fills(lib, "bernoulli_", 0.3),
    "Tensor.exponential_": lambda lib: _fills(lib, "exponential_", 2.0),
    "Tensor.random_": lambda lib: _fills(lib, "random_", 0, 50),
    "init.normal_": lambda lib: _init(lib, "normal_", 0.0, 0.1),
    "init.uniform_": lambda lib: _init(lib, "uniform_", -0.5, 0.5),
    "init.trunc_normal_": lambda lib: _init(lib, "trunc_normal_", 0.0, 1.0, -1.0, 1.0),
    "init.xavier_uniform_": lambda lib: _init(lib, "xavier_uniform_"),
    "init.xavier_normal_": lambda lib: _init(lib, "xavier_normal_"),
    "init.kaiming_uniform_": lambda lib: _init(lib, "kaiming_uniform_"),
    "init.kaiming_normal_": lambda lib: _init(lib, "kaiming_normal_"),
    "init.orthogonal_": lambda lib: _init(lib, "orthogonal_"),
}


def _np(t):
    return t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_torch_takes_generator_there_too(name):
    ours = CALLS[name](mt)(mt.Generator().manual_seed(0))
    theirs = CALLS[name](torch)(torch.Generator().manual_seed(0))
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert str(ours.dtype).split(".")[-1] == str(theirs.dtype).split(".")[-1]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_same_seed_same_draws_and_the_default_stream_untouched(name):
    draw = CALLS[name](mt)
    mt.manual_seed(123)
    expected_default = mt.rand(4).numpy()
    mt.manual_seed(123)
    a = _np(draw(mt.Generator().manual_seed(7)))
    b = _np(draw(mt.Generator().manual_seed(7)))
    np.testing.assert_array_equal(a, b)
    # the default generator did not move
    np.testing.assert_array_equal(mt.rand(4).numpy(), expected_default)
    g = mt.Generator().manual_seed(7)
    draws = [_np(draw(g)) for _ in range(4)]
    assert any(not np.array_equal(draws[0], d) for d in draws[1:]), "the stream advances"
    others = [_np(draw(mt.Generator().manual_seed(s))) for s in (8, 9, 10)]
    assert any(not np.array_equal(a, o) for o in others), "another seed, other draws"


@pytest.mark.parametrize("name", sorted(CALLS))
def test_without_generator_the_default_one_is_used(name):
    draw = CALLS[name](mt)
    mt.manual_seed(5)
    a = _np(draw(None))
    mt.default_generator.manual_seed(5)
    b = _np(draw(None))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, _np(draw(mt.default_generator.manual_seed(5))))


def test_two_generators_are_independent():
    g1, g2 = mt.Generator().manual_seed(1), mt.Generator().manual_seed(2)
    alone1 = [mt.randn(3, generator=g1).numpy() for _ in range(3)]
    alone2 = [mt.randn(3, generator=g2).numpy() for _ in range(3)]
    g1.manual_seed(1)
    g2.manual_seed(2)
    for k in range(3):                          # interleaved, and the default drawn from too
        np.testing.assert_array_equal(mt.randn(3, generator=g1).numpy(), alone1[k])
        mt.randn(5)
        np.testing.assert_array_equal(mt.randn(3, generator=g2).numpy(), alone2[k])


def test_state_round_trip_and_seeds_as_torch():
    for lib in (mt, torch):
        g = lib.Generator()
        assert g.manual_seed(11) is g
        assert g.initial_seed() == 11
        state = g.get_state()
        assert state.dtype == lib.uint8 and state.ndim == 1
        first = lib.rand(5, generator=g)
        g.set_state(state)
        np.testing.assert_array_equal(lib.rand(5, generator=g).numpy(), first.numpy())
        s = g.seed()
        assert isinstance(s, int) and g.initial_seed() == s
        assert lib.manual_seed(3) is lib.default_generator
        assert isinstance(lib.default_generator, lib.Generator)
        assert lib.initial_seed() == 3
        s = lib.seed()
        assert isinstance(s, int) and lib.initial_seed() == s
        assert g.manual_seed(-1).initial_seed() == 2 ** 64 - 1      # wraps, as torch


def test_default_generator_state_is_the_core_stream():
    mt.manual_seed(0)
    state = mt.default_generator.get_state()
    a = mt.randn(4).numpy()
    mt.default_generator.set_state(state)
    np.testing.assert_array_equal(mt.randn(4).numpy(), a)
    saved = mt.get_rng_state()                      # the checkpoint form: the same stream
    b = mt.randn(4).numpy()
    mt.set_rng_state(saved)
    np.testing.assert_array_equal(mt.randn(4, generator=mt.default_generator).numpy(), b)


def test_bad_generators_and_states_are_refused():
    with pytest.raises(TypeError, match="mt.Generator"):
        mt.randn(2, generator=torch.Generator())
    with pytest.raises(TypeError, match="mt.Generator"):
        mt.zeros(2).normal_(generator=3)
    with pytest.raises(TypeError, match="mt.Generator"):
        mt.bernoulli(mt.full((2,), 0.5), generator=np.random.default_rng())
    with pytest.raises(TypeError, match="uint8"):
        mt.Generator().set_state(mt.zeros(3))
    with pytest.raises(RuntimeError, match="not a generator state"):
        mt.Generator().set_state(mt.tensor([1, 2, 3], dtype=mt.uint8))
    with pytest.raises(RuntimeError):
        mt.Generator(device="cuda")


def test_dropout_takes_no_generator_in_torch_nor_here():
    for lib in (mt, torch):
        with pytest.raises(TypeError):
            lib.nn.functional.dropout(lib.ones(4), 0.5, generator=None)


# ---- multinomial(replacement=) ------------------------------------------------------

def test_multinomial_without_replacement_draws_distinct_indices():
    g = mt.Generator().manual_seed(0)
    p = mt.tensor([[0.05, 0.0, 0.5, 0.3, 0.15], [1.0, 1.0, 1.0, 1.0, 1.0]])
    for k in range(1, 6):
        out = mt.multinomial(p, k, generator=g).numpy()
        assert out.shape == (2, k) and out.dtype == np.int64
        for row in out:
            assert len(set(row.tolist())) == k
    # the positive categories come before the zero one, as torch's (the zero one last)
    for _ in range(20):
        assert mt.multinomial(p[0], 5, generator=g).numpy()[-1] == 1
        assert torch.multinomial(torch.tensor(p[0].numpy()), 5).numpy()[-1] == 1


def test_multinomial_frequencies():
    g = mt.Generator().manual_seed(1)
    p = np.array([0.1, 0.2, 0.3, 0.4])
    probs = mt.tensor(np.tile(p, (20000, 1)))
    first = mt.multinomial(probs, 2, generator=g).numpy()
    np.testing.assert_allclose(np.bincount(first[:, 0], minlength=4) / 20000, p, atol=0.015)
    # the second index without replacement: P(j second) = sum_i p_i p_j / (1 - p_i)
    second = sum(p[i] * p / (1 - p[i]) * (np.arange(4) != i) for i in range(4))
    np.testing.assert_allclose(np.bincount(first[:, 1], minlength=4) / 20000, second,
                               atol=0.015)
    many = mt.multinomial(mt.tensor(p), 40000, replacement=True, generator=g).numpy()
    np.testing.assert_allclose(np.bincount(many, minlength=4) / 40000, p, atol=0.015)


@pytest.mark.parametrize("probs, n, replacement", [
    ([0.2, 0.8], 3, False),          # more samples than categories
    ([0.2, -0.1, 0.9], 1, True),     # a negative probability
    ([0.2, float("nan")], 1, True),
    ([0.0, 0.0], 1, False),          # nothing to draw
    ([0.5, 0.5], 0, True),
    ([[[0.5, 0.5]]], 1, True),       # 3-D
])
def test_multinomial_errors_as_torch(probs, n, replacement):
    with pytest.raises(RuntimeError) as theirs:
        torch.multinomial(torch.tensor(probs), n, replacement)
    with pytest.raises(RuntimeError) as ours:
        mt.multinomial(mt.tensor(probs), n, replacement)
    assert str(ours.value).split(",")[0] == str(theirs.value).split(",")[0]


# ---- asking for the seed changes nothing; every state form goes everywhere -----------

_FRESH = """
import sys
import numpy as np
sys.path.insert(0, {root!r})
import {lib} as lib
{pre}
a = lib.randn(6).numpy()
s = lib.initial_seed()
assert s == lib.initial_seed() == lib.default_generator.initial_seed()
lib.manual_seed(lib.initial_seed())
b = lib.randn(6).numpy()
lib.manual_seed(s)
c = lib.randn(6).numpy()
print(int(np.array_equal(a, b)), int(np.array_equal(a, c)))
"""

PRE = {"nothing": "", "asked_first": "lib.initial_seed()",
       "state_read": "lib.default_generator.get_state(); lib.get_rng_state()"}


@pytest.mark.parametrize("pre", sorted(PRE))
@pytest.mark.parametrize("lib", ["microtensor", "torch"])
def test_initial_seed_in_a_fresh_process_does_not_reseed(lib, pre):
    """torch: the stream a fresh process draws from is the one initial_seed() names."""
    import os
    import subprocess
    import sys
    # the microtensor this process imported (an installed one in CI, where the source
    # folder at the root is unbuilt), not the repository root
    root = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))
    code = _FRESH.format(root=root, lib=lib, pre=PRE[pre])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_initial_seed_is_the_seed_of_every_generator_without_reseeding():
    for lib in (mt, torch):
        for g in (lib.Generator(), lib.Generator().manual_seed(21)):
            s = g.initial_seed()
            a = lib.rand(5, generator=g).numpy()
            assert g.initial_seed() == s                   # asking again: the same, no reseed
            b = lib.rand(5, generator=g).numpy()
            g.manual_seed(s)
            np.testing.assert_array_equal(lib.rand(5, generator=g).numpy(), a)
            np.testing.assert_array_equal(lib.rand(5, generator=g).numpy(), b)
        lib.manual_seed(7)
        x = lib.rand(3).numpy()
        assert lib.initial_seed() == 7
        y = lib.rand(3).numpy()
        lib.manual_seed(lib.initial_seed())
        np.testing.assert_array_equal(lib.rand(3).numpy(), x)
        np.testing.assert_array_equal(lib.rand(3).numpy(), y)


def _state_forms():
    """name -> () -> a state of the stream as it is now, in each form handed out."""
    return {
        "mt.get_rng_state": lambda: mt.get_rng_state(),
        "default_generator.get_state": lambda: mt.default_generator.get_state(),
        "Generator.get_state": lambda: _copy_default_into_a_generator().get_state(),
        "bytes": lambda: mt.get_rng_state().encode(),
        "dict": lambda: __import__("json").loads(mt.get_rng_state()),
    }


def _copy_default_into_a_generator():
    g = mt.Generator()
    g.set_state(mt.default_generator.get_state())
    return g


SETTERS = {
    "mt.set_rng_state": lambda st: (mt.set_rng_state(st), lambda: mt.randn(5))[1],
    "default_generator.set_state": lambda st: (mt.default_generator.set_state(st),
                                               lambda: mt.randn(5))[1],
    "Generator.set_state": lambda st: (lambda g: (g.set_state(st),
                                                  lambda: mt.randn(5, generator=g))[1])(
        mt.Generator().manual_seed(99)),
}


@pytest.mark.parametrize("setter", sorted(SETTERS))
@pytest.mark.parametrize("form", sorted(_state_forms()))
def test_every_state_form_round_trips_through_every_setter(form, setter):
    mt.manual_seed(1234)
    mt.randn(3)
    state = _state_forms()[form]()
    want = mt.randn(5).numpy()
    mt.randn(7)                                        # move the stream on
    draw = SETTERS[setter](state)
    np.testing.assert_array_equal(draw().numpy(), want)


@pytest.mark.parametrize("put", ["set_rng_state", "default_generator.set_state",
                                 "Generator.set_state"])
@pytest.mark.parametrize("get", ["get_rng_state", "default_generator.get_state"])
def test_torch_accepts_its_state_forms_interchangeably_too(get, put):
    """The oracle: torch's forms go into each of torch's setters."""
    torch.manual_seed(5)
    state = torch.get_rng_state() if get == "get_rng_state" else \
        torch.default_generator.get_state()
    want = torch.rand(4)
    torch.rand(9)
    if put == "Generator.set_state":
        g = torch.Generator()
        g.set_state(state)
        assert torch.equal(torch.rand(4, generator=g), want)
    else:
        (torch.set_rng_state if put == "set_rng_state" else torch.default_generator.set_state)(
            state)
        assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("bad,error,match", [
    (3, TypeError, "generator state"), ([1, 2], TypeError, "generator state"),
    ("not json", RuntimeError, "not a generator state"),
    ({"bit_generator": "Nope"}, RuntimeError, "not a generator state"),
])
def test_a_bad_state_names_the_problem_in_every_setter(bad, error, match):
    for put in (mt.set_rng_state, mt.default_generator.set_state, mt.Generator().set_state):
        with pytest.raises(error, match=match):
            put(bad)
