"""How a leaf's gradient reaches .grad: pieces that stay sparse (a slice's gradient, an
embedding's rows), dense gradients added in place when the engine owns a buffer, and the
first gradient taken over as .grad, not copied, when nothing else can reach it.

Taking a buffer over is only right when no one else holds it: the upstream gradient, an
array a rule hands two inputs, an array a custom Function keeps, a hook's, the gradient
passed to backward. Each of those must leave .grad a private copy: writing one must
never change the other."""
import itertools
import weakref

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

RNG = np.random.default_rng(0)
V, D = 7, 3


def _pieces():
    """Ways a (V, D) leaf is used, each as (make(W) -> a scalar term, its gradient in W)."""
    ids = np.array([2, 5, 2, 0, 2])                       # a repeated id adds up
    up_rows = RNG.standard_normal((len(ids), D))
    h = RNG.standard_normal((4, D))
    up_lin = RNG.standard_normal((4, V))
    c = RNG.standard_normal((V, D))

    def rows_grad():
        g = np.zeros((V, D))
        np.add.at(g, ids, up_rows)
        return g

    def slice_grad():
        g = np.zeros((V, D))
        g[1:4] = c[1:4]
        return g

    return {
        # the embedding's gradient: rows only (a RowsGrad)
        "rows": (lambda W: (F.embedding(mt.tensor(ids), W) * mt.tensor(up_rows)).sum(),
                 rows_grad()),
        # a slice's gradient (a SliceGrad)
        "slice": (lambda W: (W[1:4] * mt.tensor(c[1:4])).sum(), slice_grad()),
        # a fresh dense gradient (linear's dW: g^T @ x, the tied lm_head)
        "dense_owned": (lambda W: (F.linear(mt.tensor(h), W) * mt.tensor(up_lin)).sum(),
                        up_lin.T @ h),
        # a dense gradient that is the upstream gradient itself (add's rule hands on g)
        "dense_shared": (lambda W: ((W + mt.tensor(c)) * mt.tensor(c)).sum(), c),
        # a fresh gradient that is read-only: mean's, a broadcast of one number
        "dense_readonly": (lambda W: W.mean() * 3.0, np.full((V, D), 3.0 / (V * D))),
    }


ORDERS = [p for r in (1, 2, 3, 4) for p in itertools.permutations(list(_pieces()), r)]


@pytest.mark.parametrize("accumulate", [False, True], ids=["first_backward", "into_grad"])
@pytest.mark.parametrize("order", ORDERS, ids=["+".join(o) for o in ORDERS])
def test_every_mix_of_pieces_sums_to_numpys(order, accumulate):
    """Every mix of sparse and dense, owned and shared gradients, in every order of
    arrival, on a first backward and into an existing .grad."""
    pieces = _pieces()
    W = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    want = sum(pieces[name][1] for name in order)
    if accumulate:
        before = RNG.standard_normal((V, D))
        W.grad = mt.tensor(before.copy())
        want = want + before
    loss = sum((pieces[name][0](W) for name in order), mt.tensor(0.0))
    loss.backward()
    np.testing.assert_allclose(W.grad.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", ORDERS, ids=["+".join(o) for o in ORDERS])
def test_every_mix_through_autograd_grad_and_a_hook(order):
    """The same mixes as autograd.grad returns them and as a hook sees them: dense, the
    leaf's whole shape."""
    pieces = _pieces()
    want = sum(pieces[name][1] for name in order)
    W = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    (g,) = mt.autograd.grad(sum((pieces[n][0](W) for n in order), mt.tensor(0.0)), [W])
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12, atol=1e-12)
    seen = []
    W.register_hook(lambda grad: seen.append(grad.numpy().copy()))
    sum((pieces[n][0](W) for n in order), mt.tensor(0.0)).backward()
    assert seen[0].shape == (V, D)
    np.testing.assert_allclose(seen[0], want, rtol=1e-12, atol=1e-12)


