"""Every op that takes a log-sum-exp, against torch at the extremes of its input.

A table of ops (softmax, log_softmax and softmin along either dim, cross_entropy with
and without label smoothing or an ignored row, mt.logsumexp, scaled_dot_product_attention)
crossed with a table of inputs (logits of +-1e9 and +-1e30, in float32 and float64,
rows holding -inf, rows of -inf, +inf and NaN entries, rows of finfo.min and
finfo.max; for attention: masks of finfo.min on one query row, all-masked rows as -inf
or as a bool mask, scores of 1e9): forward, backward with a random upstream gradient,
and second order (create_graph) where the op has one.

The class of bug: `m + log(sum(exp(x - m)))` rounds the log-sum away when m is large
(1e9 + log 5 == 1e9 in float32), so everything downstream of it (log_softmax, the
softmax that backward recomputes, the cross-entropy loss) is off by up to a whole
probability. The kernels keep the pair (m, s) instead (docs/FUSED_OPS.md).

Torch's fused CPU attention kernel has that rounding in its own backward (on a row
masked by finfo.min it recomputes P = 1 instead of 1/Tk): the oracle for attention is
torch's math backend, the mathematical answer.
"""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from conftest import kernel_builds_here  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _builds():
    """The kernel builds to run: the one loaded (the widest the CPU runs) first, then
    every other build this CPU runs (the same source, compiled up to three times)."""
    return [("loaded", F._kernels.fused, F._kernels.attention)] + [
        b for b in kernel_builds_here() if b[1] is not F._kernels.fused]


# dtype and kernel build: float32 with each build, float64 (libm's exp in both) once
VARIANTS = [pytest.param(np.float32, b, id=f"float32-{b[0]}") for b in _builds()] + [
    pytest.param(np.float64, _builds()[0], id="float64")]


@pytest.fixture
def use_build(monkeypatch):
    def use(build):
        monkeypatch.setattr(F._kernels, "fused", build[1])
        monkeypatch.setattr(F._kernels, "attention", build[2])
    return use


R, C = 4, 5


def _base():
    return np.random.default_rng(0).standard_normal((R, C))


# ---- the inputs: (R, C) logits, built in the dtype they are tested in ------------------

def _huge(scale):
    def make(dtype):
        x = _base()
        # a huge common offset plus spreads that survive rounding at that magnitude
        return (scale * (1 + np.finfo(dtype).eps * 4 * np.round(x))).astype(dtype)
    return make


def _with(*values):
    """Standard normal logits with some entries (row, cols) set to a value."""
    def make(dtype):
        x = _base().astype(dtype)
        for r, cols, v in values:
            x[r, cols] = v(dtype) if callable(v) else v
        return x
    return make


_FMIN = lambda dt: np.finfo(dt).min                      # noqa: E731
_FMAX = lambda dt: np.finfo(dt).max                      # noqa: E731

INPUTS = {
    "1e9": _huge(1e9),
    "-1e9": _huge(-1e9),
    "1e30": _huge(1e30),
    "-1e30": _huge(-1e30),
    "constant_1e9": lambda dt: np.full((R, C), 1e9, dt),
    "one_huge_in_row": _with((0, 1, 1e30), (2, 3, -1e30), (3, 0, 1e9)),
    "neg_inf_entries": _with((0, slice(0, 3), -np.inf), (2, 4, -np.inf)),
    "row_of_neg_inf": _with((1, slice(None), -np.inf)),
    "pos_inf_entry": _with((2, 1, np.inf)),
    "nan_entry": _with((3, 2, np.nan)),
    "row_of_finfo_min": _with((0, slice(None), _FMIN)),
    "row_of_finfo_max": _with((0, slice(None), _FMAX)),
}

TARGETS = np.array([0, 2, 4, 1])


# ---- the ops: (microtensor, torch, has a second order) ---------------------------------

def _ce(**kw):
    t_mt, t_torch = mt.tensor(TARGETS), torch.from_numpy(TARGETS)
    return (lambda x: F.cross_entropy(x, t_mt, reduction="none", **kw),
            lambda x: TF.cross_entropy(x, t_torch, reduction="none", **kw))


