"""Every differentiable row of the op registry is second-order checked.

The second-order checks live in three tables: test_ops.py's OPS (the core's ops),
test_higher_order.py's FUSED (the fused ops and their options) and SECOND_ORDER below
(every other differentiable row: the ops written in Python, F's losses and
activations, mt.linalg's norms). `test_every_differentiable_row_is_second_order_checked`
walks `mt.ops.registry()` and runs each table's functions once with every op wrapped
(the profiler's and mt.compile's interception), noting which row each case calls at
its top level: a row that no case calls and that is not exempt below (with its reason)
fails the walk. A row added tomorrow without a second-order case fails it too.
"""
import numpy as np
import pytest

import microtensor as mt
import microtensor.core._core as C
import microtensor.nn.functional as F
from microtensor.ops import _intercept

import test_higher_order
import test_ops

RNG = np.random.default_rng(2024)


def normal(*shape):
    return RNG.standard_normal(shape)


def positive(*shape):
    return RNG.uniform(0.5, 2.0, shape)


def unit(*shape):
    """In (-0.9, 0.9): asin, atanh, erfinv."""
    return RNG.uniform(-0.9, 0.9, shape)


def prob(*shape):
    """In (0.1, 0.9): logit, binary cross-entropy's input."""
    return RNG.uniform(0.1, 0.9, shape)


def away(*shape):
    """At least 0.1 away from 0 and from every integer: kinks (abs, sign, floor,
    round, clamp at 0) stay further than gradgradcheck's step."""
    base = RNG.integers(-3, 3, shape) + RNG.uniform(0.15, 0.35, shape)
    return base * RNG.choice([-1.0, 1.0], shape)


def distinct(*shape):
    """Well-separated values: no ties in sort, median, cummax, kthvalue."""
    n = int(np.prod(shape))
    return (RNG.permutation(n) * 0.37 - n * 0.17).reshape(shape)


def leaves(*arrays):
    return [mt.tensor(a, requires_grad=True) for a in arrays]


