"""One op table drives the op tests: forward against numpy, float64 gradcheck with a
random upstream gradient, float32 against float64, broadcasting shapes from hypothesis."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import microtensor as mt

rng = np.random.default_rng(0)


def positive(shape):
    return rng.uniform(0.5, 2.0, shape)


def normal(shape):
    return rng.standard_normal(shape)


def away_from_kinks(shape):
    """Values at least 0.1 away from 0, where relu/abs/clamp have kinks."""
    x = rng.uniform(0.1, 2.0, shape)
    return x * rng.choice([-1.0, 1.0], shape)


def distinct(shape):
    """Well-separated values, so max/amax have no ties to blur the gradient."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.37 + 0.1).reshape(shape)


def softmax_ref(x, dim):
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


# name -> (microtensor fn, numpy reference, input makers, float32 tolerance)
OPS = {
    "add": (lambda a, b: a + b, np.add, [(normal, (3, 4)), (normal, (4,))]),
    "sub": (lambda a, b: a - b, np.subtract, [(normal, (3, 1)), (normal, (1, 4))]),
    "mul": (lambda a, b: a * b, np.multiply, [(normal, (2, 3, 4)), (normal, (3, 1))]),
    "div": (lambda a, b: a / b, np.divide, [(normal, (3, 4)), (positive, (3, 4))]),
    "pow": (lambda a, b: a ** b, np.power, [(positive, (3, 4)), (normal, (4,))]),
    "pow_scalar": (lambda a: a ** 3, lambda a: a ** 3, [(normal, (5,))]),
    "rsub_scalar": (lambda a: 2.0 - a, lambda a: 2.0 - a, [(normal, (5,))]),
    "rdiv_scalar": (lambda a: 2.0 / a, lambda a: 2.0 / a, [(positive, (5,))]),
    "neg": (lambda a: -a, np.negative, [(normal, (3, 4))]),
    "matmul": (lambda a, b: a @ b, np.matmul, [(normal, (3, 4)), (normal, (4, 5))]),
    "matmul_batched": (mt.matmul, np.matmul, [(normal, (2, 1, 3, 4)), (normal, (3, 4, 2))]),
    "matmul_3d_2d": (mt.matmul, np.matmul, [(normal, (2, 3, 4)), (normal, (4, 5))]),
    "matmul_vec": (mt.matmul, np.matmul, [(normal, (4,)), (normal, (2, 4, 3))]),
    "matmul_mat_vec": (mt.matmul, np.matmul, [(normal, (3, 4)), (normal, (4,))]),
    "exp": (mt.exp, np.exp, [(normal, (3, 4))]),
    "log": (mt.log, np.log, [(positive, (3, 4))]),
    "sqrt": (mt.sqrt, np.sqrt, [(positive, (3, 4))]),
    "tanh": (mt.tanh, np.tanh, [(normal, (3, 4))]),
    "sigmoid": (mt.sigmoid, lambda x: 1 / (1 + np.exp(-x)), [(normal, (3, 4))]),
    "relu": (mt.relu, lambda x: np.maximum(x, 0), [(away_from_kinks, (3, 4))]),
    "abs": (mt.abs, np.abs, [(away_from_kinks, (3, 4))]),
    "clamp": (lambda x: x.clamp(min=-0.5, max=0.6), lambda x: np.clip(x, -0.5, 0.6),
              [(away_from_kinks, (4, 5))]),
    "sum": (lambda x: x.sum(), np.sum, [(normal, (3, 4))]),
    "sum_dim": (lambda x: x.sum(dim=-1, keepdim=True), lambda x: x.sum(-1, keepdims=True), [(normal, (3, 4))]),
    "sum_dims": (lambda x: x.sum(dim=(0, 2)), lambda x: x.sum((0, 2)), [(normal, (2, 3, 4))]),
    "mean": (lambda x: x.mean(dim=1), lambda x: x.mean(1), [(normal, (3, 4))]),
    "var": (lambda x: x.var(dim=-1), lambda x: x.var(-1, ddof=1), [(normal, (3, 5))]),
    "var_correction0": (lambda x: mt.var(x, 0, True, correction=0),
                        lambda x: x.var(0, ddof=0, keepdims=True), [(normal, (4, 3))]),
    "amax": (lambda x: x.amax(dim=1), lambda x: x.max(1), [(distinct, (3, 4))]),
    "max": (lambda x: x.max(), np.max, [(distinct, (3, 4))]),
    "max_dim": (lambda x: x.max(dim=0)[0], lambda x: x.max(0), [(distinct, (3, 4))]),
    "softmax": (lambda x: x.softmax(-1), lambda x: softmax_ref(x, -1), [(normal, (3, 5))]),
    "softmax_dim0": (lambda x: mt.softmax(x, 0), lambda x: softmax_ref(x, 0), [(normal, (3, 5))]),
    "log_softmax": (lambda x: x.log_softmax(1), lambda x: np.log(softmax_ref(x, 1)), [(normal, (2, 3, 4))]),
    "reshape": (lambda x: x.reshape(4, -1), lambda x: x.reshape(4, -1), [(normal, (2, 3, 2))]),
    "view": (lambda x: x.view(-1), lambda x: x.reshape(-1), [(normal, (2, 3))]),
    "transpose": (lambda x: x.transpose(0, -1), lambda x: x.swapaxes(0, -1), [(normal, (2, 3, 4))]),
    "T": (lambda x: x.T, lambda x: x.T, [(normal, (2, 3))]),
    "permute": (lambda x: x.permute(2, 0, 1), lambda x: x.transpose(2, 0, 1), [(normal, (2, 3, 4))]),
    "unsqueeze": (lambda x: x.unsqueeze(-1), lambda x: x[..., None], [(normal, (2, 3))]),
    "squeeze": (lambda x: x.squeeze(1), lambda x: x.squeeze(1), [(normal, (2, 1, 3))]),
    "squeeze_all": (lambda x: x.squeeze(), np.squeeze, [(normal, (1, 3, 1))]),
    "flatten": (lambda x: x.flatten(1), lambda x: x.reshape(2, -1), [(normal, (2, 3, 4))]),
    "unflatten": (lambda x: x.transpose(0, 1).unflatten(0, (2, -1)),
                  lambda x: x.swapaxes(0, 1).reshape(2, 2, 3), [(normal, (3, 4))]),
    "expand": (lambda x: x.expand(2, 3, 4), lambda x: np.broadcast_to(x, (2, 3, 4)), [(normal, (3, 1))]),
    "contiguous": (lambda x: x.T.contiguous(), lambda x: np.ascontiguousarray(x.T), [(normal, (2, 3))]),
    "split": (lambda x: x.split([1, 3], dim=1)[1], lambda x: x[:, 1:], [(normal, (2, 4))]),
    "chunk": (lambda x: x.chunk(2, dim=0)[1], lambda x: x[2:], [(normal, (4, 3))]),
    "masked_fill": (lambda x: x.masked_fill(mt.tensor([[True, False, True]]), -1.5),
                    lambda x: np.where([[True, False, True]], -1.5, x), [(normal, (2, 3))]),
    "where": (lambda a, b: mt.where(a > 0, a, b), lambda a, b: np.where(a > 0, a, b),
              [(away_from_kinks, (3, 4)), (normal, (4,))]),
    "cat": (lambda a, b: mt.cat([a, b], dim=1), lambda a, b: np.concatenate([a, b], 1),
            [(normal, (2, 3)), (normal, (2, 2))]),
    "stack": (lambda a, b: mt.stack([a, b], dim=-1), lambda a, b: np.stack([a, b], -1),
              [(normal, (2, 3)), (normal, (2, 3))]),
    "tril": (lambda x: mt.tril(x, diagonal=-1), lambda x: np.tril(x, -1), [(normal, (4, 4))]),
    "triu": (lambda x: mt.triu(x), np.triu, [(normal, (2, 3, 3))]),
    "index_slice": (lambda x: x[1:, ::2], lambda x: x[1:, ::2], [(normal, (3, 5))]),
    "index_int_none_ellipsis": (lambda x: x[0, None, ..., -1], lambda x: x[0, None, ..., -1],
                                [(normal, (2, 3, 4))]),
    "index_gather": (lambda x: x[mt.tensor([0, 2, 0, 0])], lambda x: x[[0, 2, 0, 0]], [(normal, (3, 4))]),
    "index_gather_2d": (lambda x: x[:, mt.tensor([[1, 1], [0, 3]])], lambda x: x[:, [[1, 1], [0, 3]]],
                        [(normal, (2, 4))]),
    "index_mask": (lambda x: x[x > 0], lambda x: x[x > 0], [(away_from_kinks, (3, 4))]),
    # the wider PyTorch surface (the .py families of microtensor/ops/), written as methods torch shares (so
    # test_ops_torch.py runs them on torch tensors too); more in test_dialect.py
    "sin": (lambda x: x.sin(), np.sin, [(normal, (3, 4))]),
    "log1p": (lambda x: x.log1p(), np.log1p, [(positive, (3, 4))]),
    "cumsum": (lambda x: x.cumsum(1), lambda x: np.cumsum(x, 1), [(normal, (3, 4))]),
    "cumprod": (lambda x: x.cumprod(0), lambda x: np.cumprod(x, 0), [(normal, (3, 4))]),
    "gather": (lambda x: x.gather(1, x.new_tensor([[0, 3], [1, 1], [2, 0]]).long()),
               lambda x: np.take_along_axis(x, np.array([[0, 3], [1, 1], [2, 0]]), 1), [(normal, (3, 4))]),
    "scatter_add": (lambda x, s: x.scatter_add(0, x.new_tensor([[0, 2, 1, 0], [2, 2, 0, 1]]).long(), s),
                    lambda x, s: x + np.einsum("ijr,ij->rj", np.eye(3)[[[0, 2, 1, 0], [2, 2, 0, 1]]], s),
                    [(normal, (3, 4)), (normal, (2, 4))]),
    "sort_values": (lambda x: x.sort(1).values, lambda x: np.sort(x, 1), [(distinct, (3, 4))]),
    "topk_values": (lambda x: x.topk(2).values, lambda x: -np.sort(-x, -1)[:, :2], [(distinct, (3, 4))]),
    "flip": (lambda x: x.flip(0), lambda x: np.flip(x, 0), [(normal, (3, 4))]),
    "roll": (lambda x: x.roll(1, 1), lambda x: np.roll(x, 1, 1), [(normal, (3, 4))]),
    "repeat": (lambda x: x.repeat(2, 1), lambda x: np.tile(x, (2, 1)), [(normal, (3, 4))]),
    "diagonal": (lambda x: x.diagonal(1), lambda x: np.diagonal(x, 1), [(normal, (3, 4))]),
    "norm_dim": (lambda x: x.norm(dim=1), lambda x: np.linalg.norm(x, axis=1), [(normal, (3, 4))]),
    "bmm": (lambda a, b: a.bmm(b), np.matmul, [(normal, (2, 3, 4)), (normal, (2, 4, 2))]),
    "fmax": (lambda a, b: a.fmax(b), np.fmax, [(distinct, (3, 4)), (normal, (4,))]),
    "fmin": (lambda a, b: a.fmin(b), np.fmin, [(distinct, (3, 4)), (normal, (4,))]),
    "remainder": (lambda a, b: a.remainder(b), np.remainder, [(normal, (3, 4)), (positive, (4,))]),
    "std": (lambda x: x.std(dim=1), lambda x: x.std(1, ddof=1), [(normal, (3, 5))]),
    "amin": (lambda x: x.amin(dim=0), lambda x: x.min(0), [(distinct, (3, 4))]),
    "min": (lambda x: x.min(), np.min, [(distinct, (3, 4))]),
    "min_dim": (lambda x: x.min(dim=1)[0], lambda x: x.min(1), [(distinct, (3, 4))]),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, [(distinct, (3, 4)), (normal, (4,))]),
    "minimum": (lambda a, b: a.minimum(b), np.minimum, [(distinct, (3, 4)), (normal, (4,))]),
    "logsumexp": (lambda x: x.logsumexp(1), lambda x: np.log(np.exp(x).sum(1)), [(normal, (3, 4))]),
    "index_select": (lambda x: x.index_select(1, x.new_tensor([2, 0, 2]).long()),
                     lambda x: x[:, [2, 0, 2]], [(normal, (3, 4))]),
    "view_as": (lambda x: x.view_as(x.new_zeros(6, 2)), lambda x: x.reshape(6, 2), [(normal, (3, 4))]),
    "reshape_as": (lambda x: x.T.reshape_as(x.new_zeros(12)), lambda x: x.T.reshape(12),
                   [(normal, (3, 4))]),
    "expand_as": (lambda x: x.expand_as(x.new_zeros(2, 3, 4)), lambda x: np.broadcast_to(x, (2, 3, 4)),
                  [(normal, (3, 1))]),
}

