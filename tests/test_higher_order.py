"""Gradients of gradients: create_graph=True, mt.autograd.grad with differentiable
grad_outputs, gradgradcheck on every fused op (the core ops are in test_ops.py's table),
negative tests showing that a wrong double-backward rule fails, and a tiny GPT's
Hessian-vector product against PyTorch's."""
import importlib.util
import os

import numpy as np
import pytest

import microtensor as mt
import microtensor.core._core as C
import microtensor.nn.functional as F
from microtensor.autograd import higher_order
from models import GPT, GPTConfig, RotaryEmbedding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rng = np.random.default_rng(0)


def leaf(*shape, low=None, high=None):
    a = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return mt.tensor(a, requires_grad=True)


def seeded(fn):
    """fn with the same random draws (dropout masks) on every call."""
    def run(*args):
        mt.manual_seed(7)
        return fn(*args)
    return run


def attention_mask_bool():
    # (Tq, Tk) = (3, 4): row 1 sees nothing (its output is zeros), row 2 everything
    return mt.tensor(np.array([[True, False, True, False], [False] * 4, [True] * 4]))


def attention_mask_float():
    m = rng.standard_normal((2, 1, 3, 4))          # broadcast over heads
    m[0, 0, 1, 2] = -np.inf
    return mt.tensor(m)


# name -> (fn, input makers): every fused op and every option that changes its rule
FUSED = {
    "linear": (F.linear, lambda: [leaf(2, 3, 4), leaf(5, 4), leaf(5)]),
    "linear_no_bias": (F.linear, lambda: [leaf(3, 4), leaf(2, 4)]),
    "softmax": (lambda x: F.softmax(x, -1), lambda: [leaf(3, 5)]),
    "softmax_dim0": (lambda x: F.softmax(x, 0), lambda: [leaf(3, 4)]),
    "log_softmax": (lambda x: F.log_softmax(x, 1), lambda: [leaf(2, 3, 4)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, mt.tensor([1, 0, 3])), lambda: [leaf(3, 5)]),
    "cross_entropy_sum_ignore": (
        lambda x: F.cross_entropy(x, mt.tensor([1, -100, 3, 0]), reduction="sum"),
        lambda: [leaf(4, 5)]),
    "cross_entropy_none": (lambda x: F.cross_entropy(x, mt.tensor([2, 0, 1]), reduction="none"),
                           lambda: [leaf(3, 4)]),
    "cross_entropy_class_second_smoothing": (
        lambda x: F.cross_entropy(x, mt.tensor([[1, 0, 3], [2, 2, -100]]), label_smoothing=0.1),
        lambda: [leaf(2, 4, 3)]),
    "cross_entropy_btv": (lambda x: F.cross_entropy(x, mt.tensor([[1, 0], [2, 2]])),
                          lambda: [leaf(2, 2, 3)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), lambda: [leaf(2, 3, 4), leaf(4), leaf(4)]),
    "layer_norm_plain_eps": (lambda x: F.layer_norm(x, (2, 3), eps=0.1), lambda: [leaf(2, 2, 3)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), lambda: [leaf(2, 3, 4), leaf(4)]),
    "rms_norm_eps": (lambda x: F.rms_norm(x, (3,), eps=0.5), lambda: [leaf(4, 3)]),
    "gelu": (F.gelu, lambda: [leaf(3, 5)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda: [leaf(3, 5)]),
    "silu": (F.silu, lambda: [leaf(3, 5)]),
    "embedding": (lambda w: F.embedding(mt.tensor([[1, 0, 1], [3, 3, 2]]), w), lambda: [leaf(4, 3)]),
    "embedding_padding": (lambda w: F.embedding(mt.tensor([1, 0, 1, 2]), w, padding_idx=1),
                          lambda: [leaf(3, 2)]),
    "mse_loss": (F.mse_loss, lambda: [leaf(3, 4), leaf(3, 4)]),
    "mse_loss_none_broadcast": (lambda a, b: F.mse_loss(a, b, reduction="none"),
                                lambda: [leaf(3, 4), leaf(4)]),
    "dropout": (seeded(lambda x: F.dropout(x, 0.4)), lambda: [leaf(3, 4)]),
    "sdpa": (F.scaled_dot_product_attention, lambda: [leaf(2, 3, 4), leaf(2, 3, 4), leaf(2, 3, 2)]),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7),
                    lambda: [leaf(2, 2, 3, 4), leaf(2, 2, 3, 4), leaf(2, 2, 3, 3)]),
    "sdpa_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask_bool()),
                       lambda: [leaf(2, 3, 2), leaf(2, 4, 2), leaf(2, 4, 3)]),
    "sdpa_float_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=MASK),
                        lambda: [leaf(2, 2, 3, 2), leaf(2, 2, 4, 2), leaf(2, 2, 4, 2)]),
    "sdpa_broadcast_batch": (F.scaled_dot_product_attention,
                             lambda: [leaf(2, 2, 3, 2), leaf(1, 2, 3, 2), leaf(2, 1, 3, 2)]),
    "sdpa_dropout": (seeded(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)),
                     lambda: [leaf(2, 3, 2), leaf(2, 3, 2), leaf(2, 3, 2)]),
    "rope": (lambda x: ROPE(x, offset=2), lambda: [leaf(2, 3, 4)]),
}
MASK = attention_mask_float()
ROPE = RotaryEmbedding(4)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_gradgradcheck_fused(name):
    fn, make = FUSED[name]
    assert mt.gradgradcheck(fn, make())