OPS = {
    "softmax": (lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1)),
    "softmax_dim0": (lambda x: F.softmax(x, 0), lambda x: TF.softmax(x, 0)),
    "log_softmax": (lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1)),
    "log_softmax_dim0": (lambda x: F.log_softmax(x, 0), lambda x: TF.log_softmax(x, 0)),
    "softmin": (lambda x: F.softmin(x, -1), lambda x: TF.softmin(x, -1)),
    "tensor_softmax": (lambda x: x.softmax(-1), lambda x: x.softmax(-1)),
    "cross_entropy": _ce(),
    "cross_entropy_smoothing": _ce(label_smoothing=0.1),
    "cross_entropy_ignore": (
        lambda x: F.cross_entropy(x, mt.tensor(np.array([0, -100, 4, 1])), reduction="none"),
        lambda x: TF.cross_entropy(x, torch.tensor([0, -100, 4, 1]), reduction="none")),
    "cross_entropy_mean_smoothing": (
        lambda x: F.cross_entropy(x, mt.tensor(TARGETS), label_smoothing=0.3),
        lambda x: TF.cross_entropy(x, torch.from_numpy(TARGETS), label_smoothing=0.3)),
    "logsumexp": (lambda x: mt.logsumexp(x, -1), lambda x: _torch_logsumexp(x, -1)),
    "logsumexp_dim0": (lambda x: mt.logsumexp(x, 0), lambda x: _torch_logsumexp(x, 0)),
    # values only: torch's backward is g * exp(x - y) with y rounded as one number (off
    # by 1e-7 relative at 1e9 in float64, NaN at -inf entries); the derivatives of
    # logcumsumexp are checked against central differences below
    "logcumsumexp": (lambda x: mt.logcumsumexp(x, -1), lambda x: torch.logcumsumexp(x, -1),
                     "values"),
    "logcumsumexp_dim0": (lambda x: mt.logcumsumexp(x, 0), lambda x: torch.logcumsumexp(x, 0),
                          "values"),
}


def _torch_logsumexp(x, dim):
    """torch.logsumexp's value; where the max is finite, derivatives from the same shift
    by the (constant) max.
    NOTE: torch's own backward is g * exp(x - lse) with lse rounded as one number: at a
    row of 1e9 in float32 (or of finfo.max) that is exp(0) = 1 per maximum, not the
    softmax (each of five equal maxima gets g, not g / 5). The mathematical derivative is
    the softmax, which this composite has, to any order. Rows whose max is not finite
    (all -inf, or a +inf) keep torch's logsumexp throughout."""
    m = x.detach().amax(dim, keepdim=True)
    finite = torch.isfinite(m)
    zero = torch.zeros_like(x)
    xf, xn = torch.where(finite, x, zero), torch.where(finite, zero, x)   # each safe
    mf = torch.where(finite, m, torch.zeros_like(m))
    composite = ((xf - mf).exp().sum(dim, keepdim=True).log() + mf).squeeze(dim)
    composite = composite + (torch.logsumexp(xf.detach(), dim) - composite).detach()
    return torch.where(finite.squeeze(dim), composite, torch.logsumexp(xn, dim))


DTYPES = [np.float32, np.float64]


def _tol(dtype):
    return dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)


def _close(ours, theirs, dtype, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    # NaN where torch has NaN, inf where torch has inf (same sign), close elsewhere
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs), err_msg=f"{what}: NaN pattern")
    np.testing.assert_allclose(ours, theirs, equal_nan=True, err_msg=what, **_tol(dtype))