# Every public op of API.md's Operations section, and the table entries that cover it.
API_OPS = {
    "+": "add", "-": "sub", "*": "mul", "/": "div", "**": "pow", "@": "matmul", "unary -": "neg",
    "exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh", "sigmoid": "sigmoid",
    "relu": "relu", "abs": "abs", "clamp": "clamp", "sum": "sum_dim", "mean": "mean",
    "var": "var", "amax": "amax", "max": "max_dim", "softmax": "softmax",
    "log_softmax": "log_softmax", "reshape": "reshape", "view": "view",
    "transpose": "transpose", "permute": "permute", "unsqueeze": "unsqueeze",
    "squeeze": "squeeze", "flatten": "flatten", "expand": "expand", "contiguous": "contiguous",
    "split": "split", "chunk": "chunk", "masked_fill": "masked_fill", "matmul": "matmul_batched",
    "where": "where", "cat": "cat", "stack": "stack", "tril": "tril", "triu": "triu",
    "indexing": "index_gather", "T": "T",
}
# ops without a gradient are checked elsewhere in this file
NO_GRAD_OPS = {"argmax", "comparisons"}


def make_inputs(name, dtype=np.float64):
    return [maker(shape).astype(dtype) for maker, shape in OPS[name][2]]


def as_tensors(arrays, requires_grad):
    return [mt.tensor(a, requires_grad=requires_grad) for a in arrays]