def test_embedding_of_a_non_leaf_weight():
    """An embedding whose table is an op's result: its rows reach that op densely."""
    P = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    ids = np.array([1, 1, 6])
    up = RNG.standard_normal((3, D))
    (F.embedding(mt.tensor(ids), P * 3.0) * mt.tensor(up)).sum().backward()
    want = np.zeros((V, D))
    np.add.at(want, ids, 3.0 * up)
    np.testing.assert_allclose(P.grad.numpy(), want, rtol=1e-12)


def test_tied_embedding_gradcheck():
    """GPT-2's tie: one table as the embedding and as the output projection, float64,
    central differences with a random upstream gradient."""
    W = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    ids = mt.tensor(np.array([3, 0, 3, 6]))
    up = mt.tensor(RNG.standard_normal((4, V)))
    assert mt.autograd.gradcheck(lambda w: F.linear(F.embedding(ids, w), w) * up, (W,))


def test_padding_rows_get_no_gradient_on_either_path():
    W = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    ids = mt.tensor(np.array([0, 2, 0, 4]))
    F.embedding(ids, W, padding_idx=0).sum().backward()
    want = np.zeros((V, D))
    want[[2, 4]] = 1
    np.testing.assert_array_equal(W.grad.numpy(), want)
    F.embedding(ids, W, padding_idx=0).sum().backward()    # into the existing .grad
    np.testing.assert_array_equal(W.grad.numpy(), 2 * want)


# ---- taking the first gradient over, only when nothing else holds it ---------------