@pytest.mark.parametrize("name", sorted(FUSED))
def test_create_graph_first_order_equals_fused_backward(name):
    """gradgradcheck checks the rules against themselves one order down; this pins their
    first derivatives to the fused kernels' (a rule off by a constant would pass there)."""
    fn, make = FUSED[name]
    inputs = make()
    outs = fn(*inputs)
    outs = [outs] if isinstance(outs, mt.Tensor) else list(outs)
    # upstream gradients that require grad: every create_graph gradient depends on them
    upstream = [mt.tensor(rng.standard_normal(o.shape), requires_grad=True) for o in outs]
    fused = mt.autograd.grad(outs, inputs, upstream, retain_graph=True, allow_unused=True)
    graphed = mt.autograd.grad(outs, inputs, upstream, create_graph=True, allow_unused=True)
    for a, b in zip(fused, graphed):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.grad_fn is None and b.grad_fn is not None
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-10, atol=1e-12)


# ---- the nodes whose math is written twice, for speed: each one named -------------------
# The core's Cython nodes (and the Python nodes of TWO_BODIES below) keep a numpy backward
# for first order and, beside it, a create-graph rule in differentiable ops: the same math
# twice. Each is named here with the calls that reach it, and its two forms must agree
# (first order, broadcasting shapes, a random upstream gradient); a new node of that kind
# fails test_every_twice_written_node_is_named until it has a line here.

def positive(*shape):
    return leaf(*shape, low=0.2, high=2.0)