def test_every_api_op_has_a_table_entry():
    """Fails when a public op of API.md is missing from the table (or from mt)."""
    for api_name, entry in API_OPS.items():
        assert entry in OPS, f"API op {api_name!r} has no entry {entry!r} in the op table"
    for fn in ["exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs", "clamp", "sum", "mean",
               "var", "amax", "max", "argmax", "softmax", "log_softmax", "reshape", "view",
               "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
               "contiguous", "split", "chunk", "masked_fill", "matmul"]:
        assert hasattr(mt.Tensor, fn), f"Tensor has no method {fn}"
    for fn in ["exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs", "clamp", "sum", "mean",
               "var", "amax", "max", "argmax", "softmax", "log_softmax", "reshape", "view",
               "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand", "contiguous",
               "split", "chunk", "masked_fill", "matmul", "where", "cat", "stack", "tril", "triu"]:
        assert callable(getattr(mt, fn, None)), f"mt.{fn} is missing"


@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_matches_numpy(name):
    fn, ref = OPS[name][0], OPS[name][1]
    arrays = make_inputs(name)
    out = fn(*as_tensors(arrays, False))
    expected = ref(*arrays)
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradcheck_float64(name):
    fn = OPS[name][0]
    tensors = as_tensors(make_inputs(name), True)
    assert mt.gradcheck(fn, tensors)


