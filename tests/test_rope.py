"""F.rotary_embedding: the RoPE rotation as one public op with its own backward rule."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F


def tables(T, d, dtype=np.float64, base=10000.0):
    inv_freq = base ** (-np.arange(0, d, 2) / d)
    angle = np.arange(T)[:, None] * inv_freq
    angle = np.concatenate([angle, angle], axis=1)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def by_primitives(x, cos, sin):
    """y = x cos + rotate_half(x) sin, written with mt's differentiable primitives."""
    half = x.shape[-1] // 2
    rotated = mt.cat([-x[..., half:], x[..., :half]], -1)
    return x * mt.from_numpy(cos) + rotated * mt.from_numpy(sin)


def test_gradcheck_float64():
    mt.manual_seed(0)
    cos, sin = tables(5, 6)
    x = mt.randn(2, 3, 5, 6, dtype=mt.float64, requires_grad=True)
    assert mt.gradcheck(lambda x: F.rotary_embedding(x, cos, sin), [x])


def test_matches_the_primitives_forward_and_backward():
    mt.manual_seed(1)
    cos, sin = tables(4, 8)
    x = mt.randn(3, 4, 8, dtype=mt.float64, requires_grad=True)
    g = mt.randn(3, 4, 8, dtype=mt.float64)
    y = F.rotary_embedding(x, cos, sin)
    assert y.grad_fn.name() == "RopeBackward"
    (gx,) = mt.autograd.grad(y, x, grad_outputs=g)
    x2 = x.detach().requires_grad_()
    y2 = by_primitives(x2, cos, sin)
    (gx2,) = mt.autograd.grad(y2, x2, grad_outputs=g)
    np.testing.assert_allclose(y.numpy(), y2.numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(gx.numpy(), gx2.numpy(), rtol=1e-14, atol=1e-15)


def test_second_derivative():
    cos, sin = tables(3, 4)
    x = mt.randn(2, 3, 4, dtype=mt.float64, requires_grad=True)
    assert mt.gradgradcheck(lambda x: F.rotary_embedding(x, cos, sin) * x, [x])


def test_float32_tables_follow_x():
    cos, sin = tables(3, 4)            # float64 tables, float32 input
    x = mt.randn(3, 4)
    y = F.rotary_embedding(x, cos, sin)
    assert y.dtype == x.dtype
    np.testing.assert_allclose(y.numpy(), by_primitives(x.double(), cos, sin).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_named_errors():
    cos, sin = tables(3, 4)
    with pytest.raises(mt.ShapeError, match="even"):
        F.rotary_embedding(mt.randn(3, 5), *tables(3, 5)[:1], tables(3, 5)[1])
    with pytest.raises(mt.ShapeError, match="cos"):
        F.rotary_embedding(mt.randn(3, 6), cos, sin)
    with pytest.raises(mt.ShapeError, match="broadcast"):
        F.rotary_embedding(mt.randn(5, 4), cos, sin)
    with pytest.raises(ValueError, match="constant"):
        F.rotary_embedding(mt.randn(3, 4), mt.from_numpy(cos).requires_grad_(), sin)
    with pytest.raises(TypeError):
        F.rotary_embedding(np.ones((3, 4)), cos, sin)
    with pytest.raises(TypeError, match="floating"):
        F.rotary_embedding(mt.ones(3, 4, dtype=mt.int64), cos, sin)
