"""Autograd semantics: accumulation, retain_graph, hooks, no_grad, deep graphs,
autograd.grad, and a negative test showing that gradcheck catches a wrong rule."""
import numpy as np
import pytest

import microtensor as mt


def test_leaves_accumulate_across_backward_calls():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    (x * 3).sum().backward()
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3 + 2, 3 + 4])


def test_backward_twice_without_retain_graph_raises():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()


def test_retain_graph_allows_a_second_backward():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward(retain_graph=True)
    first = x.grad.numpy().copy()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * first)


def test_non_scalar_backward_needs_gradient():
    x = mt.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2).backward()
    g = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    (x * 2).backward(gradient=mt.tensor(g))
    np.testing.assert_allclose(x.grad.numpy(), 2 * g)


def test_backward_on_a_tensor_without_graph_raises():
    with pytest.raises(RuntimeError, match="does not require grad"):
        mt.ones(2).sum().backward()


def test_hook_replaces_gradient():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    seen = []
    y.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 10)
    y.sum().backward()
    np.testing.assert_allclose(seen[0], [1.0, 1.0])
    np.testing.assert_allclose(x.grad.numpy(), [20.0, 20.0])


def test_leaf_hook_and_handle_remove():
    x = mt.tensor([1.0], requires_grad=True)
    handle = x.register_hook(lambda g: g * 0)
    (x * 5).sum().backward()
    assert x.grad.item() == 0.0
    handle.remove()
    x.grad = None
    (x * 5).sum().backward()
    assert x.grad.item() == 5.0


def test_retain_grad_keeps_non_leaf_grad():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    h = x * 3
    h.retain_grad()
    k = x * 4
    (h * h + k).sum().backward()
    np.testing.assert_allclose(h.grad.numpy(), 2 * h.numpy())
    assert k.grad is None


def test_no_grad_builds_no_graph():
    x = mt.ones(2, requires_grad=True)
    with mt.no_grad():
        y = x * 2
        assert not mt.is_grad_enabled()
        with mt.enable_grad():
            z = x * 2
    assert mt.is_grad_enabled()
    assert y.grad_fn is None and not y.requires_grad
    assert z.grad_fn is not None

    @mt.no_grad()
    def f(t):
        return t * 2
    assert f(x).grad_fn is None


def test_detach_and_requires_grad_flag():
    x = mt.ones(2, requires_grad=True)
    y = (x * 2).detach()
    assert not y.requires_grad and y.grad_fn is None
    with pytest.raises(RuntimeError):
        (x * 2).requires_grad = False


def test_deep_chain_does_not_hit_recursion_limit():
    x = mt.tensor([1.0], dtype=mt.float64, requires_grad=True)
    y = x
    for _ in range(20000):
        y = y * 1.0001
    y.sum().backward()
    assert x.grad.item() == pytest.approx(1.0001 ** 20000, rel=1e-9)


def test_diamond_graph_sums_both_paths():
    x = mt.tensor([2.0], requires_grad=True)
    a = x * 3
    b = x.exp()
    (a * b).sum().backward()
    expected = 3 * np.exp(2.0) + 3 * 2.0 * np.exp(2.0)
    assert x.grad.item() == pytest.approx(expected, rel=1e-5)


def test_autograd_grad_does_not_touch_dot_grad():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    w = mt.tensor([3.0, 4.0], requires_grad=True)
    h = x * w
    y = (h * h).sum()
    gx, gh = mt.autograd.grad(y, [x, h])
    np.testing.assert_allclose(gx.numpy(), 2 * x.numpy() * w.numpy() ** 2)
    np.testing.assert_allclose(gh.numpy(), 2 * h.numpy())
    assert x.grad is None and w.grad is None


def test_autograd_grad_with_grad_outputs():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    (g,) = mt.autograd.grad(x * 3, x, grad_outputs=mt.tensor([1.0, -1.0]))
    np.testing.assert_allclose(g.numpy(), [3.0, -3.0])


def test_custom_function():
    class Cube(mt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            return 3 * x ** 2 * grad_output

    x = mt.randn(4, dtype=mt.float64, requires_grad=True)
    assert mt.gradcheck(Cube.apply, [x])
    assert Cube.apply(x).grad_fn.name() == "CubeBackward"


def test_gradcheck_catches_a_wrong_gradient():
    class WrongSquare(mt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            return x * grad_output  # should be 2 * x * grad_output

    x = mt.randn(3, 2, dtype=mt.float64, requires_grad=True)
    with pytest.raises(mt.autograd.GradcheckError) as info:
        mt.gradcheck(WrongSquare.apply, [x])
    report = str(info.value)
    assert "input 0" in report and "analytic" in report and "numerical" in report
    assert mt.gradcheck(WrongSquare.apply, [x], raise_exception=False) is False


def test_gradcheck_catches_a_missing_transpose():
    """A random upstream gradient catches what an all-ones one can hide."""
    class BadMatmul(mt.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g @ b.T, (a.T @ g).T.T[::-1]  # wrong row order for db

    a = mt.randn(3, 3, dtype=mt.float64, requires_grad=True)
    b = mt.randn(3, 3, dtype=mt.float64, requires_grad=True)
    with pytest.raises(mt.autograd.GradcheckError, match="input 1"):
        mt.gradcheck(BadMatmul.apply, [a, b])


def test_gradcheck_requires_float64():
    with pytest.raises(TypeError, match="float64"):
        mt.gradcheck(lambda v: v * 2, [mt.ones(2, requires_grad=True)])


def test_anomaly_mode_names_the_op():
    x = mt.tensor([-1.0, 2.0], requires_grad=True)
    with mt.autograd.detect_anomaly():
        y = x.sqrt().sum()
        with pytest.raises(RuntimeError, match="SqrtBackward"):
            y.backward()


def test_inplace_on_leaf_requiring_grad_raises():
    x = mt.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place"):
        x.add_(1)
    with mt.no_grad():
        x.add_(1)
    assert x.tolist() == [2.0, 2.0]


def test_deepcopy_of_leaves_and_parameters():
    import copy
    p = mt.Parameter(mt.ones(2))
    p.grad = mt.ones(2)
    q = copy.deepcopy(p)
    assert type(q) is mt.Parameter and q.requires_grad
    q.data.add_(1)
    assert p.tolist() == [1.0, 1.0] and q.tolist() == [2.0, 2.0]
    assert q.grad.tolist() == [1.0, 1.0] and q.grad is not p.grad
    with pytest.raises(RuntimeError, match="leaf"):
        copy.deepcopy(p * 2)