@pytest.mark.parametrize("name", sorted(OPS))
def test_float32_close_to_float64(name):
    fn = OPS[name][0]
    a64 = make_inputs(name)
    out64 = fn(*as_tensors(a64, False)).numpy()
    out32 = fn(*as_tensors([a.astype(np.float32) for a in a64], False))
    assert out32.dtype == mt.float32, f"{name} changed float32 to {out32.dtype}"
    np.testing.assert_allclose(out32.numpy(), out64, rtol=2e-4, atol=2e-5)


# ---- second order: every row, and a create_graph rule for every node type --------------

@pytest.mark.parametrize("name", sorted(OPS))
def test_gradgradcheck_float64(name):
    """Gradients of gradients (create_graph=True) against central differences of the
    first-order ones, with respect to the inputs and the upstream gradient."""
    fn = OPS[name][0]
    tensors = as_tensors(make_inputs(name), True)
    assert mt.gradgradcheck(fn, tensors)


@pytest.mark.parametrize("name", sorted(OPS))
def test_create_graph_gradients_equal_the_backward_ones(name):
    """The create_graph rule of every node the row runs gives the same first-order
    gradients as its numpy backward (gradgradcheck alone would accept a rule that is
    wrong in a self-consistent way)."""
    fn = OPS[name][0]
    arrays = make_inputs(name)
    upstream = None
    grads = []
    for create_graph in (False, True):
        tensors = as_tensors(arrays, True)
        out = fn(*tensors)
        if upstream is None:
            upstream = np.random.default_rng(1).standard_normal(out.shape)
        found = mt.autograd.grad(out, tensors, mt.tensor(upstream), create_graph=create_graph,
                                 allow_unused=True)
        grads.append([None if g is None else g.numpy() for g in found])
    for i, (a, b) in enumerate(zip(*grads)):
        if a is None or b is None:
            assert a is None and b is None, f"{name}: input {i} has a gradient only one way"
            continue
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=f"{name}: input {i}")


