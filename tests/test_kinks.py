"""Every op with a kink, at the kink: its gradient there against torch's convention.

A piecewise op has a gradient rule with a boundary (`x >= lo` or `x > lo`, `a > b` or
`a >= b` or half to each at a tie), and a slip at the boundary changes nothing anywhere
else: clamp's gradient at exactly min and max, relu's at 0, maximum's at a tie. So each
op below runs at inputs that sit exactly on its kinks (and beside them), with a random
upstream gradient, and its gradient must equal torch's, NaN and inf included.

The list is derived from the op registry and nn.functional: every registered op (and
every function of F) is either in the KINKS table or named in SMOOTH (no kink or
boundary in the gradient rule) or NO_GRADIENT; an op added later without a place here
fails test_every_op_is_classified.
"""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("one_thread")

# values on the kinks of most ops (0, the clamp bounds -1 and 1, integers for rounding,
# ties for max/min), with neighbours on both sides
X = np.array([-2.0, -1.0, -0.5, 0.0, -0.0, 0.5, 1.0, 1.0, 2.0, 3.0, -3.0, 6.0, 0.0])
TIES = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 0.0, 5.0]])
A = np.array([1.0, 2.0, -1.0, 0.0, 3.0, 0.0])
B = np.array([1.0, 1.0, -1.0, 0.0, 4.0, -0.0])            # ties with A at 0, 2, 3, 5


def _pair(mt_op, torch_op):
    return (lambda a, b: mt_op(a, b), lambda a, b: torch_op(a, b), [A, B])


def _one(mt_op, torch_op, x=X):
    return (mt_op, torch_op, [x])


