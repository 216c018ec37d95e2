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


# ---- broadcasting is undone once, in the engine -----------------------------------------

_BROADCAST_PAIRS = [((3, 1), (4,)), ((2, 1, 3), (1, 4, 1)), ((), (2, 3)), ((5,), (2, 1, 5)),
                    ((2, 3), (2, 3))]


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("a_shape,b_shape", _BROADCAST_PAIRS)
def test_the_engine_sums_each_gradient_to_its_inputs_shape(a_shape, b_shape, create_graph):
    """The rules of mul, sub and where hand back gradients in the broadcast shape: the
    engine sums them down, on the numpy path and on the create-graph path alike."""
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    out_shape = np.broadcast_shapes(a_shape, b_shape)
    up = rng.standard_normal(out_shape)        # a random upstream gradient (ones hide bugs)
    cond = rng.standard_normal(out_shape) > 0

    def summed(g, shape):                     # numpy's reference: sum g down to shape
        g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
        axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
        return g.sum(axis=axes, keepdims=True) if axes else g
    cases = [(lambda a, b: a * b, up * b_np, up * a_np),
             (lambda a, b: a - b, up, -up),
             (lambda a, b: mt.where(mt.tensor(cond), a, b), np.where(cond, up, 0),
              np.where(cond, 0, up))]
    for f, da, db in cases:
        a = mt.tensor(a_np, requires_grad=True)
        b = mt.tensor(b_np, requires_grad=True)
        ga, gb = mt.autograd.grad(f(a, b), (a, b), mt.tensor(up), create_graph=create_graph)
        assert tuple(ga.shape) == a_shape and tuple(gb.shape) == b_shape
        np.testing.assert_allclose(ga.numpy(), summed(da, a_shape), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gb.numpy(), summed(db, b_shape), rtol=1e-12, atol=1e-12)
        if f is cases[0][0]:                   # mul's da = g * b reads b: a graph under create_graph
            assert (ga.grad_fn is not None) == create_graph
    # and the sum is differentiable again: second order through a broadcast mul
    a = mt.tensor(a_np, requires_grad=True)
    b = mt.tensor(b_np, requires_grad=True)
    assert mt.autograd.gradgradcheck(lambda a, b: a * b * b, (a, b))


def test_a_gradient_that_is_no_broadcast_of_its_input_raises():
    """A rule whose gradient cannot be summed down to its input's shape is a bug in the
    rule: the engine says so rather than guessing (both paths)."""
    from microtensor.autograd.graph_rules import DifferentiableRule

    class WrongBackward(DifferentiableRule):
        def create_graph(self, g):
            return (mt.ones(4, dtype=g.dtype),)         # the input has shape (3,)
    for create_graph in (False, True):
        x = mt.ones(3, dtype=mt.float64, requires_grad=True)
        y = mt.autograd.wrap(x.detach().numpy() * 2)
        mt.autograd.attach(y, WrongBackward(), (x,))
        with pytest.raises(RuntimeError, match=r"gradient of shape \(4,\) for an input of "
                                               r"shape \(3,\)"):
            mt.autograd.grad(y.sum(), (x,), create_graph=create_graph)


def test_a_gradient_of_the_right_shape_passes_the_engine_uncopied():
    """The hot path: a gradient already in its input's shape and dtype is handed on as it
    is (no sum, no cast, no copy); a broadcast one is summed, and cast to the input's dtype."""
    from microtensor.core import _core
    x = mt.ones(2, 3, dtype=mt.float32, requires_grad=True)
    y = x * 2.0
    g = np.ones((2, 3), dtype=np.float32)
    assert _core.sum_to_inputs(y.grad_fn, (g,))[0] is g
    wide = np.ones((4, 2, 3), dtype=np.float64)
    out = _core.sum_to_inputs(y.grad_fn, (wide, None))
    assert out[0].shape == (2, 3) and out[0].dtype == np.float32 and out[1] is None
    np.testing.assert_array_equal(out[0], np.full((2, 3), 4.0))