# row label -> (fn, input arrays maker): inputs are leaves in float64
SECOND_ORDER = {
    # ---- pointwise (ops/extra.py and the core's) ----
    "cos": (mt.cos, lambda: [normal(3, 4)]),
    "tan": (mt.tan, lambda: [unit(3, 4)]),
    "asin": (mt.asin, lambda: [unit(3, 4)]),
    "acos": (mt.acos, lambda: [unit(3, 4)]),
    "atan": (mt.atan, lambda: [normal(3, 4)]),
    "sinh": (mt.sinh, lambda: [normal(3, 4)]),
    "cosh": (mt.cosh, lambda: [normal(3, 4)]),
    "asinh": (mt.asinh, lambda: [normal(3, 4)]),
    "atanh": (mt.atanh, lambda: [unit(3, 4)]),
    "expm1": (mt.expm1, lambda: [normal(3, 4)]),
    "exp2": (mt.exp2, lambda: [normal(3, 4)]),
    "log2": (mt.log2, lambda: [positive(3, 4)]),
    "log10": (mt.log10, lambda: [positive(3, 4)]),
    "reciprocal": (mt.reciprocal, lambda: [positive(3, 4)]),
    "erf": (mt.erf, lambda: [normal(3, 4)]),
    "erfc": (mt.erfc, lambda: [normal(3, 4)]),
    "erfinv": (mt.erfinv, lambda: [unit(3, 4)]),
    "logit": (mt.logit, lambda: [prob(3, 4)]),
    "frac": (mt.frac, lambda: [away(3, 4)]),
    "sign": (mt.sign, lambda: [away(3, 4)]),
    "sgn": (mt.sgn, lambda: [away(3, 4)]),
    "floor": (mt.floor, lambda: [away(3, 4)]),
    "ceil": (mt.ceil, lambda: [away(3, 4)]),
    "trunc": (mt.trunc, lambda: [away(3, 4)]),
    "fix": (mt.fix, lambda: [away(3, 4)]),
    "round": (mt.round, lambda: [away(3, 4)]),
    "clamp_min": (lambda x: mt.clamp_min(x, 0.05), lambda: [away(3, 4)]),
    "clamp_max": (lambda x: mt.clamp_max(x, 0.05), lambda: [away(3, 4)]),
    "float_power": (mt.float_power, lambda: [positive(3, 4), normal(4)]),
    "xlogy": (mt.xlogy, lambda: [normal(3, 4), positive(3, 4)]),
    "lerp": (mt.lerp, lambda: [normal(3, 4), normal(3, 4), normal(4)]),
    "rsqrt": (mt.rsqrt, lambda: [positive(3, 4)]),
    "square": (mt.square, lambda: [normal(3, 4)]),
    "atan2": (mt.atan2, lambda: [normal(3, 4), positive(3, 4)]),
    "fmod": (mt.fmod, lambda: [positive(3, 4) * 3, positive(3, 4)]),
    "nan_to_num": (mt.nan_to_num, lambda: [normal(3, 4)]),
    "cross": (lambda a, b: mt.cross(a, b, dim=1), lambda: [normal(2, 3), normal(2, 3)]),
    "type_as": (lambda x: x.type_as(mt.zeros(1, dtype=mt.float64)), lambda: [normal(3)]),
    # ---- reductions ----
    "prod": (lambda x: mt.prod(x, 1), lambda: [positive(3, 4)]),
    "logcumsumexp": (lambda x: mt.logcumsumexp(x, 1), lambda: [normal(3, 4)]),
    "cummax": (lambda x: mt.cummax(x, 1)[0], lambda: [distinct(3, 4)]),
    "cummin": (lambda x: mt.cummin(x, 1)[0], lambda: [distinct(3, 4)]),
    "median": (lambda x: mt.median(x, 1)[0], lambda: [distinct(3, 5)]),
    "std_mean": (lambda x: mt.std_mean(x, 1), lambda: [normal(3, 4)]),
    "var_mean": (lambda x: mt.var_mean(x, 0), lambda: [normal(3, 4)]),
    "msort": (mt.msort, lambda: [distinct(4, 3)]),
    "kthvalue": (lambda x: mt.kthvalue(x, 2, 1)[0], lambda: [distinct(3, 5)]),
    "trace": (mt.trace, lambda: [normal(4, 4)]),
    "dist": (mt.dist, lambda: [normal(3, 4), normal(3, 4)]),
    "cdist": (mt.cdist, lambda: [normal(3, 2), normal(4, 2)]),
    "linalg.vector_norm": (lambda x: mt.linalg.vector_norm(x, 3, 1), lambda: [away(3, 4)]),
    "linalg.matrix_norm": (mt.linalg.matrix_norm, lambda: [normal(3, 4)]),
    "linalg.norm": (lambda x: mt.linalg.norm(x, dim=1), lambda: [normal(3, 4)]),
    # ---- matrix products ----
    "addmm": (mt.addmm, lambda: [normal(4), normal(3, 2), normal(2, 4)]),
    "mm": (mt.mm, lambda: [normal(3, 2), normal(2, 4)]),
    "mv": (mt.mv, lambda: [normal(3, 2), normal(2)]),
    "dot": (mt.dot, lambda: [normal(5), normal(5)]),
    "vdot": (mt.vdot, lambda: [normal(5), normal(5)]),
    "inner": (mt.inner, lambda: [normal(2, 3), normal(4, 3)]),
    "outer": (mt.outer, lambda: [normal(3), normal(4)]),
    "ger": (mt.ger, lambda: [normal(2), normal(3)]),
    "baddbmm": (mt.baddbmm, lambda: [normal(2, 3, 4), normal(2, 3, 2), normal(2, 2, 4)]),
    "kron": (mt.kron, lambda: [normal(2, 2), normal(2, 3)]),
    "einsum": (lambda a, b: mt.einsum("ij,jk->ik", a, b), lambda: [normal(3, 2), normal(2, 4)]),
    "tensordot": (lambda a, b: mt.tensordot(a, b, 1), lambda: [normal(3, 2), normal(2, 4)]),
    # ---- indexing ----
    "take_along_dim": (lambda x: mt.take_along_dim(x, mt.tensor([[0, 2], [1, 1], [3, 0]]), 1),
                       lambda: [normal(3, 4)]),
    "take": (lambda x: mt.take(x, mt.tensor([0, 5, 5, 11])), lambda: [normal(3, 4)]),
    "scatter": (lambda x, s: mt.scatter(x, 1, mt.tensor([[0, 2], [1, 3]]), s),
                lambda: [normal(2, 4), normal(2, 2)]),
    "index_add": (lambda x, s: mt.index_add(x, 0, mt.tensor([0, 2, 0]), s),
                  lambda: [normal(3, 2), normal(3, 2)]),
    "index_fill": (lambda x: mt.index_fill(x, 1, mt.tensor([0, 2]), -1.0), lambda: [normal(3, 4)]),
    "masked_select": (lambda x: mt.masked_select(x, mt.tensor(np.eye(3, 4, dtype=bool))),
                      lambda: [normal(3, 4)]),
    "diag": (mt.diag, lambda: [normal(3, 3)]),
    # ---- shapes ----
    "view_as": (lambda x: x.view_as(mt.zeros(4, 3)), lambda: [normal(3, 4)]),
    "reshape_as": (lambda x: x.reshape_as(mt.zeros(2, 6)), lambda: [normal(3, 4)]),
    "broadcast_to": (lambda x: mt.broadcast_to(x, (2, 3, 4)), lambda: [normal(3, 1)]),
    "broadcast_tensors": (mt.broadcast_tensors, lambda: [normal(3, 1), normal(4)]),
    "atleast_1d": (mt.atleast_1d, lambda: [normal()]),
    "atleast_2d": (mt.atleast_2d, lambda: [normal(3)]),
    "hstack": (lambda a, b: mt.hstack([a, b]), lambda: [normal(2, 3), normal(2, 1)]),
    "vstack": (lambda a, b: mt.vstack([a, b]), lambda: [normal(2, 3), normal(3)]),
    "column_stack": (lambda a, b: mt.column_stack([a, b]), lambda: [normal(3), normal(3, 2)]),
    "meshgrid": (lambda a, b: mt.meshgrid(a, b, indexing="ij"), lambda: [normal(3), normal(2)]),
    "tensor_split": (lambda x: mt.tensor_split(x, 3, 1), lambda: [normal(2, 5)]),
    "rot90": (lambda x: mt.rot90(x, 1, (0, 1)), lambda: [normal(2, 3)]),
    "fliplr": (mt.fliplr, lambda: [normal(2, 3)]),
    "flipud": (mt.flipud, lambda: [normal(2, 3)]),
    "tile": (lambda x: mt.tile(x, (2, 1)), lambda: [normal(2, 3)]),
    "repeat_interleave": (lambda x: mt.repeat_interleave(x, 2, 1), lambda: [normal(2, 3)]),
    "narrow": (lambda x: mt.narrow(x, 1, 1, 2), lambda: [normal(2, 4)]),
    "select": (lambda x: mt.select(x, 1, 2), lambda: [normal(2, 4)]),
    "unbind": (lambda x: mt.unbind(x, 1), lambda: [normal(2, 3)]),
    "movedim": (lambda x: mt.movedim(x, 0, 2), lambda: [normal(2, 3, 4)]),
    "moveaxis": (lambda x: mt.moveaxis(x, 2, 0), lambda: [normal(2, 3, 4)]),
    "swapaxes": (lambda x: mt.swapaxes(x, 0, 2), lambda: [normal(2, 3, 4)]),
    "swapdims": (lambda x: mt.swapdims(x, 1, 2), lambda: [normal(2, 3, 4)]),
    "t": (mt.t, lambda: [normal(2, 3)]),
    # ---- F: activations ----
    "F.relu": (F.relu, lambda: [away(3, 4)]),
    "F.sigmoid": (F.sigmoid, lambda: [normal(3, 4)]),
    "F.tanh": (F.tanh, lambda: [normal(3, 4)]),
    "F.celu": (lambda x: F.celu(x, 0.7), lambda: [away(3, 4)]),
    "F.elu": (lambda x: F.elu(x, 1.3), lambda: [away(3, 4)]),
    "F.hardsigmoid": (F.hardsigmoid, lambda: [away(3, 4)]),
    "F.hardswish": (F.hardswish, lambda: [away(3, 4)]),
    "F.hardtanh": (F.hardtanh, lambda: [away(3, 4)]),
    "F.leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda: [away(3, 4)]),
    "F.logsigmoid": (F.logsigmoid, lambda: [normal(3, 4)]),
    "F.mish": (F.mish, lambda: [normal(3, 4)]),
    "F.relu6": (F.relu6, lambda: [away(3, 4)]),
    "F.selu": (F.selu, lambda: [away(3, 4)]),
    "F.softplus": (lambda x: F.softplus(x, beta=1.5), lambda: [normal(3, 4)]),
    "F.softsign": (F.softsign, lambda: [normal(3, 4)]),
    "F.tanhshrink": (F.tanhshrink, lambda: [normal(3, 4)]),
    "F.softmin": (lambda x: F.softmin(x, 1), lambda: [normal(3, 4)]),
    "F.glu": (lambda x: F.glu(x, 1), lambda: [normal(3, 4)]),
    "F.gumbel_softmax": (lambda x: (mt.manual_seed(3), F.gumbel_softmax(x, tau=0.7))[1],
                         lambda: [normal(3, 4)]),
    # ---- F: losses, distances, normalisation ----
    "F.binary_cross_entropy": (F.binary_cross_entropy, lambda: [prob(3, 4), prob(3, 4)]),
    "F.binary_cross_entropy_with_logits": (
        lambda x, t: F.binary_cross_entropy_with_logits(x, t, pos_weight=mt.tensor([2.0] * 4)),
        lambda: [normal(3, 4), prob(3, 4)]),
    "F.nll_loss": (lambda x: F.nll_loss(x, mt.tensor([1, 0, 3])), lambda: [normal(3, 4)]),
    "F.huber_loss": (lambda a, b: F.huber_loss(a, b, delta=0.8), lambda: [normal(3, 4), normal(3, 4)]),
    "F.smooth_l1_loss": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.8),
                         lambda: [normal(3, 4), normal(3, 4)]),
    "F.l1_loss": (F.l1_loss, lambda: [away(3, 4), np.zeros((3, 4))]),
    "F.kl_div": (lambda a, b: F.kl_div(a, b, reduction="batchmean"),
                 lambda: [normal(3, 4), prob(3, 4)]),
    "F.cosine_similarity": (F.cosine_similarity, lambda: [normal(3, 4), normal(1, 4)]),
    "F.pairwise_distance": (F.pairwise_distance, lambda: [normal(3, 4), normal(3, 4)]),
    "F.normalize": (lambda x: F.normalize(x, dim=1), lambda: [normal(3, 4)]),
    "F.batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                     lambda: [normal(4, 3), normal(3), normal(3)]),
    "F.pad": (lambda x: F.pad(x, (1, 2), value=0.5), lambda: [normal(2, 3)]),
}