def node_types():
    """Every Node subclass that microtensor and models define (all their modules imported)."""
    import importlib
    import pkgutil
    import models
    for package in (mt, models):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
    found, stack = set(), [mt.Node]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return sorted((c for c in found if c.__module__.split(".")[0] in ("microtensor", "models")),
                  key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_node_type_has_a_create_graph_rule():
    """A new op's node needs a rule in microtensor.autograd.higher_order (else its
    gradient cannot be differentiated again: create_graph=True raises on a second pass)."""
    from microtensor.autograd.higher_order import rule_for
    types = node_types()
    assert len(types) >= 30, f"only found {len(types)} node types"
    missing = [f"{c.__module__}.{c.__qualname__}" for c in types if rule_for(c) is None]
    assert not missing, f"node types without a create_graph rule: {missing}"


# ---- broadcasting, drawn by hypothesis ------------------------------------------------

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


@settings(max_examples=40, deadline=None)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       op=st.sampled_from(sorted(BINARY)), seed=st.integers(0, 2**16))
def test_broadcasting_forward_and_backward(shapes, op, seed):
    r = np.random.default_rng(seed)
    a = r.uniform(0.5, 1.5, shapes.input_shapes[0])
    b = r.uniform(0.5, 1.5, shapes.input_shapes[1])
    ta, tb = mt.tensor(a, requires_grad=True), mt.tensor(b, requires_grad=True)
    fn = {"add": mt.add, "sub": mt.sub, "mul": mt.mul, "div": mt.div}[op]
    out = fn(ta, tb)
    assert out.shape == shapes.result_shape
    np.testing.assert_allclose(out.numpy(), BINARY[op](a, b), rtol=1e-12)
    assert mt.gradcheck(fn, [ta, tb])


@settings(max_examples=25, deadline=None)
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=4), data=st.data())
def test_reductions_any_dim(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdim = data.draw(st.booleans())
    x = np.random.default_rng(1).standard_normal(shape)
    t = mt.tensor(x, requires_grad=True)
    np.testing.assert_allclose(t.sum(dim, keepdim).numpy(), x.sum(dim, keepdims=keepdim), atol=1e-12)
    np.testing.assert_allclose(t.mean(dim, keepdim).numpy(), x.mean(dim, keepdims=keepdim), atol=1e-12)
    assert mt.gradcheck(lambda v: v.mean(dim, keepdim) * v.sum(dim, keepdim), [t])


# ---- ops without gradients, and semantics checked directly -------------------------

def test_comparisons_return_bool_tensors():
    a, b = mt.tensor([1.0, 2.0, 3.0]), mt.tensor([3.0, 2.0, 1.0])
    for op, ref in [("__lt__", [True, False, False]), ("__le__", [True, True, False]),
                    ("__gt__", [False, False, True]), ("__ge__", [False, True, True]),
                    ("__eq__", [False, True, False]), ("__ne__", [True, False, True])]:
        out = getattr(a, op)(b)
        assert out.dtype == mt.bool
        assert out.tolist() == ref
        assert out.grad_fn is None


def test_argmax_and_max_with_dim():
    x = mt.tensor([[1.0, 5.0, 2.0], [7.0, 0.0, 7.0]])
    assert x.argmax().item() == 3
    assert x.argmax(dim=1).tolist() == [1, 0]
    values, indices = x.max(dim=1)
    assert values.tolist() == [5.0, 7.0]
    assert indices.tolist() == [1, 0]
    assert indices.dtype == mt.int64
    assert x.max(dim=-1, keepdim=True).values.shape == (2, 1)


def test_max_dim_gradient_goes_to_the_selected_index():
    x = mt.tensor([[1.0, 3.0, 3.0]], requires_grad=True)
    x.max(dim=1)[0].sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 0.0]]


