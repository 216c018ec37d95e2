"""F.linear takes what torch 2.13 takes, and its one-row path (a gemv per slice of the
output features, kernels/_gemv.pyx) gives the product.

torch's F.linear has two paths, and they accept different bias shapes: a bias goes into
an addmm on the input flattened to (M, in) when the input is 2-D, or contiguous with a
bias that is 1-D or has one dim that is not 1 (it must then expand to (M, out)); else
the product is made and the bias added in place (it must broadcast to the output
without growing it). A 1-D weight (in,) gives x @ w with the last dim dropped. The
table below is compared with torch case by case: the same cases accepted, the same
output, the same gradients (the bias's summed back to its own shape).
"""
import itertools

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _gemv

torch = pytest.importorskip("torch")
TF = torch.nn.functional


# (input shape, weight shape, bias shape or None, input contiguous?)
CASES = [
    ((3, 5), (4, 5), None, True),                 # the common path
    ((3, 5), (4, 5), (4,), True),
    ((2, 3, 5), (4, 5), (4,), True),
    ((2, 3, 5), (4, 5), (4,), False),
    ((5,), (4, 5), (4,), True),
    ((3, 5), (4, 5), (), True),                   # 0-D bias
    ((2, 3, 5), (4, 5), (), True),
    ((3, 5), (4, 5), (1,), True),                 # (1,) bias
    ((2, 3, 5), (4, 5), (1,), True),
    ((5,), (4, 5), (1,), True),
    ((3, 5), (4, 5), (3, 4), True),               # (N, out) bias, N the rows
    ((3, 5), (4, 5), (3, 1), True),
    ((3, 5), (4, 5), (1, 4), True),
    ((3, 5), (4, 5), (1, 1), True),
    ((2, 3, 5), (4, 5), (3, 4), True),            # broadcast over the leading dim
    ((2, 3, 5), (4, 5), (2, 3, 4), True),
    ((2, 3, 5), (4, 5), (2, 1, 4), True),
    ((2, 3, 5), (4, 5), (1, 1), True),
    ((2, 3, 5), (4, 5), (3, 1), False),           # the in-place add path takes it...
    ((2, 1, 3, 5), (4, 5), (3, 4), True),
    ((5,), (4, 5), (1, 4), True),
    ((5,), (5,), None, True),                     # 1-D weight: x @ w
    ((3, 5), (5,), None, True),
    ((2, 3, 5), (5,), None, True),
    ((2, 3, 5), (5,), (), True),
    ((2, 3, 5), (5,), (2, 3), True),
    ((2, 3, 5), (5,), (1, 1), True),
    ((2, 3, 5), (5,), (3,), False),               # ...where the contiguous one is refused
    ((2, 3, 5), (1, 5), (1,), True),              # one output feature
    ((4, 0), (3, 0), (3,), True),                 # empty inner dim: the bias alone
    ((0, 5), (3, 5), (3,), True),                 # no rows
]

# torch refuses these: so must microtensor, as the project's shape error (a RuntimeError)
REFUSED = [
    ((2, 3, 5), (4, 5), (3, 1), True),            # ...the flattened addmm path does not
    ((3, 5), (4, 5), (2, 3, 4), True),            # addmm: at most 2-D
    ((3, 5), (4, 5), (4, 1), True),
    ((3, 5), (4, 5), (5,), True),
    ((5,), (4, 5), (3, 4), True),                 # would grow the output
    ((5,), (4, 5), (1, 1), True),
    ((2, 1, 3, 5), (4, 5), (2, 3, 4), True),
    ((3, 5), (5,), (), True),                     # 2-D input, 1-D weight, a bias: addmm
    ((5,), (5,), (1,), True),                     # 1-D bias with a 1-D weight: addmm
    ((2, 3, 5), (5,), (3,), True),
    ((5,), (), None, True),                       # 0-D weight
    ((), (4,), None, True),                       # 0-D input
    ((3, 5), (4, 6), None, True),                 # in_features differ
    ((3, 5), (2, 4, 5), None, True),              # 3-D weight
]


def _arrays(xs, ws, bs, contiguous, seed=0):
    rng = np.random.default_rng(seed)
    if contiguous or len(xs) < 2:
        x = rng.standard_normal(xs)
    else:  # the same shape, laid out in reverse (a transposed view)
        x = rng.standard_normal(xs[::-1]).transpose(tuple(range(len(xs)))[::-1])
    x = np.asarray(x)
    w = np.asarray(rng.standard_normal(ws))
    b = None if bs is None else np.asarray(rng.standard_normal(bs))
    return x, w, b


def _torch_linear(x, w, b):
    return TF.linear(torch.from_numpy(x), torch.from_numpy(w),
                     None if b is None else torch.from_numpy(b))


def _mt(a, requires_grad=False):
    return None if a is None else mt.tensor(a, requires_grad=requires_grad) if requires_grad \
        else mt.from_numpy(a)