# row label -> why it is in no second-order check (the kinds "creation" and "inplace"
# are exempt as a whole: see KIND_EXEMPT)
_BOOL = "a bool result: no gradient"
_INDEX = "an integer result (indices or counts): no gradient"
_VALUE = "a Python value or a shape, not a tensor"
_RANDOM = "a random draw: no gradient (as torch)"
EXEMPT = {
    **{name: _BOOL for name in """lt le gt ge eq ne logical_not logical_and logical_or
       logical_xor isnan isfinite isinf isposinf isneginf isclose any all""".split()},
    **{name: _INDEX for name in """argmax argmin argsort nonzero argwhere count_nonzero
       bincount histc F.one_hot""".split()},
    **{name: _VALUE for name in """allclose equal is_floating_point is_nonzero is_contiguous
       broadcast_shapes data_ptr stride""".split()},
    **{name: _RANDOM for name in """normal poisson bernoulli bernoulli_ exponential_
       random_""".split()},
    "floor_divide": "integer-valued: no gradient (torch defines none; the result does not "
                    "require grad)",
    "unique": "no gradient (torch defines none; the result does not require grad)",
    "unique_consecutive": "no gradient (torch defines none; the result does not require grad)",
    "half": "a cast to float16, where a float64 finite-difference check means nothing; "
            "the cast's rule is the one type_as and .to() run (checked above)",
}
KIND_EXEMPT = {
    "creation": "makes a tensor from sizes or values: no tensor input to differentiate",
    "inplace": "in place, refused under autograd (the engine records no in-place op)",
}