def away_from_zero(*shape):
    a = rng.uniform(0.2, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return mt.tensor(a, requires_grad=True)


TWICE_WRITTEN = {
    # node type (as in the graph) -> {case: (fn, input makers)}
    "AddBackward": {"add": (lambda a, b: a + b, lambda: [leaf(3, 1), leaf(4)])},
    "SubBackward": {"sub": (lambda a, b: a - b, lambda: [leaf(2, 1, 3), leaf(4, 1)])},
    "MulBackward": {"mul": (lambda a, b: a * b, lambda: [leaf(3, 1), leaf(2, 1, 4)])},
    "DivBackward": {"div": (lambda a, b: a / b, lambda: [leaf(3, 4), positive(4)])},
    "PowBackward": {"pow": (lambda a, b: a ** b, lambda: [positive(3, 1), leaf(4)]),
                    "pow_scalar": (lambda a: a ** 3, lambda: [leaf(3, 4)])},
    "NegBackward": {"neg": (lambda a: -a, lambda: [leaf(3, 4)])},
    "MaximumBackward": {"maximum": (mt.maximum, lambda: [leaf(3, 4), leaf(4)])},
    "WhereBackward": {"where": (lambda a, b: mt.where(mt.tensor(rng.standard_normal((3, 4)) > 0), a, b),
                                lambda: [leaf(3, 1), leaf(4)])},
    "MatmulBackward": {"matmul_batch": (lambda a, b: a @ b, lambda: [leaf(2, 3, 4), leaf(4, 5)]),
                       "matmul_vector": (lambda a, b: a @ b, lambda: [leaf(4), leaf(2, 4, 3)])},
    "ExpandBackward": {"expand": (lambda a: a.expand(2, 3, 4), lambda: [leaf(3, 1)])},
    "SumBackward": {"sum": (lambda a: a.sum(1), lambda: [leaf(3, 4)])},
    "MeanBackward": {"mean": (lambda a: a.mean(0, keepdim=True), lambda: [leaf(3, 4)])},
    "VarBackward": {"var": (lambda a: a.var(1), lambda: [leaf(3, 4)])},
    "AmaxBackward": {"amax": (lambda a: mt.amax(a, 1), lambda: [leaf(3, 4)])},
    "MaxDimBackward": {"max_dim": (lambda a: a.max(1).values, lambda: [leaf(3, 4)])},
    "CastBackward": {"cast": (lambda a: a.to(mt.float32) * 1.5, lambda: [leaf(3, 4)])},
    "CatBackward": {"cat": (lambda a, b: mt.cat([a, b], 0), lambda: [leaf(2, 3), leaf(1, 3)])},
    "ClampBackward": {"clamp": (lambda a: a.clamp(-0.5, 0.5), lambda: [leaf(3, 4)])},
    "IndexBackward": {"index_basic": (lambda a: a[1:, ::2], lambda: [leaf(3, 4)]),
                      "index_gather": (lambda a: a[mt.tensor([0, 2, 0])], lambda: [leaf(3, 4)])},
    "IndexAddBackward": {"add_at": (lambda a: C.add_at(a, (np.array([0, 2, 0]),), (3, 4), False),
                                    lambda: [leaf(3, 4)])},
    "PermuteBackward": {"permute": (lambda a: a.permute(2, 0, 1), lambda: [leaf(2, 3, 4)])},
    "ReshapeBackward": {"reshape": (lambda a: a.reshape(4, 3), lambda: [leaf(3, 4)])},
    "TrilBackward": {"tril": (mt.tril, lambda: [leaf(3, 4)])},
    "DiagonalBackward": {"diagonal": (lambda a: a.diagonal(1, 0, 2), lambda: [leaf(3, 2, 4)]),
                         "diagonal_square": (lambda a: a.diagonal(), lambda: [leaf(4, 4)])},
    # one node type, one rule per kernel: each named (UNARY_KERNELS below)
    "UnaryBackward": {"exp": (mt.exp, lambda: [leaf(3, 4)]), "log": (mt.log, lambda: [positive(3, 4)]),
                      "sqrt": (mt.sqrt, lambda: [positive(3, 4)]), "tanh": (mt.tanh, lambda: [leaf(3, 4)]),
                      "sigmoid": (mt.sigmoid, lambda: [leaf(3, 4)]),
                      "relu": (mt.relu, lambda: [away_from_zero(3, 4)]),
                      "abs": (mt.abs, lambda: [away_from_zero(3, 4)])},
    # the Python nodes of TWO_BODIES that are ops
    "SoftmaxBackward": {"softmax": (lambda x: F.softmax(x, 0), lambda: [leaf(3, 4)])},
    "LogSoftmaxBackward": {"log_softmax": (lambda x: F.log_softmax(x, -1), lambda: [leaf(3, 4)])},
    "CrossEntropyBackward": {"cross_entropy": (
        lambda x: F.cross_entropy(x, mt.tensor([1, -100, 3]), label_smoothing=0.1),
        lambda: [leaf(3, 5)])},
}
UNARY_KERNELS = {"exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs"}
TWICE_CASES = {case: entry for cases in TWICE_WRITTEN.values() for case, entry in cases.items()}


def test_every_twice_written_node_is_named():
    """Every core node type with a numpy backward (and every TWO_BODIES op node) has its
    cases in TWICE_WRITTEN, and each case reaches the node it is listed under."""
    nodes = {name for name in dir(C) if isinstance(getattr(C, name), type)
             and issubclass(getattr(C, name), C.Node) and getattr(C, name) is not C.Node
             and "backward" in vars(getattr(C, name))}
    nodes |= {name.rsplit(".", 1)[1] for name in TWO_BODIES if ".ops." in name}
    nodes.discard("PointwiseBackward")            # its rows: test_every_unary_row_agrees
    assert len(nodes) >= 27, sorted(nodes)
    assert set(TWICE_WRITTEN) == nodes, (f"not named: {sorted(nodes - set(TWICE_WRITTEN))}, "
                                         f"gone: {sorted(set(TWICE_WRITTEN) - nodes)}")
    kernels = {k.split("_")[0] for k in list(C._FROM_OUTPUT) + list(C._FROM_INPUT)}
    assert kernels == UNARY_KERNELS == set(TWICE_WRITTEN["UnaryBackward"]), kernels
    for node, cases in TWICE_WRITTEN.items():
        for case, (fn, make) in cases.items():
            out = fn(*make())
            seen = set()
            stack = [out.grad_fn]
            while stack:                               # the node types the case reaches
                n = stack.pop()
                if n is not None and n not in seen:
                    seen.add(n)
                    stack.extend(t.grad_fn for t in n.inputs if t is not None)
            assert node in {type(n).__name__ for n in seen}, f"{case} does not reach {node}"


def _both_orders_agree(fn, inputs, rtol=1e-10):
    outs = fn(*inputs)
    upstream = mt.tensor(rng.standard_normal(outs.shape), dtype=outs.dtype, requires_grad=True)
    plain = mt.autograd.grad(outs, inputs, upstream, retain_graph=True, allow_unused=True)
    graphed = mt.autograd.grad(outs, inputs, upstream, create_graph=True, allow_unused=True)
    for p, q, x in zip(plain, graphed, inputs):
        assert p is not None and q is not None
        assert not p.requires_grad and q.requires_grad     # (q has a graph, or is g itself)
        assert tuple(p.shape) == tuple(q.shape) == tuple(x.shape)
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("case", sorted(TWICE_CASES))
def test_numpy_backward_equals_create_graph_rule(case):
    """The two forms of a twice-written node give the same first derivative."""
    fn, make = TWICE_CASES[case]
    _both_orders_agree(fn, make(), rtol=1e-6 if case == "cast" else 1e-10)


def test_every_unary_row_agrees():
    """ops/extra.py's _UNARY rows write each derivative once, run on arrays for first
    order and on tensors for create_graph: both runs agree, row by row."""
    from microtensor.ops.extra import _UNARY
    for name in sorted(_UNARY):
        if name in ("sign", "floor", "ceil", "trunc", "round"):
            continue                                   # a zero gradient: no graph to compare
        x = leaf(3, 4, low=0.1, high=0.9)             # inside every row's domain
        _both_orders_agree(getattr(mt, name), [x])


# ---- the engine's create_graph path ------------------------------------------------------

def test_derivatives_of_x_cubed_to_fourth_order():
    x = mt.tensor([0.5, -1.5, 2.0], requires_grad=True)
    (d1,) = mt.autograd.grad((x ** 3).sum(), x, create_graph=True)
    (d2,) = mt.autograd.grad(d1.sum(), x, create_graph=True)
    (d3,) = mt.autograd.grad(d2.sum(), x, create_graph=True)
    (d4,) = mt.autograd.grad(d3.sum(), x, allow_unused=True)
    xs = x.numpy()
    np.testing.assert_allclose(d1.numpy(), 3 * xs ** 2)
    np.testing.assert_allclose(d2.numpy(), 6 * xs)
    np.testing.assert_allclose(d3.numpy(), [6.0, 6.0, 6.0])
    assert d4 is None or np.all(d4.numpy() == 0)


def test_third_order_gradgradcheck():
    """gradgradcheck of a function that is itself a gradient checks third derivatives."""
    def first_derivative(x, w):
        y = F.gelu(x @ w).tanh().sum()
        return mt.autograd.grad(y, [x, w], create_graph=True)
    assert mt.gradgradcheck(first_derivative, [leaf(2, 3), leaf(3, 2)])


def test_backward_create_graph_keeps_the_graph_of_grad():
    x = leaf(4)
    y = (x.tanh() * x).sum()
    y.backward(create_graph=True)
    assert x.grad is not None and x.grad.grad_fn is not None
    first = x.grad.numpy().copy()
    xs, t = x.numpy(), np.tanh(x.numpy())
    np.testing.assert_allclose(first, t + xs * (1 - t * t), rtol=1e-12)
    # a gradient penalty: d/dx sum(g^2) = 2 g g'; .grad accumulates it on top of g
    (x.grad ** 2).sum().backward()
    second = 2 * first * (2 * (1 - t * t) - 2 * xs * t * (1 - t * t))
    np.testing.assert_allclose(x.grad.numpy(), first + second, rtol=1e-10)


def test_grad_with_respect_to_grad_outputs():
    """grad_outputs that require grad: the gradient is differentiable in them too."""
    x, u = leaf(3, 4), leaf(3, 4)
    (gx,) = mt.autograd.grad(x.exp(), x, grad_outputs=u, create_graph=True)
    (du,) = mt.autograd.grad(gx.sum(), u)
    np.testing.assert_allclose(du.numpy(), np.exp(x.numpy()), rtol=1e-12)


def test_create_graph_defaults_to_retaining_the_graph():
    x = leaf(3)
    y = (x * x).sum()
    (g,) = mt.autograd.grad(y, x, create_graph=True)
    (again,) = mt.autograd.grad(y, x)          # the graph is still there
    np.testing.assert_allclose(again.numpy(), g.numpy())


def test_without_create_graph_gradients_have_no_graph():
    x, w = leaf(2, 3), leaf(4, 3)
    (g,) = mt.autograd.grad(F.gelu(F.linear(x, w)).sum(), x)
    assert g.grad_fn is None and not g.requires_grad
    F.layer_norm(x, (3,)).sum().backward()
    assert x.grad.grad_fn is None


def test_first_order_backward_never_runs_a_create_graph_rule():
    """Without create_graph the fused kernels do all the work: a model's backward with
    the create-graph entry point replaced by one that raises still succeeds."""
    def refuse(node, grad_output):
        raise AssertionError(f"create_graph rule called for {node.name()}")
    mt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=7, block_size=5, n_layer=1, n_head=2, n_embd=8)).double()
    idx, targets = mt.randint(0, 7, (2, 5)), mt.randint(0, 7, (2, 5))
    C.register_create_graph_rule(refuse)
    try:
        model(idx, targets)[1].backward()
        with pytest.raises(AssertionError, match="create_graph rule called"):
            mt.autograd.grad(model(idx, targets)[1], list(model.parameters()), create_graph=True)
    finally:
        C.register_create_graph_rule(higher_order.create_graph_rule)
    assert all(p.grad is not None and p.grad.grad_fn is None for p in model.parameters())