KINKS = {
    # pointwise, kink at 0 or at the bounds
    "abs": _one(mt.abs, torch.abs),
    "relu": _one(mt.relu, torch.relu),
    "clamp": _one(lambda x: mt.clamp(x, -1.0, 1.0), lambda x: torch.clamp(x, -1.0, 1.0)),
    "clamp_only_min": _one(lambda x: mt.clamp(x, min=0.0), lambda x: torch.clamp(x, min=0.0)),
    "clamp_only_max": _one(lambda x: mt.clamp(x, max=0.5), lambda x: torch.clamp(x, max=0.5)),
    "clamp_min": _one(lambda x: mt.clamp_min(x, 1.0), lambda x: torch.clamp_min(x, 1.0)),
    "clamp_max": _one(lambda x: mt.clamp_max(x, -1.0), lambda x: torch.clamp_max(x, -1.0)),
    "clip": _one(lambda x: mt.clip(x, -1.0, 1.0), lambda x: torch.clip(x, -1.0, 1.0)),
    "clamp_tensor_bounds": (lambda x, lo, hi: mt.clamp(x, lo, hi),
                            lambda x, lo, hi: torch.clamp(x, lo, hi),
                            [X, np.full_like(X, -1.0), np.full_like(X, 1.0)]),
    "sign": _one(mt.sign, torch.sign),
    "sgn": _one(mt.sgn, torch.sgn),
    "round": _one(mt.round, torch.round),
    "floor": _one(mt.floor, torch.floor),
    "ceil": _one(mt.ceil, torch.ceil),
    "trunc": _one(mt.trunc, torch.trunc),
    "fix": _one(mt.fix, torch.fix),
    "frac": _one(mt.frac, torch.frac),
    "fmod": _one(lambda x: mt.fmod(x, 2.0), lambda x: torch.fmod(x, 2.0)),
    "remainder": _one(lambda x: mt.remainder(x, 2.0), lambda x: torch.remainder(x, 2.0)),
    "where": _one(lambda x: mt.where(x > 0, x, x * 2.0), lambda x: torch.where(x > 0, x, x * 2.0)),
    "masked_fill": _one(lambda x: mt.masked_fill(x, x >= 1, 0.0),
                        lambda x: torch.masked_fill(x, x >= 1, 0.0)),
    "sqrt_at_0": _one(mt.sqrt, torch.sqrt, np.array([0.0, 1.0, 4.0])),
    "rsqrt_at_0": _one(mt.rsqrt, torch.rsqrt, np.array([0.0, 1.0, 4.0])),
    "pow_half_at_0": _one(lambda x: mt.pow(x, 0.5), lambda x: torch.pow(x, 0.5),
                          np.array([0.0, 1.0, 4.0])),
    "pow_2_at_0": _one(lambda x: mt.pow(x, 2.0), lambda x: torch.pow(x, 2.0)),
    "pow_0": _one(lambda x: mt.pow(x, 0.0), lambda x: torch.pow(x, 0.0)),
    "pow_base_0": _pair(mt.pow, torch.pow),
    "float_power": _one(lambda x: mt.float_power(x, 2.0), lambda x: torch.float_power(x, 2.0)),
    # (at x = o = 0 torch's d/do is 0 / 0 = NaN, microtensor's 0: not compared)
    "xlogy_at_0": (mt.xlogy, torch.xlogy, [np.array([0.0, 0.0, 1.0, 2.0, 0.0]),
                                          np.array([-1.0, 2.0, 1.0, 3.0, 0.5])]),
    "logit_at_0_1": _one(mt.logit, torch.logit, np.array([0.0, 0.25, 0.5, 1.0])),
    "prod_zeros": _one(lambda x: mt.prod(x, -1), lambda x: torch.prod(x, -1),
                       np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 3.0], [1.0, 2.0, 3.0]])),
    "cumprod_zeros": _one(lambda x: mt.cumprod(x, -1), lambda x: torch.cumprod(x, -1),
                          np.array([[0.0, 2.0, 3.0], [2.0, 0.0, 0.0], [1.0, 2.0, 3.0]])),
    "norm_at_0": _one(lambda x: mt.norm(x), lambda x: torch.norm(x), np.zeros(4)),
    "dist_at_0": (lambda a, b: mt.dist(a, b), lambda a, b: torch.dist(a, b), [A, A.copy()]),
    "std_constant": _one(lambda x: mt.std(x, -1), lambda x: torch.std(x, -1), TIES),
    # two operands that tie
    "maximum": _pair(mt.maximum, torch.maximum),
    "minimum": _pair(mt.minimum, torch.minimum),
    "fmax": _pair(mt.fmax, torch.fmax),
    "fmin": _pair(mt.fmin, torch.fmin),
    # reductions over ties
    "max_all": _one(lambda x: mt.max(x), lambda x: torch.max(x), TIES),
    "min_all": _one(lambda x: mt.min(x), lambda x: torch.min(x), TIES),
    "max_dim": _one(lambda x: mt.max(x, 1)[0], lambda x: torch.max(x, 1)[0], TIES),
    "min_dim": _one(lambda x: mt.min(x, 1)[0], lambda x: torch.min(x, 1)[0], TIES),
    "amax": _one(lambda x: mt.amax(x, 1), lambda x: torch.amax(x, 1), TIES),
    "amin": _one(lambda x: mt.amin(x, 1), lambda x: torch.amin(x, 1), TIES),
    "amax_all": _one(lambda x: mt.amax(x, (0, 1)), lambda x: torch.amax(x, (0, 1)), TIES),
    "median_all": _one(lambda x: mt.median(x), lambda x: torch.median(x), TIES),
    "msort": _one(mt.msort, torch.msort, TIES),            # no ties down the columns
    "cummax": _one(lambda x: mt.cummax(x, 1)[0], lambda x: torch.cummax(x, 1)[0], TIES),
    "cummin": _one(lambda x: mt.cummin(x, 1)[0], lambda x: torch.cummin(x, 1)[0], TIES),
    # nn.functional
    "F.relu": _one(F.relu, TF.relu),
    "F.hardtanh": _one(F.hardtanh, TF.hardtanh),
    "F.hardtanh_bounds": _one(lambda x: F.hardtanh(x, -0.5, 2.0),
                              lambda x: TF.hardtanh(x, -0.5, 2.0)),
    "F.relu6": _one(F.relu6, TF.relu6),
    "F.leaky_relu": _one(lambda x: F.leaky_relu(x, 0.1), lambda x: TF.leaky_relu(x, 0.1)),
    "F.elu": _one(F.elu, TF.elu),
    "F.celu": _one(lambda x: F.celu(x, 0.5), lambda x: TF.celu(x, 0.5)),
    "F.selu": _one(F.selu, TF.selu),
    "F.hardsigmoid": _one(F.hardsigmoid, TF.hardsigmoid),
    "F.hardswish": _one(F.hardswish, TF.hardswish),
    "F.softplus_threshold": _one(lambda x: F.softplus(x, 1.0, 2.0),
                                 lambda x: TF.softplus(x, 1.0, 2.0)),
    "F.l1_loss": (F.l1_loss, TF.l1_loss, [A, B]),
    "F.smooth_l1_loss": (lambda a, b: F.smooth_l1_loss(a, b, beta=1.0),
                         lambda a, b: TF.smooth_l1_loss(a, b, beta=1.0), [A, B]),
    "F.huber_loss": (lambda a, b: F.huber_loss(a, b, delta=1.0),
                     lambda a, b: TF.huber_loss(a, b, delta=1.0), [A, B]),
    "F.mse_loss_ties": (F.mse_loss, TF.mse_loss, [A, B]),
    "F.normalize_zero_row": _one(lambda x: F.normalize(x, dim=1), lambda x: TF.normalize(x, dim=1),
                                 np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]])),
    "F.pairwise_distance_equal": (F.pairwise_distance, TF.pairwise_distance,
                                  [A.reshape(2, 3), A.reshape(2, 3).copy()]),
    # (the target as a constant: torch's gradient for it ignores the forward's clamp of
    # the logs at -100 and is inf at 0 and 1; microtensor's follows the clamp)
    "F.binary_cross_entropy_at_0_1": _one(
        lambda x: F.binary_cross_entropy(x, mt.tensor(np.array([0.0, 1.0, 1.0, 0.0]))),
        lambda x: TF.binary_cross_entropy(x, torch.tensor([0.0, 1.0, 1.0, 0.0],
                                                          dtype=torch.float64)),
        np.array([0.0, 1.0, 0.5, 1.0])),
}