def test_amax_gradient_splits_ties_evenly():
    x = mt.tensor([1.0, 3.0, 3.0], requires_grad=True)
    x.amax().backward()
    assert x.grad.tolist() == [0.0, 0.5, 0.5]


def test_gather_backward_accumulates_repeated_indices():
    w = mt.zeros(3, 2, requires_grad=True)
    w[mt.tensor([0, 0, 2, 0])].sum().backward()
    assert w.grad.tolist() == [[3.0, 3.0], [0.0, 0.0], [1.0, 1.0]]


def test_var_correction():
    x = np.array([1.0, 2.0, 4.0, 7.0])
    t = mt.tensor(x)
    assert t.var().item() == pytest.approx(x.var(ddof=1))
    assert t.var(correction=0).item() == pytest.approx(x.var())
    assert t.var(correction=2).item() == pytest.approx(((x - x.mean()) ** 2).sum() / 2)


def test_dtype_defaults_follow_torch():
    assert mt.tensor(1.5).dtype == mt.float32
    assert mt.tensor([1, 2]).dtype == mt.int64
    assert mt.tensor([True]).dtype == mt.bool
    assert mt.tensor(np.zeros(2)).dtype == mt.float64  # numpy arrays keep their dtype
    assert (mt.tensor([1, 2]) / 2).dtype == mt.float32
    assert (mt.ones(2) * 2.5).dtype == mt.float32
    assert (mt.ones(2) + mt.tensor(1.0, dtype=mt.float64)).dtype == mt.float32  # 0-d does not promote
    assert (mt.ones(2) + np.ones(2)).dtype == mt.float64
    for fn in (mt.zeros, mt.ones, mt.randn, mt.rand):
        assert fn(2, 3).dtype == mt.float32
        assert fn(2, 3, dtype=mt.float64).dtype == mt.float64
    assert mt.arange(3).dtype == mt.int64
    assert mt.arange(0, 1, 0.5).dtype == mt.float32
    assert mt.full((2,), 3).dtype == mt.int64
    assert mt.randint(0, 5, (3,)).dtype == mt.int64


def test_creation_functions():
    assert mt.zeros(2, 3).shape == (2, 3)
    assert mt.zeros((2, 3)).shape == (2, 3)
    assert mt.ones(4).tolist() == [1.0] * 4
    assert mt.full((2, 2), 7.0).tolist() == [[7.0, 7.0], [7.0, 7.0]]
    assert mt.zeros_like(mt.ones(2, dtype=mt.float64)).dtype == mt.float64
    assert mt.ones_like(mt.zeros(3)).tolist() == [1.0, 1.0, 1.0]
    assert mt.arange(5).tolist() == [0, 1, 2, 3, 4]
    assert mt.arange(1, 7, 2).tolist() == [1, 3, 5]
    r = mt.randint(3, 6, (100,))
    assert 3 <= r.numpy().min() and r.numpy().max() < 6
    assert mt.rand(1000).numpy().min() >= 0 and mt.rand(1000).numpy().max() < 1
    a = np.zeros(3, dtype=np.float32)
    t = mt.from_numpy(a)
    a[0] = 5
    assert t[0].item() == 5  # shares memory
    assert t.numpy() is a
    assert mt.tensor(a).numpy() is not a  # tensor() copies
    assert mt.randn(2, 3, requires_grad=True).requires_grad


def test_manual_seed_makes_random_reproducible():
    mt.manual_seed(123)
    a = (mt.randn(5).numpy(), mt.rand(3).numpy(), mt.randint(0, 9, (4,)).numpy())
    mt.manual_seed(123)
    b = (mt.randn(5).numpy(), mt.rand(3).numpy(), mt.randint(0, 9, (4,)).numpy())
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    state = mt.get_rng_state()
    c = mt.randn(4).numpy()
    mt.set_rng_state(state)
    np.testing.assert_array_equal(c, mt.randn(4).numpy())