def test_hooks_see_differentiable_gradients():
    x = leaf(3)
    h = x * 2.0
    seen = []
    h.register_hook(lambda g: seen.append(g.grad_fn is not None) or g * h)
    (g,) = mt.autograd.grad((h * h).sum(), x, create_graph=True)
    assert seen == [True]
    # dy/dh = 2h, the hook makes it 2h * h; dy/dx = 2 * 2h^2 = 16 x^2
    np.testing.assert_allclose(g.numpy(), 16 * x.numpy() ** 2, rtol=1e-12)
    # differentiating g passes through h again, so the hook fires again (as torch's
    # does): d sum(4h^2)/dh = 8h, times h -> 8h^2, times 2 -> 64 x^2
    (gg,) = mt.autograd.grad(g.sum(), x)
    assert seen == [True, False]
    np.testing.assert_allclose(gg.numpy(), 64 * x.numpy() ** 2, rtol=1e-12)


def test_a_model_can_be_differentiated_twice():
    mt.manual_seed(0)
    cfg = GPTConfig(vocab_size=7, block_size=5, n_layer=1, n_head=2, n_embd=8)
    model = GPT(cfg).double()
    idx, targets = mt.randint(0, 7, (2, 5)), mt.randint(0, 7, (2, 5))
    params = list(model.parameters())
    _, loss = model(idx, targets)
    grads = mt.autograd.grad(loss, params, create_graph=True)
    assert all(g.grad_fn is not None for g in grads)
    penalty = sum((g * g).sum() for g in grads)
    penalty.backward()
    assert all(p.grad is not None and np.isfinite(p.grad.numpy()).all() for p in params)