def _three_orders(mt_fn, torch_fn, arrays, dtype, second_order=True):
    """Value, gradient (random upstream) and the gradient of <gradient, w> for each
    float array, by microtensor and by torch; compared order by order."""
    rng = np.random.default_rng(1)
    xs = [mt.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, t_out = mt_fn(*xs), torch_fn(*ts)
    _close(out.numpy(), t_out.detach().numpy(), dtype, "forward")
    up = rng.standard_normal(t_out.shape).astype(dtype)
    t_grads = torch.autograd.grad(t_out, ts, torch.from_numpy(up), create_graph=second_order)
    # first order twice: by the backward kernels, then by the create_graph rules
    for graphed in ([False, True] if second_order else [False]):
        grads = mt.autograd.grad(out, xs, mt.tensor(up), create_graph=graphed,
                                 retain_graph=True)
        for i, (g, tg) in enumerate(zip(grads, t_grads)):
            _close(g.numpy(), tg.detach().numpy(), dtype,
                   f"backward{' (create_graph)' if graphed else ''}, input {i}")
    if not second_order:
        return
    ws = [rng.standard_normal(a.shape).astype(dtype) for a in arrays]
    dot = sum((g * mt.tensor(w)).sum() for g, w in zip(grads, ws))
    t_dot = sum((g * torch.from_numpy(w)).sum() for g, w in zip(t_grads, ws))
    second = mt.autograd.grad(dot, xs, allow_unused=True)
    t_second = torch.autograd.grad(t_dot, ts, allow_unused=True)
    for i, (h, th) in enumerate(zip(second, t_second)):
        h = np.zeros_like(arrays[i]) if h is None else h.numpy()
        th = np.zeros_like(arrays[i]) if th is None else th.numpy()
        _close(h, th, dtype, f"second order, input {i}")


@pytest.mark.parametrize("dtype, build", VARIANTS)
@pytest.mark.parametrize("case", INPUTS)
@pytest.mark.parametrize("op", OPS)
def test_log_sum_exp_ops_at_extremes_as_torch(op, case, dtype, build, use_build):
    use_build(build)
    mt_fn, torch_fn, *only = OPS[op]
    x = INPUTS[case](dtype)
    assert x.dtype == dtype
    if only == ["values"]:
        _close(mt_fn(mt.tensor(x)).numpy(), torch_fn(torch.tensor(x)).numpy(), dtype, "forward")
        return
    _three_orders(mt_fn, torch_fn, [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_the_issue_cases(dtype):
    """The cases as reported: values a reader can check by hand (log 5 = 1.609)."""
    x = mt.full((1, 5), 1e9, dtype=mt.float32 if dtype == np.float32 else mt.float64,
                requires_grad=True)
    np.testing.assert_allclose(F.log_softmax(x, -1).numpy(), np.full((1, 5), -np.log(5)), rtol=1e-6)
    F.cross_entropy(x, mt.tensor(np.array([0]))).backward()
    np.testing.assert_allclose(x.grad.numpy(), [[-0.8, 0.2, 0.2, 0.2, 0.2]], rtol=1e-6)
    big = mt.tensor(np.full((1, 5), 1e30, dtype))
    loss = F.cross_entropy(big, mt.tensor(np.array([0])), label_smoothing=0.1)
    np.testing.assert_allclose(loss.item(), np.log(5), rtol=1e-6)


# ---- attention -------------------------------------------------------------------------

B, H, T, D = 2, 2, 5, 4


def _qkv(dtype, scale=1.0):
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((B, H, T, D)) * scale).astype(dtype) for _ in range(3)]


def _row_mask(value, row=1):
    def make(dtype):
        m = np.zeros((T, T), dtype)
        m[row, :] = value(dtype) if callable(value) else value
        return m
    return make


def _bool_mask(dtype):
    m = np.tril(np.ones((T, T), dtype=bool))
    m[2, :] = False                                       # one row attends to nothing
    return m


def _partial(dtype):
    m = np.zeros((T, T), dtype)
    m[:, 3:] = np.finfo(dtype).min                        # the last keys masked for all
    m[0, :3] = -np.inf
    return m


ATTENTION = {
    # name: (mask maker or None, q/k scale, is_causal)
    "finfo_min_row": (_row_mask(_FMIN), 1.0, False),
    "finfo_min_keys": (_partial, 1.0, False),
    "all_masked_row_neg_inf": (_row_mask(-np.inf), 1.0, False),
    "all_masked_row_bool": (_bool_mask, 1.0, False),
    "mask_offset_1e9": (_row_mask(1e9, row=3), 1.0, False),
    "mask_offset_1e30": (lambda dt: np.full((T, T), 1e30, dt), 1.0, False),
    "scores_1e9": (None, 2e4, False),
    "scores_1e9_causal": (None, 2e4, True),
    "causal": (None, 1.0, True),
}


def _attention_fns(mask, is_causal):
    def ours(q, k, v):
        m = None if mask is None else mt.tensor(mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal)

    def theirs(q, k, v):
        m = None if mask is None else torch.from_numpy(mask)
        with sdpa_kernel(SDPBackend.MATH):
            return TF.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal)
    return ours, theirs


@pytest.mark.parametrize("dtype, build", VARIANTS)
@pytest.mark.parametrize("case", ATTENTION)
def test_attention_at_extremes_as_torch(case, dtype, build, use_build):
    use_build(build)
    make_mask, scale, is_causal = ATTENTION[case]
    mask = None if make_mask is None else make_mask(dtype)
    q, k, v = _qkv(dtype)
    q, k = (q * scale).astype(dtype), (k * scale).astype(dtype)
    ours, theirs = _attention_fns(mask, is_causal)
    _three_orders(ours, theirs, [q, k, v], dtype)


@pytest.mark.parametrize("dtype, build", VARIANTS)
def test_attention_mask_gradient_at_finfo_min(dtype, build, use_build):
    use_build(build)
    """A learned float mask (it takes a gradient: dS) on a row masked by finfo.min."""
    q, k, v = _qkv(dtype)
    mask = _row_mask(_FMIN)(dtype)
    ours = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731

    def theirs(q, k, v, m):
        with sdpa_kernel(SDPBackend.MATH):
            return TF.scaled_dot_product_attention(q, k, v, attn_mask=m)
    _three_orders(ours, theirs, [q, k, v, mask], dtype, second_order=False)


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_logcumsumexp_derivatives_by_central_differences(scale):
    """logcumsumexp's first and second derivatives at values spread over +-3 and over
    +-900 (where one shift by the global max loses the early terms), float64."""
    x = mt.tensor(np.random.default_rng(2).standard_normal((3, 6)) * scale, requires_grad=True)
    assert mt.gradcheck(lambda t: mt.logcumsumexp(t, 1), (x,))
    assert mt.gradgradcheck(lambda t: mt.logcumsumexp(t, 1), (x,))