def _doubling(keep):
    """A Function y = 2 x whose backward hands `keep` the array it returns."""
    class Double(mt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            out = g * 2.0
            keep(out.numpy())
            return out
    return Double


def test_a_fresh_gradient_becomes_grad_without_a_copy():
    made = []                                  # weakly: holding it would forbid the take-over
    x = mt.randn(1000, requires_grad=True)
    _doubling(lambda a: made.append(weakref.ref(a))).apply(x).sum().backward()
    array = made[0]()
    assert array is not None and np.shares_memory(array, x.grad.numpy())


def _write_grad_and_check(grad, other, what):
    before = np.array(other, copy=True)
    grad.numpy()[...] = 123.0
    np.testing.assert_array_equal(np.asarray(other), before,
                                  err_msg=f".grad shares memory with {what}")


def test_an_array_a_function_keeps_is_copied():
    kept = []
    x = mt.randn(5, requires_grad=True)
    _doubling(kept.append).apply(x).sum().backward()
    _write_grad_and_check(x.grad, kept[0], "an array the Function kept")


@pytest.mark.parametrize("how", ["same_array", "view_of_it", "two_views"])
def test_one_array_handed_to_two_inputs_is_copied(how):
    class Both(mt.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            buf = mt.tensor(np.ones((2, 3)) * 2.0)
            if how == "same_array":
                return buf, buf
            if how == "view_of_it":
                return buf, buf[:]
            return buf[:], buf[:]

    a = mt.randn(2, 3, requires_grad=True)
    b = mt.randn(2, 3, requires_grad=True)
    Both.apply(a, b).sum().backward()
    _write_grad_and_check(a.grad, b.grad.numpy(), "the other input's .grad")


def test_a_hooks_kept_gradient_is_not_grad():
    kept = []
    x = mt.randn(4, requires_grad=True)
    x.register_hook(lambda g: kept.append(g) or None)
    (x * 3.0).sum().backward()
    _write_grad_and_check(x.grad, kept[0].numpy(), "the array a hook kept")


def test_a_hooks_returned_gradient_is_not_grad():
    mine = mt.tensor(np.full(4, 5.0))
    x = mt.randn(4, requires_grad=True)
    x.register_hook(lambda g: mine)
    (x * 3.0).sum().backward()
    _write_grad_and_check(x.grad, mine.numpy(), "the tensor a hook returned")


def test_the_gradient_passed_to_backward_is_not_grad():
    seed = mt.tensor(np.ones(4))
    x = mt.randn(4, requires_grad=True, dtype=mt.float64)
    x.backward(seed)
    _write_grad_and_check(x.grad, seed.numpy(), "the gradient passed to backward")
    y = mt.randn(4, requires_grad=True, dtype=mt.float64)
    (y + 0.0).backward(seed)            # add hands the seed on as y's gradient
    _write_grad_and_check(y.grad, seed.numpy(), "the gradient passed to backward")


@pytest.mark.parametrize("op", ["add", "sub_of_neg", "sum_of_two_uses"])
def test_the_upstream_gradient_of_an_identity_is_not_grad(op):
    """add's rule hands its (fresh, writable) upstream gradient on to both inputs."""
    a = mt.randn(3, requires_grad=True)
    b = mt.randn(3, requires_grad=True)
    if op == "add":
        y = a + b
    elif op == "sub_of_neg":
        y = a - (-b)
    else:
        y = (a + a) + b
    (y * 2.0).sum().backward()
    _write_grad_and_check(a.grad, b.grad.numpy(), "the other input's .grad")


SPARSE_AND_SHARED = [p for p in itertools.permutations(["shared", "kept", "slice", "rows"])]


@pytest.mark.parametrize("order", SPARSE_AND_SHARED, ids=["+".join(o) for o in SPARSE_AND_SHARED])
def test_pieces_never_land_in_an_array_someone_else_holds(order):
    """W's sparse pieces are added into a copy of a gradient others hold (add's upstream,
    which X's .grad is made from; an array a custom Function keeps), never into it,
    whichever arrives first."""
    c = RNG.standard_normal((V, D))
    ids = np.array([1, 1, 4])
    W = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    X = mt.tensor(RNG.standard_normal((V, D)), requires_grad=True)
    kept = []
    terms = {"shared": lambda: ((W + X) * mt.tensor(c)).sum(),
             "kept": lambda: (_doubling(kept.append).apply(W) * mt.tensor(c)).sum(),
             "slice": lambda: W[2:5].sum(),
             "rows": lambda: F.embedding(mt.tensor(ids), W).sum()}
    sum((terms[name]() for name in order), mt.tensor(0.0)).backward()
    np.testing.assert_allclose(X.grad.numpy(), c, rtol=1e-12)
    np.testing.assert_allclose(kept[0], 2 * c, rtol=1e-12)
    want = 3 * c
    want[2:5] += 1
    np.add.at(want, ids, 1.0)
    np.testing.assert_allclose(W.grad.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("rows_dtype", [np.float64, np.float32])
def test_a_rule_s_rows_are_cast_to_the_leaf_and_checked_for_shape(rows_dtype):
    """A rule of one's own may hand on rows of another dtype (cast to the leaf's, as any
    gradient) or for another shape (an error that names both shapes)."""
    from microtensor.autograd.graph_rules import FusedNode
    core = mt.core._core

    class Rows(FusedNode):
        def backward(self, g):
            return (core.RowsGrad(np.array([1, 1, 3]), np.ones((3, 2), rows_dtype),
                                  self.shape, rows_dtype),)

    W = mt.randn(5, 2, requires_grad=True)                  # float32
    for shape, ok in (((5, 2), True), ((4, 2), False)):
        W.grad = None
        y, node = core.wrap(np.zeros(1, np.float32)), Rows()
        node.shape = shape
        core.attach(y, node, (W,))
        if not ok:
            with pytest.raises(RuntimeError, match=r"\(4, 2\).*\(5, 2\)"):
                y.backward(core.wrap(np.ones(1, np.float32)))
            continue
        y.backward(core.wrap(np.ones(1, np.float32)))
        want = np.zeros((5, 2), np.float32)
        want[1], want[3] = 2, 1
        assert W.grad.dtype == mt.float32
        np.testing.assert_array_equal(W.grad.numpy(), want)