# ---- the second-order checks of the rows above -------------------------------------------

@pytest.mark.parametrize("label", sorted(SECOND_ORDER))
def test_gradgradcheck_row(label):
    fn, make = SECOND_ORDER[label]
    assert mt.gradgradcheck(fn, leaves(*make()))


@pytest.mark.parametrize("label", sorted(SECOND_ORDER))
def test_create_graph_first_order_equals_backward(label):
    """gradgradcheck checks a create-graph rule against itself one order down; this pins
    its first derivatives to the backward's (a rule off by a factor that is constant to
    the second pass, such as a denominator taken as a constant, fails one or the other)."""
    fn, make = SECOND_ORDER[label]
    inputs = leaves(*make())
    outs = fn(*inputs)
    outs = [outs] if isinstance(outs, mt.Tensor) else [o for o in outs if isinstance(o, mt.Tensor)]
    upstream = [mt.tensor(RNG.standard_normal(o.shape), requires_grad=True) for o in outs]
    plain = mt.autograd.grad(outs, inputs, upstream, retain_graph=True, allow_unused=True)
    graphed = mt.autograd.grad(outs, inputs, upstream, create_graph=True, allow_unused=True)
    for a, b in zip(plain, graphed):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-10, atol=1e-12)


def test_binary_cross_entropy_second_order_catches_a_constant_denominator(monkeypatch):
    """The planted bug that once passed everything: BCE's create-graph rule with x (1 - x)
    in its denominator taken as a constant. Its first order is right; its second is not."""
    from microtensor.ops import losses
    from microtensor.autograd.graph_rules import _const
    rule = losses.BinaryCrossEntropyBackward.create_graph
    core = losses._core

    def constant_denominator(self, g):
        real_mul = core.mul

        def mul(a, b):          # the denominator x (1 - x) built from the saved array
            if a is self.inputs[0] and isinstance(b, mt.Tensor) and b.grad_fn is not None:
                xa = self.x
                return _const(xa * (1 - xa), g.dtype)
            return real_mul(a, b)
        monkeypatch.setattr(core, "mul", mul)
        try:
            return rule(self, g)
        finally:
            monkeypatch.setattr(core, "mul", real_mul)

    x, t = leaves(prob(3, 4), prob(3, 4))
    assert mt.gradgradcheck(F.binary_cross_entropy, [x, t])
    monkeypatch.setattr(losses.BinaryCrossEntropyBackward, "create_graph",
                        constant_denominator)
    assert mt.gradcheck(F.binary_cross_entropy, [x, t])           # first order: unchanged
    assert not mt.gradgradcheck(F.binary_cross_entropy, [x, t], raise_exception=False)