# registered ops without a kink or boundary in their gradient rule (smooth, or linear:
# views, shape and index ops, sums), and those that have no gradient at all
SMOOTH = set("""
    acos add addmm arccos arcsin arctan arctan2 asin asinh atan atan2 atanh baddbmm bmm
    broadcast_to cat chunk contiguous cos cosh cross cumsum diag diagonal div dot erf erfc
    erfinv exp exp2 expand expand_as expm1 flatten flip fliplr flipud gather getitem half
    index_add index_fill index_select inner kron lerp log log10 log1p log2 log_softmax
    logcumsumexp logsumexp masked_select matmul mean mm moveaxis movedim mul mv narrow
    nan_to_num neg new_tensor outer permute reciprocal repeat repeat_interleave reshape
    reshape_as roll rot90 scatter scatter_add select sigmoid sin sinh softmax split square
    squeeze stack sub sum swapaxes swapdims t take take_along_dim tan tanh tensor_split tile
    trace transpose tril triu type_as unbind unflatten unsqueeze var vdot view view_as ger
    atleast_1d atleast_2d broadcast_tensors column_stack hstack vstack meshgrid einsum
    tensordot var_mean
""".split()) | {
    "std_mean",     # std's kink (a constant input) is KINKS' std_constant
    "cdist",        # the norm's kink at 0 is KINKS' norm_at_0 and dist_at_0
}
NO_GRADIENT = set("""
    all allclose any argmax argmin argsort argwhere bernoulli bincount count_nonzero data_ptr
    stride
    eq equal floor_divide ge gt histc is_contiguous is_floating_point is_nonzero isclose
    isfinite isinf isnan isneginf isposinf le logical_and logical_not logical_or
    logical_xor lt ne new_empty new_full new_ones new_zeros nonzero share_memory_ unique
    unique_consecutive as_tensor empty_like eye logspace rand_like randint_like randn_like
    normal poisson tril_indices triu_indices broadcast_shapes
""".split())
# the registry name each KINKS row tests (rows named otherwise: the op before the "_")
COVERS = {"clamp_only_min": "clamp", "clamp_only_max": "clamp", "clamp_tensor_bounds": "clamp",
          "sqrt_at_0": "sqrt", "rsqrt_at_0": "rsqrt", "pow_half_at_0": "pow", "pow_2_at_0": "pow",
          "pow_0": "pow", "pow_base_0": "pow", "xlogy_at_0": "xlogy", "logit_at_0_1": "logit",
          "prod_zeros": "prod", "cumprod_zeros": "cumprod", "norm_at_0": "norm",
          "dist_at_0": "dist", "std_constant": "std", "max_all": "max", "min_all": "min",
          "amax_all": "amax", "median_all": "median",
          "max_dim": "max", "min_dim": "min"}
F_SMOOTH = set("""
    batch_norm binary_cross_entropy_with_logits cosine_similarity cross_entropy dropout
    embedding gelu glu gumbel_softmax kl_div layer_norm linear log_softmax logsigmoid mish
    nll_loss one_hot pad rms_norm rotary_embedding scaled_dot_product_attention sigmoid
    silu softmax softmin softsign tanh tanhshrink
""".split())
F_HELPERS = {"attach", "declare_saved", "needs_graph", "wrap"}