def test_operators_with_scalars_and_numpy_on_either_side():
    t = mt.tensor([1.0, 2.0])
    arr = np.array([10.0, 20.0], dtype=np.float32)
    assert (2 * t).tolist() == [2.0, 4.0]
    assert (t * 2).tolist() == [2.0, 4.0]
    assert (arr + t).tolist() == [11.0, 22.0]
    assert isinstance(arr + t, mt.Tensor)
    assert (arr - t).tolist() == [9.0, 18.0]
    assert (1 / t).tolist() == [1.0, 0.5]
    assert (2 ** t).tolist() == [2.0, 4.0]
    assert (-t).tolist() == [-1.0, -2.0]
    assert (arr @ t).item() == 50.0


def test_attributes():
    t = mt.randn(2, 3, requires_grad=True)
    assert t.shape == (2, 3) and t.ndim == 2 and t.numel() == 6
    assert t.size() == (2, 3) and t.size(-1) == 3 and t.size(0) == 2
    assert t.is_leaf and t.grad_fn is None and t.grad is None
    y = t * 2
    assert not y.is_leaf and y.grad_fn.name() == "MulBackward"
    assert y.grad_fn.next_functions[0][0].name() == "AccumulateGrad"
    d = y.data
    assert not d.requires_grad and np.shares_memory(d.numpy(), y.numpy())
    assert "grad_fn=<MulBackward>" in repr(y)
    assert "shape=(2, 3)" in repr(y)
    assert mt.tensor([[1.5]]).item() == 1.5
    assert mt.tensor([[1, 2]]).tolist() == [[1, 2]]
    assert t.float().dtype == mt.float32 and t.double().dtype == mt.float64
    assert t.long().dtype == mt.int64


def test_cast_keeps_the_graph():
    x = mt.randn(3, dtype=mt.float64, requires_grad=True)
    (x.float() * 2).sum().backward()
    assert x.grad.dtype == mt.float64
    np.testing.assert_allclose(x.grad.numpy(), 2.0)


# ---- bad input gives clear errors ------------------------------------------------

def test_shape_errors_are_value_and_runtime_errors():
    assert issubclass(mt.ShapeError, ValueError) and issubclass(mt.ShapeError, RuntimeError)
    with pytest.raises(mt.ShapeError, match=r"\(2, 3\).*\(4,\)"):
        mt.ones(2, 3) + mt.ones(4)
    with pytest.raises(mt.ShapeError, match=r"\(2, 3\).*\(4, 5\)"):
        mt.ones(2, 3) @ mt.ones(4, 5)
    with pytest.raises(mt.ShapeError, match="invalid for input of size 6"):
        mt.ones(2, 3).reshape(4, 2)
    with pytest.raises(mt.ShapeError, match="tensor 1 has shape"):
        mt.cat([mt.ones(2, 3), mt.ones(2, 4)], dim=0)
    with pytest.raises(mt.ShapeError, match="permute"):
        mt.ones(2, 3).permute(0)
    with pytest.raises(mt.ShapeError):
        mt.ones(2, 3).expand(4, 3)
    with pytest.raises(mt.ShapeError):
        mt.ones(2, 3).split([1, 1], dim=1)


def test_dim_and_index_out_of_range_are_index_errors():
    with pytest.raises(IndexError, match="Dimension out of range"):
        mt.ones(2, 3).sum(dim=2)
    with pytest.raises(IndexError, match="Dimension out of range"):
        mt.ones(2, 3).softmax(-3)
    with pytest.raises(IndexError, match="Dimension out of range"):
        mt.ones(2, 3).transpose(0, 5)
    with pytest.raises(IndexError, match="5.*size 3"):
        mt.ones(3)[5]
    with pytest.raises(IndexError, match="7.*size 4"):
        mt.ones(4, 2)[mt.tensor([0, 7])]


def test_type_errors():
    with pytest.raises(TypeError, match="int64"):
        mt.tensor([1, 2], requires_grad=True)
    with pytest.raises(TypeError, match="int64"):
        mt.arange(3).requires_grad_()
    with pytest.raises(TypeError):
        mt.exp([1.0, 2.0])
    with pytest.raises(TypeError, match="bool"):
        mt.ones(3).masked_fill(mt.ones(3), 0.0)
    with pytest.raises(TypeError, match="floating"):
        mt.arange(3).mean()


def test_value_errors():
    with pytest.raises(ValueError, match="negative"):
        mt.zeros(-1, 2)
    with pytest.raises(ValueError):
        mt.randint(5, 2, (3,))
    with pytest.raises(ValueError, match="elements"):
        mt.ones(3).item()