# ---- the walk ------------------------------------------------------------------------------

def _top_level_calls(cases):
    """The functions of registry rows each case calls at its top level (not from inside
    another op), found with every op wrapped; a case whose fn is itself a row's function
    (a table holding `mt.exp`, taken before any wrapping) counts as calling it."""
    called, depth = set(), [0]

    def wrapper_for(label, fn):
        def wrapped(*args, **kwargs):
            if depth[0] == 0:
                called.add(id(fn))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapped

    patched = _intercept.patch_ops(wrapper_for)
    methods = []      # Tensor methods patch_ops leaves (the core's one-line lambdas)
    for row in mt.ops.registry():
        if row.method is not None and mt.Tensor.__dict__.get(row.name) is row.method:
            methods.append((row.name, C.replace_tensor_method(row.name,
                                                              wrapper_for(row.label, row.method))))
    try:
        for fn, make_inputs in cases:
            called.add(id(fn))
            fn(*make_inputs())
    finally:
        for name, original in reversed(methods):
            C.replace_tensor_method(name, original)
        _intercept.unpatch(patched)
    return called


def _all_cases():
    cases = [(fn, (lambda name=name: test_ops.as_tensors(test_ops.make_inputs(name), True)))
             for name, (fn, *_rest) in test_ops.OPS.items()]
    cases += list(test_higher_order.FUSED.values())
    cases += [(fn, (lambda make=make: leaves(*make()))) for fn, make in SECOND_ORDER.values()]
    return cases


def _rows_to_check():
    return [row for row in mt.ops.registry() if row.kind not in KIND_EXEMPT]


def test_every_differentiable_row_is_second_order_checked():
    called = _top_level_calls(_all_cases())
    missing = [row.label for row in _rows_to_check()
               if row.label not in EXEMPT and id(row.function) not in called
               and id(row.method) not in called]
    assert not missing, (f"registry rows in no second-order check (add a case to "
                         f"SECOND_ORDER, or an exemption with its reason): {missing}")


def test_the_exemptions_are_rows_and_are_needed():
    """An exemption names a registry row that is not checked anyway, and a row that
    gives a gradient is never exempt (its result must not require grad)."""
    labels = {row.label for row in mt.ops.registry()}
    assert not set(EXEMPT) - labels, f"exempt but not a registry row: {set(EXEMPT) - labels}"
    assert not set(EXEMPT) & set(SECOND_ORDER)
    x = mt.tensor(distinct(3, 4), requires_grad=True)
    for label, result in [("floor_divide", mt.floor_divide(x, 2.0)), ("unique", mt.unique(x)),
                          ("unique_consecutive", mt.unique_consecutive(x)),
                          ("argsort", mt.argsort(x)), ("isclose", mt.isclose(x, x))]:
        assert not result.requires_grad, f"{label} gives a gradient: check it, do not exempt it"


def test_the_walk_finds_a_row_with_no_check(monkeypatch):
    """The walk can fail: with binary cross-entropy's case removed, it names that row."""
    monkeypatch.delitem(SECOND_ORDER, "F.binary_cross_entropy")
    with pytest.raises(AssertionError, match="F.binary_cross_entropy"):
        test_every_differentiable_row_is_second_order_checked()
