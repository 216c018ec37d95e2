"""F ops where torch's behaviour is more than its formula, each against torch 2.13:
dropout's inplace=True (the input changed, its version counted, autograd as torch's),
cosine_similarity's norms (each clamped at eps on its own, after broadcasting, the
gradient passed through the clamp as torch's no-grad clamp does)."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("one_thread")
RNG = np.random.default_rng(41)


def leaf(a, requires_grad=True):
    return mt.tensor(np.array(a), requires_grad=requires_grad)


# ---- dropout(inplace=True) --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (5, 13), (3, 4, 33)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inplace_dropout_changes_the_input_and_returns_it(shape, dtype):
    a = RNG.standard_normal(shape).astype(dtype) + 3          # no zeros of its own
    x = mt.tensor(a.copy())
    before = x._version
    mt.manual_seed(3)
    y = F.dropout(x, 0.4, training=True, inplace=True)
    assert y is x
    assert x._version == before + 1                          # torch counts one change
    mt.manual_seed(3)
    expected = F.dropout(mt.tensor(a), 0.4).numpy()          # the same mask out of place
    np.testing.assert_array_equal(x.numpy(), expected)
    assert (x.numpy() == 0).any() and (x.numpy() != 0).any()
    kept = x.numpy() != 0
    np.testing.assert_allclose(x.numpy()[kept], a[kept] / np.asarray(0.6, dtype),
                               rtol=1e-6 if dtype == np.float32 else 1e-15)


def test_inplace_dropout_writes_through_a_strided_view():
    base = mt.tensor(RNG.standard_normal((6, 8)) + 3)
    column = base[:, 1::3]                                    # a non-contiguous view
    original = base.numpy().copy()
    out = F.dropout(column, 0.5, inplace=True)
    assert out is column
    np.testing.assert_array_equal(base.numpy()[:, 1::3], column.numpy())   # base sees it
    untouched = np.ones(base.shape, bool)
    untouched[:, 1::3] = False
    np.testing.assert_array_equal(base.numpy()[untouched], original[untouched])
    assert base._version == 1                                 # views share the counter


def test_inplace_dropout_p_edges_and_eval_as_torch():
    for p, training in [(0.0, True), (0.5, False), (1.0, True)]:
        x, tx = mt.ones(5), torch.ones(5)
        y, ty = F.dropout(x, p, training, inplace=True), TF.dropout(tx, p, training, inplace=True)
        assert y is x and ty is tx
        assert x._version == tx._version, (p, training)
        np.testing.assert_array_equal(x.numpy(), tx.numpy())


def test_inplace_dropout_refuses_a_leaf_that_requires_grad_as_torch():
    x, tx = leaf([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        TF.dropout(tx, 0.5, True, True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.dropout(x, 0.5, True, True)
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0, 3.0])            # left as it was
    assert x._version == 0
    with mt.no_grad():                                        # allowed there, as in torch
        assert F.dropout(x, 0.5, True, True) is x
    assert x._version == 1


def test_inplace_dropout_refuses_read_only_storage():
    x = mt.ones(3).expand(4, 3)
    with pytest.raises(RuntimeError, match="read-only"):
        F.dropout(x, 0.5, inplace=True)


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_inplace_dropout_on_a_watched_non_leaf_is_refused_not_wrong(p):
    """torch records dropout_ in its graph; this engine records no in-place op, and a node
    that read h before the dropout without saving it (h + 1) would take its gradient through
    the mask. So it refuses, naming what to write instead, and leaves h as it was."""
    w = leaf(RNG.standard_normal((4, 9)))
    h = w * 2.0
    before = h.numpy().copy()
    y = h + 1.0
    with pytest.raises(RuntimeError, match="inplace=False"):
        F.dropout(h, p, inplace=True)
    np.testing.assert_array_equal(h.numpy(), before)
    assert h._version == 0
    (y + h).sum().backward()                                      # the graph is intact
    np.testing.assert_array_equal(w.grad.numpy(), np.full((4, 9), 4.0))
    with mt.no_grad():                                            # unwatched: in place
        assert F.dropout(h, p, inplace=True) is h
    assert h._version == 1


# ---- cosine_similarity ------------------------------------------------------------------

COSINE_CASES = {
    # name: (x1 shape, x2 shape, dim)
    "rows": ((5, 7), (5, 7), 1),
    "dim0": ((6, 3), (6, 3), 0),
    "broadcast_rows": ((1, 7), (5, 7), 1),
    "broadcast_along_dim": ((1, 3), (4, 3), 0),   # the norm counts x1's four copies
    "broadcast_3d": ((2, 1, 5), (3, 5), -1),
    "vectors": ((9,), (9,), 0),
}


def _cosine_pair(name, scale1, scale2, dtype):
    s1, s2, dim = COSINE_CASES[name]
    a = (RNG.standard_normal(s1) * scale1).astype(dtype)
    b = (RNG.standard_normal(s2) * scale2).astype(dtype)
    return a, b, dim


def _torch_cosine(a, b, dim, g, eps=1e-8):
    ta = torch.tensor(a, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    out = TF.cosine_similarity(ta, tb, dim=dim, eps=eps)
    out.backward(torch.tensor(g))
    return out.detach().numpy(), ta.grad.numpy(), tb.grad.numpy()


# (scale of x1, scale of x2): ordinary, tiny (norms far below 1 but above eps, their
# product below it), huge (1e150: a product of norms that overflows float64; in float32
# the squares overflow, as in torch), and below eps (the clamp itself)
SCALES = [(1.0, 1.0), (1.3e-5, 1.0), (1.3e-5, 2e-5), (1e18, 3e17), (1e150, 1e151),
          (1e-20, 1.0), (3e-9, 1e-9)]


@pytest.mark.parametrize("dtype,scales", [
    pytest.param(dtype, s, id=f"{dtype.__name__}-{s[0]:g}x{s[1]:g}")
    for dtype in (np.float32, np.float64) for s in SCALES
    if dtype == np.float64 or max(s) < 1e30])            # float32 holds no 1e150
@pytest.mark.parametrize("name", sorted(COSINE_CASES))
def test_cosine_similarity_matches_torch(name, scales, dtype):
    a, b, dim = _cosine_pair(name, *scales, dtype)
    x1, x2 = leaf(a), leaf(b)
    out = F.cosine_similarity(x1, x2, dim=dim)
    g = RNG.standard_normal(out.shape).astype(dtype)
    out.backward(mt.tensor(g))
    t_out, t_g1, t_g2 = _torch_cosine(a, b, dim, g)
    assert out.shape == t_out.shape
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(out.numpy(), t_out, **tol)
    for ours, theirs, x in ((x1.grad.numpy(), t_g1, a), (x2.grad.numpy(), t_g2, b)):
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
        # the gradient's natural size is |g| / ||x||: where it cancels to rounding noise
        # (x1 broadcast along dim has none), the noise is compared at that size
        finite = np.isfinite(theirs)
        scale = max(np.abs(theirs[finite]).max(initial=0),
                    1 / max(float(np.linalg.norm(x.astype(np.float64))), 1e-8))
        np.testing.assert_allclose(ours[finite] / scale, theirs[finite] / scale, **tol)


def test_cosine_similarity_parallel_tiny_vectors_give_one():
    """The product of two norms of 2.2e-5 is below eps = 1e-8: clamping the product
    gave 0.15; each norm clamped on its own leaves them above eps, as torch."""
    a = np.full((1, 3), 2.2e-5 / np.sqrt(3), np.float32)
    ours = F.cosine_similarity(mt.tensor(a), mt.tensor(a)).numpy()
    theirs = TF.cosine_similarity(torch.tensor(a), torch.tensor(a)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(ours, 1.0, rtol=1e-6)


def test_cosine_similarity_gradchecks():
    for name in COSINE_CASES:
        a, b, dim = _cosine_pair(name, 1.0, 1.0, np.float64)
        assert mt.gradcheck(lambda u, v: F.cosine_similarity(u, v, dim=dim), (leaf(a), leaf(b)))
    # a norm below eps: the clamp's value, the norm's own gradient (as torch)
    a, b, dim = _cosine_pair("rows", 1e-10, 1.0, np.float64)
    out = F.cosine_similarity(leaf(a), leaf(b), dim=dim, eps=1e-8)
    assert np.abs(out.numpy()).max() < 0.1


def test_cosine_similarity_refuses_shapes_that_do_not_broadcast():
    with pytest.raises(RuntimeError):
        TF.cosine_similarity(torch.ones(2, 3), torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="broadcast"):
        F.cosine_similarity(mt.ones(2, 3), mt.ones(3, 3))


def test_nn_dropout_passes_inplace_on():
    x = mt.ones(1000)
    with mt.no_grad():
        y = mt.nn.Dropout(0.5, inplace=True)(x)
    assert y is x and x._version == 1 and (x.numpy() == 0).any()
    x = mt.ones(1000)
    y = mt.nn.Dropout(0.5)(x)
    assert y is not x and (x.numpy() == 1).all()


@pytest.mark.parametrize("data", [1e-9, [1e-9, 1 / 3], [[0.1, 1e-300], [3.3e38 * 2, -1e-45]],
                                  ((1e-9,),)])
def test_a_tensor_of_python_floats_asked_for_as_float64_keeps_every_digit(data):
    # torch builds the asked-for dtype straight from the Python floats
    got = mt.tensor(data, dtype=mt.float64).numpy()
    want = torch.tensor(data, dtype=torch.float64).numpy()
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float64
    # the default stays float32, as torch's (6.6e38 overflows to inf in both)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(mt.tensor(data).numpy(), torch.tensor(data).numpy())