def test_every_op_is_classified():
    """Each registered op (in-place forms follow their op) and each function of F is in
    the KINKS table, or named smooth, or without gradient: a new op must take a side."""
    covered = {COVERS.get(k, k) for k in list(KINKS) + list(PICKS) if not k.startswith("F.")}
    registry = {row.name for row in mt.core._core.registered_ops() if not row.scope}   # F's: below
    out_of_place = {n for n in registry if not (n.endswith("_") and n[:-1] in registry)}
    unclassified = out_of_place - covered - SMOOTH - NO_GRADIENT - {
        n for n in out_of_place if n.endswith("_")}           # random_, apply_, exponential_ ...
    assert not unclassified, f"ops not in KINKS, SMOOTH or NO_GRADIENT: {sorted(unclassified)}"
    f_covered = {k[2:].split("_at_")[0] for k in KINKS if k.startswith("F.")}
    f_names = {n for n in dir(F) if not n.startswith("_") and callable(getattr(F, n))
               and not isinstance(getattr(F, n), type)}
    f_unclassified = {n for n in f_names - F_SMOOTH - F_HELPERS
                      if not any(c == n or c.startswith(n + "_") for c in f_covered)}
    assert not f_unclassified, f"F functions not classified: {sorted(f_unclassified)}"


@pytest.mark.parametrize("op", KINKS)
def test_gradient_at_the_kink_as_torch(op):
    mt_fn, torch_fn, arrays = KINKS[op]
    xs = [mt.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, t_out = mt_fn(*xs), torch_fn(*ts)
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), rtol=1e-12, atol=1e-15,
                               err_msg=f"{op}: forward")
    up = np.random.default_rng(5).uniform(0.5, 1.5, t_out.shape)   # no accidental zeros
    out.backward(mt.tensor(up))
    t_out.backward(torch.from_numpy(up))
    for i, (x, t) in enumerate(zip(xs, ts)):
        ours = np.zeros_like(arrays[i]) if x.grad is None else x.grad.numpy()
        theirs = np.zeros_like(arrays[i]) if t.grad is None or t.grad._is_zerotensor() \
            else t.grad.numpy()
        # (rtol: torch's hardsigmoid multiplies by a float32 1/6 in double too)
        np.testing.assert_allclose(ours, theirs, rtol=1e-7, atol=1e-15,
                                   err_msg=f"{op}: gradient of input {i} at {arrays[i]}")


# ---- ops that pick elements by index: at ties the gradient goes where the index says ---
# (which of equal elements torch's kthvalue / topk / sort returns is its kernel's detail;
# the rule is that the gradient lands on the returned index, and the values are torch's)
PICKS = {
    "kthvalue": (lambda x: mt.kthvalue(x, 2, 1), lambda x: torch.kthvalue(x, 2, 1)),
    "median_dim": (lambda x: mt.median(x, 1), lambda x: torch.median(x, 1)),
    "max_dim": (lambda x: mt.max(x, 1), lambda x: torch.max(x, 1)),
    "min_dim": (lambda x: mt.min(x, 1), lambda x: torch.min(x, 1)),
    "topk": (lambda x: mt.topk(x, 2, 1), lambda x: torch.topk(x, 2, 1)),
    "sort": (lambda x: mt.sort(x, 1), lambda x: torch.sort(x, 1)),
    "cummax": (lambda x: mt.cummax(x, 1), lambda x: torch.cummax(x, 1)),
    "cummin": (lambda x: mt.cummin(x, 1), lambda x: torch.cummin(x, 1)),
}


@pytest.mark.parametrize("op", PICKS)
def test_picking_ops_send_the_gradient_to_the_returned_index(op):
    ours, theirs = PICKS[op]
    x = mt.tensor(TIES, requires_grad=True)
    values, indices = ours(x)
    t_values, _ = theirs(torch.tensor(TIES))
    np.testing.assert_array_equal(values.numpy(), t_values.numpy())
    up = np.random.default_rng(5).uniform(0.5, 1.5, values.shape)
    values.backward(mt.tensor(up))
    idx = indices.numpy().reshape(values.shape)
    expected = np.zeros_like(TIES)
    np.add.at(expected, (np.arange(TIES.shape[0])[:, None].repeat(idx.shape[1], 1)
                         if idx.ndim == 2 else np.arange(TIES.shape[0]), idx), up)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-15)
