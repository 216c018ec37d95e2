"""unflatten (mt.unflatten, Tensor.unflatten, nn.Unflatten) against torch: every dim of
shapes with empty and size-1 dims, contiguous and transposed inputs, sizes that fit, that
infer one -1, and that do not fit (torch's exception class, or a subclass of it)."""
import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")

SHAPES = [(), (0,), (4,), (2, 3), (3, 4), (2, 0, 6), (1, 6, 2)]


def _sizes(n):
    return [(n,), (1, n), (n, 1), (-1,), (1, -1), (-1, 1), (n + 1,), (2, -1), (-1, -1),
            (0, -1), (3, -1), (True,), ()]


def _run(lib, array, transposed, dim, sizes):
    x = lib.tensor(array)
    if transposed and x.ndim >= 2:
        x = x.transpose(0, 1)
    return x.unflatten(dim, sizes)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unflatten_matches_torch(shape, transposed):
    rng = np.random.default_rng(0)
    array = rng.standard_normal(shape)
    nd = len(shape)
    for dim in range(-nd - 1, nd + 1) if nd else (-1, 0, 1):
        n = shape[dim] if -nd <= dim < nd else 1
        for sizes in _sizes(n):
            try:
                want = _run(torch, array, transposed, dim, sizes)
            except Exception as e:          # torch refuses: so must microtensor, alike
                with pytest.raises(type(e)):
                    _run(mt, array, transposed, dim, sizes)
                continue
            got = _run(mt, array, transposed, dim, sizes)
            assert tuple(got.shape) == tuple(want.shape), (dim, sizes)
            if array.size:          # (torch.tensor gives an empty array strides of 0)
                assert got.stride() == want.stride(), (dim, sizes)
            np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_unflatten_is_a_view_with_a_gradient():
    x = mt.randn(3, 4, dtype=mt.float64, requires_grad=True)
    y = x.unflatten(1, (2, -1))
    assert y.shape == (3, 2, 2) and np.shares_memory(y.numpy(), x.detach().numpy())
    up = mt.randn(3, 2, 2, dtype=mt.float64)
    assert mt.autograd.gradcheck(lambda t: t.unflatten(1, (2, -1)) * up, (x,))
    module = mt.nn.Unflatten(-1, (2, 2))
    assert module(x).shape == (3, 2, 2) and mt.unflatten(x, 0, [3, 1]).shape == (3, 1, 4)