def test_the_table_is_torchs():
    """Each case in CASES is accepted by torch, each in REFUSED refused (so a change in
    torch shows here, not as a silent difference)."""
    for xs, ws, bs, contiguous in CASES:
        _torch_linear(*_arrays(xs, ws, bs, contiguous))
    for xs, ws, bs, contiguous in REFUSED:
        with pytest.raises(RuntimeError):
            _torch_linear(*_arrays(xs, ws, bs, contiguous))


@pytest.mark.parametrize("xs,ws,bs,contiguous", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_equals_torch(xs, ws, bs, contiguous, dtype):
    x, w, b = (None if a is None else a.astype(dtype) for a in _arrays(xs, ws, bs, contiguous))
    if not contiguous and x.ndim >= 2:        # astype made it contiguous again
        x = np.ascontiguousarray(x.transpose(tuple(range(x.ndim))[::-1])).transpose(
            tuple(range(x.ndim))[::-1])
    expected = _torch_linear(x, w, b).numpy()
    got = F.linear(_mt(x), _mt(w), _mt(b)).numpy()
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("xs,ws,bs,contiguous", REFUSED)
def test_refused_as_torch_refuses(xs, ws, bs, contiguous):
    x, w, b = _arrays(xs, ws, bs, contiguous)
    with pytest.raises(RuntimeError) as info:
        F.linear(_mt(x), _mt(w), _mt(b))
    assert isinstance(info.value, mt.ShapeError)       # ValueError and RuntimeError both
    assert "linear" in str(info.value)


@pytest.mark.parametrize("xs,ws,bs,contiguous", [c for c in CASES if 0 not in c[0] + c[1]])
def test_gradients_equal_torchs(xs, ws, bs, contiguous):
    """dx, dW and db (summed back to the bias's own shape) against torch's, with a
    random upstream gradient (all ones hides a transposed rule)."""
    x, w, b = _arrays(xs, ws, bs, contiguous, seed=1)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = None if b is None else torch.tensor(b, requires_grad=True)
    if not contiguous and x.ndim >= 2:
        tx = torch.from_numpy(x).requires_grad_(True)     # the same strides as x
    ty = TF.linear(tx, tw, tb)
    upstream = np.random.default_rng(2).standard_normal(tuple(ty.shape))
    ty.backward(torch.from_numpy(upstream))
    mx, mw = mt.tensor(x, requires_grad=True), mt.tensor(w, requires_grad=True)
    if not contiguous and x.ndim >= 2:
        mx = mt.from_numpy(x).requires_grad_(True)
    mb = None if b is None else mt.tensor(b, requires_grad=True)
    F.linear(mx, mw, mb).backward(mt.from_numpy(upstream))
    np.testing.assert_allclose(mx.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert mw.grad.shape == tuple(ws)
    np.testing.assert_allclose(mw.grad.numpy(), tw.grad.numpy(), rtol=1e-12, atol=1e-12)
    if b is not None:
        assert mb.grad.shape == tuple(bs)
        np.testing.assert_allclose(mb.grad.numpy(), tb.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xs,ws,bs,contiguous", [
    ((3, 5), (4, 5), (3, 1), True), ((2, 3, 5), (4, 5), (2, 1, 4), True),
    ((2, 3, 5), (5,), (2, 3), True), ((5,), (4, 5), (1, 4), True), ((2, 3, 5), (4, 5), (), True),
    ((3, 5), (4, 5), (4,), True), ((1, 5), (4, 5), (4,), True),
    # a bias of the output's own shape (its gradient is the upstream one itself)
    ((5,), (4, 5), (4,), True), ((2, 3, 5), (4, 5), (2, 3, 4), True)])
def test_gradcheck_and_gradgradcheck(xs, ws, bs, contiguous):
    x, w, b = _arrays(xs, ws, bs, contiguous, seed=3)
    inputs = [mt.tensor(a, requires_grad=True) for a in (x, w, b)]
    assert mt.gradcheck(F.linear, inputs)
    assert mt.gradgradcheck(F.linear, inputs)


def test_a_wrong_bias_gradient_fails_the_check(monkeypatch):
    """The negative test: a bias gradient not summed over the broadcast axis is caught."""
    from microtensor.ops import layers
    x, w, b = _arrays((3, 5), (4, 5), (3, 1), True, seed=4)
    # the planted bug: the rule hands back the first elements of g, already in the bias's
    # shape, instead of g in the broadcast shape that the engine sums
    right = layers.LinearBackward.backward

    def wrong(node, g):
        dx, dw, db = right(node, g)
        if db is not None:
            shape = node.bias_shape
            db = np.ascontiguousarray(db).reshape(-1)[:int(np.prod(shape))].reshape(shape)
        return (dx, dw, db)
    monkeypatch.setattr(layers.LinearBackward, "backward", wrong)
    inputs = [mt.tensor(a, requires_grad=True) for a in (x, w, b)]
    assert not mt.gradcheck(F.linear, inputs, raise_exception=False)


# ---- the one-row path: gemv on slices of the weight's rows ------------------------------

GEMV_PARALLEL_MIN = 1 << 17        # kernels/_gemv.pyx's _PARALLEL_MIN (weight elements)


@pytest.fixture
def threads():
    before = mt.get_num_threads()
    yield mt.set_num_threads
    mt.set_num_threads(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_features", [1031, 17, 4099])   # prime: no thread count divides it
def test_gemv_threads_equal_one_thread_and_numpy(threads, dtype, rows, out_features):
    """Above the threshold, split over 2 and 3 threads at sizes that do not divide: every
    output feature written, the same bits as one thread, the float64 product's value."""
    K = GEMV_PARALLEL_MIN // out_features + 7 if out_features > 64 else 33
    rng = np.random.default_rng(5)
    w = rng.standard_normal((out_features, K)).astype(dtype)
    x = rng.standard_normal((rows, K)).astype(dtype)
    b = rng.standard_normal(out_features).astype(dtype)
    expected = x.astype(np.float64) @ w.T.astype(np.float64) + b
    results = []
    for n in (1, 2, 3):
        threads(n)
        got = _gemv.gemv(w, x, bias=b, num_threads=n)
        assert got.shape == (rows, out_features)
        tol = 1e-4 if dtype == np.float32 else 1e-11
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * np.sqrt(K))
        results.append(got)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemv_reads_a_transposed_weight_in_place(threads, dtype):
    """A weight that is the transposed view of an (in, out) array (a Conv1D layout) is
    read as it lies (gemv 'N'), split over threads as the other layout is."""
    rng = np.random.default_rng(6)
    storage = rng.standard_normal((263, 1031)).astype(dtype)     # (in, out)
    w = storage.T                                                # (out, in), a view
    x = rng.standard_normal((1, 263)).astype(dtype)
    expected = x.astype(np.float64) @ storage.astype(np.float64)
    for n in (1, 2):
        threads(n)
        np.testing.assert_allclose(_gemv.gemv(w, x, num_threads=n), expected,
                                   rtol=1e-4 if dtype == np.float32 else 1e-11, atol=1e-3)


def test_gemv_vector_edges_and_errors():
    w = np.ones((3, 4), np.float32)
    assert _gemv.gemv(w, np.ones(4, np.float32)).shape == (3,)
    np.testing.assert_array_equal(_gemv.gemv(np.ones((3, 0), np.float32), np.ones((1, 0), np.float32),
                                              bias=np.arange(3, dtype=np.float32)), [[0, 1, 2]])
    assert _gemv.gemv(np.ones((0, 4), np.float32), np.ones((1, 4), np.float32)).shape == (1, 0)
    with pytest.raises(ValueError):
        _gemv.gemv(w, np.ones(5, np.float32))
    with pytest.raises(TypeError):
        _gemv.gemv(w, np.ones(4, np.float64))
    with pytest.raises(ValueError):
        _gemv.gemv(w, np.ones(4, np.float32), bias=np.ones(4, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2])
def test_linear_one_row_equals_torch_and_many_rows(threads, dtype, n):
    """F.linear of one row (the gemv path, threaded: 2 * 1031 * 263 weights) equals torch
    and the same row inside a batch (the gemm path) within float tolerance; its
    gradients come from the same backward."""
    threads(n)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((1031, 263)).astype(dtype)
    b = rng.standard_normal(1031).astype(dtype)
    xs = rng.standard_normal((5, 263)).astype(dtype)
    one = F.linear(mt.from_numpy(xs[2:3]), mt.from_numpy(w), mt.from_numpy(b)).numpy()
    many = F.linear(mt.from_numpy(xs), mt.from_numpy(w), mt.from_numpy(b)).numpy()
    ref = TF.linear(torch.from_numpy(xs[2:3]), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(one, ref, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(one[0], many[2], rtol=tol, atol=tol * 10)
    # (1, 1, in): generation's shape
    three_d = F.linear(mt.from_numpy(xs[None, 2:3]), mt.from_numpy(w), mt.from_numpy(b)).numpy()
    np.testing.assert_array_equal(three_d[0], one)


def test_linear_one_row_gradcheck():
    x, w, b = _arrays((1, 40), (37, 40), (37,), True, seed=8)
    inputs = [mt.tensor(a, requires_grad=True) for a in (x, w, b)]
    assert mt.gradcheck(F.linear, inputs)


@pytest.mark.parametrize("xs,ws,bs", [((3, 5), (4, 5), (4,)), ((1, 5), (4, 5), None)])
def test_the_common_path_keeps_its_node(xs, ws, bs):
    """A 2-D weight with a (out,) bias or none stays on the common path: the bias's
    gradient is the column sum (no broadcast bookkeeping)."""
    x, w, b = _arrays(xs, ws, bs, True)
    y = F.linear(mt.tensor(x, requires_grad=True), mt.tensor(w, requires_grad=True), _mt(b))
    assert y.grad_fn.bias_against is None
