"""mt.autograd.functional against torch.autograd.functional in float64: vjp, jvp (the
double-vjp trick), vhp, hvp, jacobian and hessian, with torch's return structures."""
import numpy as np
import pytest

import microtensor as mt
from microtensor.autograd import functional as AF

torch = pytest.importorskip("torch")
TF = torch.autograd.functional
rng = np.random.default_rng(0)


# functions written with the methods both libraries share, so one body serves both
def one_to_one(x):                       # (3, 4) -> (3, 3)
    return (x @ x.T).tanh() * x.sum()


def two_to_two(x, y):                    # (2, 3), (2, 3) -> (2, 3), ()
    return (x * y).exp(), ((x @ y.T) ** 2).sum()


def scalar(x, y):                        # (2, 3), (4, 3) -> ()
    return ((x @ y.T).softmax(-1) ** 2).sum() + (x.tanh().sum(0) * y.sum(0)).sum()


def scalar_one(x):                       # (5,) -> ()
    return (x.exp() * x.tanh()).sum() + (x.sum() ** 3)


def arrays(*shapes):
    return [rng.standard_normal(s) for s in shapes]


def to_mt(arrs):
    return tuple(mt.tensor(a) for a in arrs)


def to_torch(arrs):
    return tuple(torch.from_numpy(a.copy()) for a in arrs)


def assert_same(ours, theirs, rtol=1e-10):
    """Equal values and the same nesting (a tensor, a tuple, a tuple of tuples)."""
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b, rtol)
        return
    assert isinstance(ours, mt.Tensor), f"expected a tensor, got {type(ours).__name__}"
    assert tuple(ours.shape) == tuple(theirs.shape)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=rtol, atol=1e-12)


CASES = {
    # name: (func, input shapes, v shapes for vjp (outputs) or None)
    "one_to_one": (one_to_one, [(3, 4)], [(3, 3)]),
    "two_to_two": (two_to_two, [(2, 3), (2, 3)], [(2, 3), ()]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vjp(name):
    func, shapes, vshapes = CASES[name]
    xs, vs = arrays(*shapes), arrays(*vshapes)
    tupled = len(shapes) > 1
    ours = AF.vjp(func, to_mt(xs) if tupled else to_mt(xs)[0],
                  to_mt(vs) if len(vs) > 1 else to_mt(vs)[0])
    theirs = TF.vjp(func, to_torch(xs) if tupled else to_torch(xs)[0],
                    to_torch(vs) if len(vs) > 1 else to_torch(vs)[0])
    assert_same(ours, theirs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp(name):
    func, shapes, _ = CASES[name]
    xs, vs = arrays(*shapes), arrays(*shapes)
    tupled = len(shapes) > 1
    pick = (lambda t: t) if tupled else (lambda t: t[0])
    ours = AF.jvp(func, pick(to_mt(xs)), pick(to_mt(vs)))
    theirs = TF.jvp(func, pick(to_torch(xs)), pick(to_torch(vs)))
    assert_same(ours, theirs)


@pytest.mark.parametrize("product", ["vhp", "hvp"])
@pytest.mark.parametrize("tupled", [False, True])
def test_hessian_vector_products(product, tupled):
    func, shapes = (scalar, [(2, 3), (4, 3)]) if tupled else (scalar_one, [(5,)])
    xs, vs = arrays(*shapes), arrays(*shapes)
    pick = (lambda t: t) if tupled else (lambda t: t[0])
    ours = getattr(AF, product)(func, pick(to_mt(xs)), pick(to_mt(vs)))
    theirs = getattr(TF, product)(func, pick(to_torch(xs)), pick(to_torch(vs)))
    assert_same(ours, theirs)


def test_hvp_equals_vhp_for_a_symmetric_hessian():
    xs, vs = arrays((2, 3), (4, 3)), arrays((2, 3), (4, 3))
    _, a = AF.hvp(scalar, to_mt(xs), to_mt(vs))
    _, b = AF.vhp(scalar, to_mt(xs), to_mt(vs))
    assert_same(a, tuple(torch.from_numpy(t.numpy()) for t in b))


@pytest.mark.parametrize("name", ["one_to_one", "two_to_two", "tensor_to_tuple", "tuple_to_tensor"])
def test_jacobian(name):
    if name == "tensor_to_tuple":
        func, shapes = (lambda x: (x.exp(), (x * x).sum(0))), [(2, 3)]
    elif name == "tuple_to_tensor":
        func, shapes = (lambda x, y: x @ y), [(2, 3), (3, 2)]
    else:
        func, shapes, _ = CASES[name]
    xs = arrays(*shapes)
    pick = (lambda t: t) if len(shapes) > 1 else (lambda t: t[0])
    assert_same(AF.jacobian(func, pick(to_mt(xs))), TF.jacobian(func, pick(to_torch(xs))))


@pytest.mark.parametrize("tupled", [False, True])
def test_hessian(tupled):
    func, shapes = (scalar, [(2, 3), (4, 3)]) if tupled else (scalar_one, [(5,)])
    xs = arrays(*shapes)
    pick = (lambda t: t) if tupled else (lambda t: t[0])
    assert_same(AF.hessian(func, pick(to_mt(xs))), TF.hessian(func, pick(to_torch(xs))))


def test_create_graph_results_can_be_differentiated_again():
    x = rng.standard_normal((2, 3))
    mx, tx = mt.tensor(x, requires_grad=True), torch.from_numpy(x.copy()).requires_grad_()
    f = (lambda a: (a.tanh() ** 3).sum())
    h = AF.hessian(f, mx, create_graph=True)
    th = TF.hessian(f, tx, create_graph=True)
    assert h.grad_fn is not None
    (d,) = mt.autograd.grad((h * h).sum(), mx)
    (td,) = torch.autograd.grad((th * th).sum(), tx)
    np.testing.assert_allclose(d.numpy(), td.numpy(), rtol=1e-10)
    _, j = AF.jvp(lambda a: a.exp() * a, mx, mt.ones(2, 3, dtype=mt.float64), create_graph=True)
    (dj,) = mt.autograd.grad(j.sum(), mx)
    np.testing.assert_allclose(dj.numpy(), np.exp(x) * (x + 2), rtol=1e-12)


def test_results_are_detached_without_create_graph():
    x = mt.tensor(rng.standard_normal(3), requires_grad=True)
    out, g = AF.vjp(lambda a: (a * a).sum(), x)
    assert not out.requires_grad and not g.requires_grad
    assert x.grad is None


def test_errors():
    x = mt.tensor(rng.standard_normal(3))
    with pytest.raises(RuntimeError, match="v can only be None"):
        AF.vjp(lambda a: a * 2, x)
    with pytest.raises(RuntimeError, match="single element"):
        AF.hessian(lambda a: a * 2, x)
    with pytest.raises(RuntimeError, match="independent of input 1"):
        AF.vjp(lambda a, b: (a * 2).sum(), (x, mt.tensor([1.0])), strict=True)
    with pytest.raises(TypeError, match="Tensor or a tuple of Tensors"):
        AF.jacobian(lambda a: a, [1.0, 2.0])
    # not strict: an unused input gets zeros, as torch
    _, (ga, gb) = AF.vjp(lambda a, b: (a * 2).sum(), (x, mt.tensor([1.0, 2.0])))
    np.testing.assert_array_equal(gb.numpy(), [0.0, 0.0])