# ---- negative tests: a wrong double-backward rule fails -----------------------------------

def test_gradgradcheck_catches_a_rule_built_from_saved_arrays(monkeypatch):
    """The classic bug: a rule that multiplies by the saved forward value (a numpy
    array, a constant) instead of the saved output as a tensor with a graph. Its first
    derivative is right, so gradcheck passes; the second is missing a term."""
    def tanh_from_saved(y, g):
        return C.mul(g, 1 - y.numpy() ** 2)
    monkeypatch.setitem(C._FROM_OUTPUT, "tanh_backward", tanh_from_saved)
    x = leaf(2, 3)
    assert mt.gradcheck(mt.tanh, [x])
    (g,) = mt.autograd.grad(x.tanh().sum(), x, create_graph=True)
    np.testing.assert_allclose(g.numpy(), 1 - np.tanh(x.numpy()) ** 2)   # first order fine
    with pytest.raises(mt.autograd.GradcheckError, match="second-order .* input 0"):
        mt.gradgradcheck(mt.tanh, [x])
    assert mt.gradgradcheck(mt.tanh, [x], raise_exception=False) is False
    # fast mode (random projections, two evaluations per direction) sees it too
    assert mt.gradgradcheck(mt.tanh, [x], fast_mode=True, raise_exception=False) is False


def test_fast_mode_passes_correct_rules():
    x, w = leaf(3, 4), leaf(5, 4)
    fn = (lambda x, w: F.gelu(F.linear(x, w)).tanh())
    assert mt.gradcheck(fn, [x, w], fast_mode=True)
    assert mt.gradgradcheck(fn, [x, w], fast_mode=True)


def test_gradgradcheck_catches_a_wrong_fused_rule(monkeypatch):
    """softmax's rule with the saved output as a constant (no graph back to x)."""
    def softmax_from_saved(node, g):
        y = mt.tensor(np.moveaxis(node.out.reshape(node.moved_shape), -1, node.dim))
        return (y * (g - (g * y).sum(node.dim, keepdim=True)),)
    monkeypatch.setattr(F.SoftmaxBackward, "create_graph", softmax_from_saved)
    with pytest.raises(mt.autograd.GradcheckError, match="input 0"):
        mt.gradgradcheck(lambda x: F.softmax(x, -1), [leaf(2, 4)])


def test_gradgradcheck_catches_a_wrong_gradient_in_grad_outputs(monkeypatch):
    """A rule that drops g from the graph (it uses g's values as a constant)."""
    def exp_detached(y, g):
        return C.mul(g.detach(), y)
    monkeypatch.setitem(C._FROM_OUTPUT, "exp_backward", exp_detached)
    with pytest.raises(mt.autograd.GradcheckError, match="grad_output 0"):
        mt.gradgradcheck(mt.exp, [leaf(3)])


# ---- once-differentiable and unknown nodes --------------------------------------------------

class Cube(mt.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad_output


def test_function_backward_is_differentiable_again():
    # its backward is written from tensor ops, so create_graph gives a graph through it
    x = leaf(3)
    (g,) = mt.autograd.grad(Cube.apply(x).sum(), x, create_graph=True)
    np.testing.assert_allclose(g.numpy(), 3 * x.numpy() ** 2)
    (gg,) = mt.autograd.grad(g.sum(), x)
    np.testing.assert_allclose(gg.numpy(), 6 * x.numpy())
    assert mt.gradgradcheck(Cube.apply, [leaf(3)])


def test_once_differentiable_function_raises_when_differentiated_twice():
    class OnceCube(Cube):
        @staticmethod
        @mt.autograd.function.once_differentiable
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            return 3 * x * x * grad_output
    x = leaf(3)
    (g,) = mt.autograd.grad(OnceCube.apply(x).sum(), x, create_graph=True)
    np.testing.assert_allclose(g.numpy(), 3 * x.numpy() ** 2)
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable.*OnceCube"):
        g.sum().backward()


def test_a_node_without_a_rule_fails_only_when_differentiated_twice():
    class Twice(mt.Node):
        def backward(self, g):
            return (2 * g,)
    x = leaf(3)
    y = mt.autograd.wrap(2 * x.numpy())
    mt.autograd.attach(y, Twice(), (x,))
    (g,) = mt.autograd.grad(y.sum(), x, create_graph=True)
    np.testing.assert_allclose(g.numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(RuntimeError, match="Twice has no create_graph rule"):
        mt.autograd.grad((g * x).sum(), x)


# ---- a tiny GPT's Hessian-vector product against PyTorch ----------------------------------

def load_torch_gpt():
    spec = importlib.util.spec_from_file_location("torch_gpt",
                                                  os.path.join(ROOT, "benchmarks", "torch_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_gpt_hessian_vector_product_matches_torch():
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch_gpt = load_torch_gpt()
    mt.manual_seed(3)
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)
    model = GPT(cfg).double()
    reference = torch_gpt.from_microtensor(model, torch.float64)
    idx, targets = mt.randint(0, 11, (2, 6)), mt.randint(0, 11, (2, 6))
    names = [n for n, _ in model.named_parameters()]
    t_params = dict(reference.named_parameters())
    assert sorted(names) == sorted(t_params)
    params = [p for _, p in model.named_parameters()]
    vs = [rng.standard_normal(p.shape) for p in params]

    # microtensor: H v = d/dp <grad loss, v>
    _, loss = model(idx, targets)
    grads = mt.autograd.grad(loss, params, create_graph=True)
    dot = sum((g * mt.tensor(v)).sum() for g, v in zip(grads, vs))
    hv = mt.autograd.grad(dot, params)

    # torch (its fused CPU attention has no double backward: the math kernel)
    with sdpa_kernel(SDPBackend.MATH):
        _, t_loss = reference(torch.from_numpy(idx.numpy()), torch.from_numpy(targets.numpy()))
        tp = [t_params[n] for n in names]
        t_grads = torch.autograd.grad(t_loss, tp, create_graph=True)
        t_dot = sum((g * torch.from_numpy(v)).sum() for g, v in zip(t_grads, vs))
        t_hv = torch.autograd.grad(t_dot, tp)

    np.testing.assert_allclose(loss.item(), t_loss.item(), rtol=1e-12)
    ours = np.concatenate([h.numpy().ravel() for h in hv])
    theirs = np.concatenate([h.numpy().ravel() for h in t_hv])
    assert np.linalg.norm(ours - theirs) <= 1e-8 * np.linalg.norm(theirs)
    for name, a, b in zip(names, hv, t_hv):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8,
                                   atol=1e-8 * np.abs(theirs).max(), err_msg=name)


# ---- examples/double_backprop.py: a gradient-norm penalty trains, and matches torch --------

def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_double_backprop_trains_and_matches_torch():
    example = load_example("double_backprop")
    options = dict(penalty=0.5, steps=20, lr=0.2, hidden=8, n_points=40, log_every=10)
    ours, history = example.train("microtensor", **options)
    plain, plain_history = example.train("microtensor", **dict(options, penalty=0.0))
    # both learn; the penalised run ends with a several times smaller input gradient
    assert history[-1][1] < 0.6 * history[0][1] and plain_history[-1][1] < 0.6 * history[0][1]
    assert history[-1][2] < 0.25 * plain_history[-1][2]
    pytest.importorskip("torch")
    theirs, t_history = example.train("torch", **options)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose([h[1:] for h in history], [h[1:] for h in t_history], rtol=1e-10)


# ---- examples/gradcheck_layers.py's second-order column ------------------------------------

@pytest.mark.parametrize("case", ["mha causal rope", "block postnorm rmsnorm", "gpt defaults",
                                  "encoder-decoder prenorm untied"])
def test_gradcheck_layers_second_order_column(case):
    example = load_example("gradcheck_layers")
    mt.manual_seed(0)
    fn, inputs, _ = dict(example.CASES)[case]()
    abs_err, rel_err, passed = example.second_order_errors(fn, inputs)
    assert passed and rel_err < 1e-5, (abs_err, rel_err)


# ---- examples/sharpness.py: the sharpness estimate, and the quick study --------------------

def test_power_iteration_finds_the_top_hessian_eigenvalue():
    """Against numpy's eigenvalues of the full Hessian (mt.autograd.functional.hessian),
    also when the eigenvalue of largest magnitude is negative (the shifted pass)."""
    example = load_example("sharpness")
    r = np.random.default_rng(5)
    a = r.standard_normal((4, 4))
    for shift in (0.0, -12.0):                     # the second makes the bottom dominant
        sym = a @ a.T + shift * np.eye(4) + np.diag([3.0, 0.0, 0.0, 0.0])
        w = mt.tensor(r.standard_normal(4), requires_grad=True)

        def loss_of(w):
            return 0.5 * (w @ mt.tensor(sym) @ w) + (w ** 4).sum() * 0.01
        hessian = mt.autograd.functional.hessian(loss_of, w).numpy()
        top = np.linalg.eigvalsh(hessian)[-1]
        lam, v, n = example.sharpness(loss_of(w), [w], [r.standard_normal(4)], r, 500, 1e-10)
        np.testing.assert_allclose(lam, top, rtol=1e-6)
        if shift:
            assert np.abs(np.linalg.eigvalsh(hessian)).argmax() == 0   # it was dominated


def test_sharpness_quick_study_reaches_the_edge_of_stability(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    example = load_example("sharpness")
    args = example.parse_args(["--quick", "--out", str(tmp_path), "--skip", "transformer"])
    results = example.study(args)
    runs = results["mlp"]
    assert [r["lr"] for r in runs] == args.mlp_lrs
    for r in runs:
        # GD reaches 2/lr and then stays there (the loss still falls, not monotonically)
        assert r["reached_at"] is not None, r
        assert 0.9 < r["ratio_median"] < 1.2, r
        assert r["final_loss"] < 0.05 * r["losses"][0] and r["loss_increases"] > 0
    paths = example.draw(results, args)
    assert sorted(os.listdir(tmp_path)) == ["sharpness_mlp.png", "sharpness_ratio.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


# ---- where a rule lives -----------------------------------------------------------------

def _python_nodes():
    """Every Node subclass defined in Python in the package (its own module's class)."""
    import importlib
    import inspect as pyinspect
    import pkgutil
    import microtensor
    from microtensor.core._core import Node
    found = {}
    for info in pkgutil.walk_packages(microtensor.__path__, "microtensor."):
        if info.name.startswith("microtensor.kernels._fused") or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in pyinspect.getmembers(module, pyinspect.isclass):
            if issubclass(cls, Node) and cls is not Node and cls.__module__ != "microtensor.core._core":
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_no_rule_is_found_by_a_name():
    """A rule is its node's create_graph method: no table of rules keyed by class or by a
    dotted name (a name goes stale silently when a class moves)."""
    from microtensor.autograd import graph_rules, higher_order
    for module in (graph_rules, higher_order):
        assert not hasattr(module, "RULES") and not hasattr(module, "register"), module
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "microtensor")
    for dirpath, _, files in os.walk(src):
        for name in files:
            if name.endswith((".py", ".pyx", ".pxi")):
                text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                assert "@register(" not in text and "RULES[" not in text, name
    assert not [f for f in os.listdir(os.path.join(src, "autograd")) if f.startswith("_rules_")]


# nodes that are once differentiable on purpose: differentiating their gradient again
# raises an error naming the node (tests below), it is never silently zero
ONCE_DIFFERENTIABLE = set()


def test_every_node_keeps_its_rule_beside_its_backward():
    """Every node type of the package, the core's Cython nodes and the Python ones,
    defines its create-graph rule in its own class body, next to backward: create_graph
    itself, or, for a fused op (FusedNode), the composite of primitives it is derived from."""
    import importlib
    import microtensor.core._core as core
    from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode
    nodes = dict(_python_nodes())
    for base in (DifferentiableRule, FusedNode):
        nodes.pop(f"{base.__module__}.{base.__qualname__}")
    for name in dir(core):
        cls = getattr(core, name)
        if isinstance(cls, type) and issubclass(cls, core.Node) and cls is not core.Node \
                and "backward" in vars(cls):
            nodes[f"microtensor.core._core.{name}"] = cls
    assert len(nodes) > 40, sorted(nodes)             # the walk found the op modules

    def has_rule(cls):
        if issubclass(cls, FusedNode):
            return "composite" in vars(cls) and "backward" in vars(cls)
        return "create_graph" in vars(cls)
    missing = sorted(n for n, cls in nodes.items() if not has_rule(cls) and n not in ONCE_DIFFERENTIABLE)
    assert not missing, f"nodes without a create_graph rule beside their backward: {missing}"
    for module, cls in (("microtensor.core._core", "AddBackward"), ("microtensor.core._core", "UnaryBackward"),
                        ("microtensor.ops.index", "ScatterBackward")):
        assert "create_graph" in vars(getattr(importlib.import_module(module), cls)), cls
    assert "composite" in vars(importlib.import_module("microtensor.ops.activations").GeluBackward)


# The Python nodes that still write a derivative twice (a first-order backward and a
# create_graph rule), each with its reason; a new one must be a DifferentiableRule (the
# rule written once) or a FusedNode (a kernel with its composite declared).
TWO_BODIES = {
    # they read the saved output y, as PyTorch's do, so that x may change in place after
    # the forward pass; a composite would read x again
    "microtensor.ops.activations.SoftmaxBackward", "microtensor.ops.activations.LogSoftmaxBackward",
    # its rule is the derivative of log_softmax with weights, ignore_index and label
    # smoothing, on the saved log-probabilities
    "microtensor.ops.losses.CrossEntropyBackward",
    # one derivative per op in _UNARY, written once over arrays or tensors (ops/extra.py)
    "microtensor.ops.extra.PointwiseBackward",
    # autograd.Function's machinery, not an op
    "microtensor.autograd.function.FunctionBackward", "microtensor.autograd.function.FunctionOutputBackward",
    "microtensor.autograd.function._FunctionNode",
    "microtensor.autograd.higher_order.NotDifferentiableTwiceBackward",
}


def test_the_math_of_each_python_node_is_written_once():
    """A Python node either writes its rule once (DifferentiableRule: create_graph only,
    first order runs it with grad off), or is a fused kernel with its composite declared
    (FusedNode: no create_graph of its own), or is listed in TWO_BODIES with its reason."""
    from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode
    nodes = {n: c for n, c in _python_nodes().items() if c not in (DifferentiableRule, FusedNode)
             and ("backward" in vars(c) or "create_graph" in vars(c) or "composite" in vars(c))}
    written_twice = []
    for name, cls in sorted(nodes.items()):
        if issubclass(cls, DifferentiableRule):
            assert "backward" not in vars(cls), f"{name}: a DifferentiableRule with a backward of its own"
        elif issubclass(cls, FusedNode):
            assert "create_graph" not in vars(cls), f"{name}: a FusedNode with a hand-written create_graph"
        elif name not in TWO_BODIES:
            written_twice.append(name)
    assert not written_twice, f"nodes whose derivative is written twice: {written_twice}"
    assert not TWO_BODIES - set(nodes), f"TWO_BODIES lists nodes that are gone: {TWO_BODIES - set(nodes)}"
    assert sum(issubclass(c, FusedNode) for c in nodes.values()) >= 10
    assert sum(issubclass(c, DifferentiableRule) for c in nodes.values()) >= 8


