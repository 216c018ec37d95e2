"""mt.nn.functional: every op against a plain numpy reference, float64 gradchecks with a
random upstream gradient, float32 against float64, bad inputs, and torch where installed.

The numpy references below are the readable definitions of each fused kernel; the
kernels (microtensor/_fused*.pyx) must agree with them on odd shapes and on
non-contiguous inputs too.
"""
import math

import numpy as np
import pytest
from scipy.special import erf

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _fused_attention


RNG = np.random.default_rng(1234)


def randn(*shape, dtype=np.float64, requires_grad=True):
    return mt.tensor(RNG.standard_normal(shape).astype(dtype), requires_grad=requires_grad)


# ---- numpy references ---------------------------------------------------------------

def ref_linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def ref_gelu(x):
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def ref_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def ref_silu(x):
    return x / (1 + np.exp(-x))


def ref_layer_norm(x, k, w=None, b=None, eps=1e-5):
    axes = tuple(range(x.ndim - k, x.ndim))
    mu = x.mean(axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def ref_rms_norm(x, k, w=None, eps=None):
    eps = np.finfo(x.dtype).eps if eps is None else eps
    axes = tuple(range(x.ndim - k, x.ndim))
    y = x / np.sqrt((x * x).mean(axes, keepdims=True) + eps)
    return y if w is None else y * w


def ref_cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """logits (N, C), target (N,)"""
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    keep = target != ignore_index
    nll = -logp[np.arange(len(target)), np.where(keep, target, 0)]
    loss = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    loss = np.where(keep, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum()


def ref_embedding_backward(ids, grad, V):
    dw = np.zeros((V, grad.shape[-1]))
    for i, row in enumerate(ids.reshape(-1)):
        dw[row] += grad.reshape(-1, grad.shape[-1])[i]
    return dw


def ref_attention(q, k, v, mask=None, is_causal=False, scale=None, keep=None):
    """The plain implementation: scores, mask, softmax, (dropout,) @ v."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = q @ np.swapaxes(k, -1, -2) * scale
    if is_causal:
        S = np.where(np.tril(np.ones((Tq, Tk), bool)), S, -np.inf)
    if mask is not None:
        S = np.where(mask, S, -np.inf) if mask.dtype == bool else S + mask
    m = S.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    P = np.exp(S - m)
    P = P / np.maximum(P.sum(-1, keepdims=True), 1e-300)
    if keep is not None:
        P = P * keep
    return P @ v


# ---- forward against the references (float64) -----------------------------------------

def test_linear_forward_and_noncontiguous():
    x = randn(3, 4, 5)
    w = randn(6, 5)
    b = randn(6)
    np.testing.assert_allclose(F.linear(x, w, b).numpy(), ref_linear(x.numpy(), w.numpy(), b.numpy()), rtol=1e-12)
    np.testing.assert_allclose(F.linear(x, w).numpy(), ref_linear(x.numpy(), w.numpy()), rtol=1e-12)
    xt = randn(5, 4).transpose(0, 1)                    # non-contiguous input
    wt = randn(5, 6).T                                  # non-contiguous weight
    np.testing.assert_allclose(F.linear(xt, wt, b).numpy(), ref_linear(xt.numpy(), wt.numpy(), b.numpy()), rtol=1e-12)
    x1 = randn(5)                                       # 1-D input
    assert F.linear(x1, w, b).shape == (6,)
    np.testing.assert_allclose(F.linear(x1, w, b).numpy(), ref_linear(x1.numpy(), w.numpy(), b.numpy()), rtol=1e-12)


@pytest.mark.parametrize("fn, ref", [
    (F.gelu, ref_gelu),
    (lambda x: F.gelu(x, approximate="tanh"), ref_gelu_tanh),
    (F.silu, ref_silu),
    (F.relu, lambda x: np.maximum(x, 0)),
    (F.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    (F.tanh, np.tanh),
], ids=["gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh"])
def test_activation_forward(fn, ref):
    x = randn(7, 9)
    np.testing.assert_allclose(fn(x).numpy(), ref(x.numpy()), rtol=1e-12, atol=1e-14)
    xs = x[:, ::2]                                     # strided view
    np.testing.assert_allclose(fn(xs).numpy(), ref(xs.numpy()), rtol=1e-12, atol=1e-14)
    big = mt.tensor(np.array([-800.0, -30.0, 0.0, 30.0, 800.0]))
    assert np.isfinite(fn(big).numpy()).all()


def test_softmax_log_softmax():
    x = randn(4, 6)
    e = np.exp(x.numpy() - x.numpy().max(0))
    np.testing.assert_allclose(F.softmax(x, dim=0).numpy(), e / e.sum(0), rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(x, dim=0).numpy(), np.log(e / e.sum(0)), rtol=1e-12)
    big = mt.tensor(np.array([[1e4, 0.0, -1e4, -np.inf]], np.float32))   # stable, -inf gives 0
    np.testing.assert_allclose(F.softmax(big, -1).numpy(), [[1, 0, 0, 0]], atol=1e-7)
    np.testing.assert_allclose(F.log_softmax(big, -1).numpy()[0, :3], [0, -1e4, -2e4], rtol=1e-6)
    with pytest.raises(IndexError, match="Dimension out of range"):
        F.softmax(x, dim=2)


@pytest.mark.parametrize("shape, k, affine", [
    ((4, 7), 1, True), ((2, 3, 5), 2, True), ((1, 1), 1, False), ((3, 33), 1, True),
])
def test_layer_norm_forward(shape, k, affine):
    x = randn(*shape)
    ns = shape[-k:]
    w = randn(*ns) if affine else None
    b = randn(*ns) if affine else None
    got = F.layer_norm(x, ns, w, b)
    want = ref_layer_norm(x.numpy(), k, None if w is None else w.numpy(), None if b is None else b.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_norms_on_noncontiguous_input():
    x = randn(6, 4).T                                   # (4, 6), transposed view
    w = randn(6)
    np.testing.assert_allclose(F.layer_norm(x, 6, w).numpy(), ref_layer_norm(x.numpy(), 1, w.numpy()), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(F.rms_norm(x, [6], w).numpy(), ref_rms_norm(x.numpy(), 1, w.numpy()), rtol=1e-10, atol=1e-12)


def test_rms_norm_forward_default_eps():
    x = mt.tensor(np.zeros((2, 3)) + 1e-9)
    # eps=None means the dtype's machine epsilon, for float32 as for float64
    np.testing.assert_allclose(F.rms_norm(x, 3).numpy(), ref_rms_norm(x.numpy(), 1), rtol=1e-12)
    x32 = x.float()
    np.testing.assert_allclose(F.rms_norm(x32, 3).numpy(), ref_rms_norm(x32.numpy(), 1), rtol=1e-5)
    x = randn(3, 2, 4)
    np.testing.assert_allclose(F.rms_norm(x, (2, 4), eps=1e-3).numpy(), ref_rms_norm(x.numpy(), 2, eps=1e-3), rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_forward(reduction):
    x = randn(9, 5)
    t = RNG.integers(0, 5, 9)
    t[[1, 4]] = -100
    got = F.cross_entropy(x, mt.tensor(t), reduction=reduction)
    np.testing.assert_allclose(got.numpy(), ref_cross_entropy(x.numpy(), t, reduction=reduction), rtol=1e-12)
    t2 = t.copy()
    t2[t2 == -100] = 3
    got = F.cross_entropy(x, mt.tensor(t2), ignore_index=3, reduction=reduction)
    np.testing.assert_allclose(got.numpy(), ref_cross_entropy(x.numpy(), t2, ignore_index=3, reduction=reduction), rtol=1e-12)


def test_cross_entropy_is_stable_for_large_logits():
    x = np.array([[1e4, 0.0, -1e4], [-5e3, 5e3, 5e3]])
    t = np.array([0, 2])
    for dt in (np.float32, np.float64):
        got = F.cross_entropy(mt.tensor(x.astype(dt)), mt.tensor(t), reduction="none").numpy()
        np.testing.assert_allclose(got, [0.0, math.log(2)], atol=1e-6)


def test_cross_entropy_layouts():
    # (B, T, C) with (B, T): class dim last, the same as flattening
    x = randn(2, 3, 4)
    t = RNG.integers(0, 4, (2, 3))
    flat = ref_cross_entropy(x.numpy().reshape(-1, 4), t.reshape(-1), reduction="none")
    np.testing.assert_allclose(F.cross_entropy(x, mt.tensor(t), reduction="none").numpy(), flat.reshape(2, 3), rtol=1e-12)
    # torch's (N, C, d) with (N, d): class dim second
    x = randn(2, 5, 3)
    t = RNG.integers(0, 5, (2, 3))
    want = ref_cross_entropy(np.moveaxis(x.numpy(), 1, -1).reshape(-1, 5), t.reshape(-1))
    np.testing.assert_allclose(F.cross_entropy(x, mt.tensor(t)).numpy(), want, rtol=1e-12)
    # (C,) with a 0-d target
    x = randn(4)
    np.testing.assert_allclose(F.cross_entropy(x, mt.tensor(2)).numpy(), ref_cross_entropy(x.numpy()[None], np.array([2])), rtol=1e-12)


def test_cross_entropy_vocab_of_one_and_all_ignored():
    x = randn(3, 1)
    loss = F.cross_entropy(x, mt.tensor([0, 0, 0]))
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 0.0, atol=1e-12)
    x = randn(2, 3)
    loss = F.cross_entropy(x, mt.tensor([-100, -100]))
    assert math.isnan(loss.item())                        # 0/0, as torch
    loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)
    assert F.cross_entropy(x, mt.tensor([-100, -100]), reduction="sum").item() == 0.0


def test_cross_entropy_label_smoothing():
    x = randn(6, 4)
    t = RNG.integers(0, 4, 6)
    got = F.cross_entropy(x, mt.tensor(t), label_smoothing=0.2)
    np.testing.assert_allclose(got.numpy(), ref_cross_entropy(x.numpy(), t, label_smoothing=0.2), rtol=1e-12)
    assert mt.gradcheck(lambda a: F.cross_entropy(a, mt.tensor(t), label_smoothing=0.2), (x,))


def test_mse_loss_forward():
    a, b = randn(3, 4), randn(3, 4)
    d = a.numpy() - b.numpy()
    np.testing.assert_allclose(F.mse_loss(a, b).numpy(), (d * d).mean(), rtol=1e-12)
    np.testing.assert_allclose(F.mse_loss(a, b, reduction="sum").numpy(), (d * d).sum(), rtol=1e-12)
    np.testing.assert_allclose(F.mse_loss(a, b, reduction="none").numpy(), d * d, rtol=1e-12)


def test_embedding_forward_and_repeated_indices():
    w = randn(10, 4)
    idx = np.array([[1, 2, 2], [9, 1, 2]])
    y = F.embedding(mt.tensor(idx), w)
    np.testing.assert_array_equal(y.numpy(), w.numpy()[idx])
    g = RNG.standard_normal((2, 3, 4))
    y.backward(mt.tensor(g))
    np.testing.assert_allclose(w.grad.numpy(), ref_embedding_backward(idx, g, 10), rtol=1e-12)
    # many repeats of one id, with enough rows and columns to use several threads
    w = randn(3, 64)
    idx = np.zeros(4096, dtype=np.int64)
    idx[::3] = 2
    g = RNG.standard_normal((4096, 64))
    F.embedding(mt.tensor(idx), w).backward(mt.tensor(g))
    np.testing.assert_allclose(w.grad.numpy(), ref_embedding_backward(idx, g, 3), rtol=1e-10)


def test_embedding_padding_idx_gets_no_gradient():
    w = randn(5, 3)
    F.embedding(mt.tensor([0, 1, 1, 4]), w, padding_idx=1).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy()[1], 0.0)
    np.testing.assert_array_equal(w.grad.numpy()[0], 1.0)


# ---- attention ------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (q shape, k/v T, kwargs maker)
    "plain": ((2, 3, 5, 4), 5, lambda B, Tq, Tk: {}),
    "causal": ((2, 2, 37, 4), 37, lambda B, Tq, Tk: {"is_causal": True}),   # 37: not a block multiple
    "causal_cross_short_q": ((1, 2, 3, 4), 7, lambda B, Tq, Tk: {"is_causal": True}),
    "causal_cross_long_q": ((1, 2, 7, 4), 3, lambda B, Tq, Tk: {"is_causal": True}),
    "bool_mask": ((2, 2, 5, 3), 6, lambda B, Tq, Tk: {"attn_mask": RNG.random((Tq, Tk)) > 0.3}),
    "padding_mask": ((2, 2, 4, 3), 6, lambda B, Tq, Tk: {"attn_mask": RNG.random((B, 1, 1, Tk)) > 0.2}),
    "additive_mask": ((2, 2, 5, 3), 5, lambda B, Tq, Tk: {"attn_mask": RNG.standard_normal((2, 1, Tq, Tk))}),
    "scale": ((1, 1, 4, 3), 4, lambda B, Tq, Tk: {"scale": 0.3, "is_causal": True}),
    "T1": ((2, 1, 1, 4), 1, lambda B, Tq, Tk: {"is_causal": True}),
    "one_head_3d": ((3, 6, 5), 6, lambda B, Tq, Tk: {}),
    "two_d": ((6, 5), 4, lambda B, Tq, Tk: {}),
}


def _attention_inputs(name, dtype=np.float64):
    qshape, Tk, make = ATTENTION_CASES[name]
    Tq = qshape[-2]
    kshape = qshape[:-2] + (Tk, qshape[-1])
    vshape = qshape[:-2] + (Tk, qshape[-1] + 1)            # head dim of v may differ
    q, k, v = randn(*qshape, dtype=dtype), randn(*kshape, dtype=dtype), randn(*vshape, dtype=dtype)
    kwargs = make(qshape[0], Tq, Tk)
    if "attn_mask" in kwargs:
        m = kwargs["attn_mask"]
        kwargs["attn_mask"] = mt.tensor(m if m.dtype == bool else m.astype(dtype))
    return q, k, v, kwargs


def _ref_kwargs(kwargs):
    out = dict(kwargs)
    if "attn_mask" in out:
        out["mask"] = out.pop("attn_mask").numpy()
    return out


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_forward_matches_numpy(name):
    q, k, v, kwargs = _attention_inputs(name)
    got = F.scaled_dot_product_attention(q, k, v, **kwargs)
    want = ref_attention(q.numpy(), k.numpy(), v.numpy(), **_ref_kwargs(kwargs))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_gradcheck(name):
    q, k, v, kwargs = _attention_inputs(name)
    assert mt.gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs), (q, k, v))


def test_attention_noncontiguous_and_broadcast_inputs():
    # q, k, v as transposed views (the usual (B, T, nh, hs) -> (B, nh, T, hs))
    q, k, v = (randn(2, 7, 3, 4) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    got = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    want = ref_attention(qt.numpy(), kt.numpy(), vt.numpy(), is_causal=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10)
    # k, v shared over the batch: broadcast, and their gradients summed back
    q = randn(3, 2, 5, 4)
    k, v = randn(2, 5, 4), randn(2, 5, 4)
    np.testing.assert_allclose(F.scaled_dot_product_attention(q, k, v).numpy(),
                               ref_attention(q.numpy(), k.numpy(), v.numpy()), rtol=1e-10)
    assert mt.gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), (q, k, v))


def _heads_of_projection(qkv, B, T, C, nh):
    """The GPT's head split of a (B, T, 3C) projection: views, no copy."""
    q, k, v = qkv.split(C, dim=2)
    return [t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B, T, C, nh", [(2, 37, 12, 3), (3, 1, 8, 2), (1, 70, 16, 1)])
def test_attention_reads_the_heads_where_the_projection_wrote_them(B, T, C, nh, causal):
    # q, k, v as strided views of one (B, T, 3C) array (rows 3C apart, heads hs apart):
    # the kernels read them in place and must give what contiguous copies give, values
    # and gradients, and the output must lie as (B, T, nh, hs) (y.transpose(1, 2) is
    # contiguous, as torch's)
    qkv = randn(B, T, 3 * C)
    q, k, v = _heads_of_projection(qkv, B, T, C, nh)
    assert not q.is_contiguous()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert y.shape == (B, nh, T, C // nh)
    assert y.transpose(1, 2).is_contiguous()
    copies = [mt.tensor(np.ascontiguousarray(t.numpy()), requires_grad=True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*copies, is_causal=causal)
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(y.numpy(), ref_attention(q.numpy(), k.numpy(), v.numpy(),
                                                        is_causal=causal), rtol=1e-10, atol=1e-12)
    up = RNG.standard_normal(y.shape)
    # the upstream gradient as the model hands it: a (B, T, C) array seen as (B, nh, T, hs)
    g = mt.tensor(np.ascontiguousarray(up.transpose(0, 2, 1, 3))).transpose(1, 2)
    y.backward(g)
    want.backward(mt.tensor(up))
    got = qkv.grad.numpy().reshape(B, T, 3, nh, C // nh)
    for i, t in enumerate(copies):
        np.testing.assert_allclose(got[:, :, i].transpose(0, 2, 1, 3), t.grad.numpy(),
                                   rtol=1e-11, atol=1e-13)
    assert mt.gradcheck(lambda x: F.scaled_dot_product_attention(
        *_heads_of_projection(x, B, T, C, nh), is_causal=causal), (randn(B, T, 3 * C),))


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan, 1e30])
@pytest.mark.parametrize("where", [0, 1, 2])          # in q, k or v
def test_attention_in_place_heads_spread_non_finite_values_as_copies_do(value, where):
    # under is_causal the kernels skip the masked keys only for a (b, h) whose q, k, v are
    # finite and small: that test reads the heads at their strides too (a value planted in
    # one head of a (B, T, 3C) projection must send that head down the full path)
    B, T, C, nh = 2, 9, 8, 2
    a = RNG.standard_normal((B, T, 3 * C))
    a[1, 4, where * C + 5] = value                       # batch 1, row 4, head 1
    qkv = mt.tensor(a)
    heads = _heads_of_projection(qkv, B, T, C, nh)
    got = F.scaled_dot_product_attention(*heads, is_causal=True).numpy()
    copies = [mt.tensor(np.ascontiguousarray(t.numpy())) for t in heads]
    want = F.scaled_dot_product_attention(*copies, is_causal=True).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    torch = pytest.importorskip("torch")
    # torch's math adds -inf to the masked scores (its explicit causal mask; FUSED_OPS.md):
    # a NaN or inf key poisons the rows that mask it too
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.ascontiguousarray(t.numpy())) for t in heads),
        attn_mask=torch.from_numpy(np.tril(np.ones((T, T), bool))))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref.numpy()))


_LAYOUTS = {
    "reversed_rows": ((2, 3, 6, 4), lambda t: t.flip(2)),
    "strided_last_dim": ((2, 3, 6, 8), lambda t: t[..., ::2]),
    "broadcast_rows": ((2, 3, 1, 4), lambda t: t.expand(2, 3, 6, 4)),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_attention_copies_what_the_kernels_cannot_read_in_place(layout):
    # rows that run backwards, elements not adjacent in a row, every row the same one:
    # no gemm can walk them, so the op hands the kernels a copy (values and gradients as
    # for a contiguous input)
    shape, make = _LAYOUTS[layout]
    base = randn(*shape)
    q = make(base)
    k, v = randn(2, 3, 6, 4), randn(2, 3, 6, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(y.numpy(), ref_attention(q.numpy(), k.numpy(), v.numpy(),
                                                        is_causal=True), rtol=1e-10, atol=1e-12)
    assert mt.gradcheck(lambda a, b, c: F.scaled_dot_product_attention(make(a), b, c, is_causal=True),
                        (base, k, v))
    # the same layouts for the upstream gradient (a broadcast one from y.sum())
    for up in (mt.ones(()).expand(*y.shape), make(randn(*shape, requires_grad=False))):
        if up.shape != y.shape:
            continue
        q2 = mt.tensor(q.numpy(), requires_grad=True)
        F.scaled_dot_product_attention(q2, k, v, is_causal=True).backward(up)
        q3 = mt.tensor(q.numpy(), requires_grad=True)
        F.scaled_dot_product_attention(q3, k, v, is_causal=True).backward(
            mt.tensor(np.ascontiguousarray(up.numpy())))
        np.testing.assert_allclose(q2.grad.numpy(), q3.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_attention_fully_masked_row_gives_zeros():
    q, k, v = randn(1, 1, 3, 2), randn(1, 1, 4, 2), randn(1, 1, 4, 2)
    mask = np.ones((3, 4), bool)
    mask[1] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(mask))
    np.testing.assert_array_equal(out.numpy()[0, 0, 1], 0.0)
    out.sum().backward()
    assert np.isfinite(q.grad.numpy()).all() and np.isfinite(k.grad.numpy()).all()
    np.testing.assert_array_equal(q.grad.numpy()[0, 0, 1], 0.0)


def test_attention_dropout_matches_reference_with_the_kernel_mask():
    q, k, v = randn(2, 2, 9, 4), randn(2, 2, 9, 4), randn(2, 2, 9, 4)
    p = 0.3
    mt.manual_seed(7)
    got = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    mt.manual_seed(7)
    seed = int(mt.core._core.default_generator().integers(0, 2 ** 63))
    keep = np.empty((4, 9, 9))
    _fused_attention.attention_dropout_mask(keep, seed, p)
    frac = (keep[np.broadcast_to(np.tril(np.ones((9, 9), bool)), keep.shape)] == 0).mean()
    assert 0.1 < frac < 0.5
    np.testing.assert_array_equal(np.unique(keep), [0.0, 1 / (1 - p)])
    want = ref_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True, keep=keep.reshape(2, 2, 9, 9))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10)

    def fn(a, b, c):
        mt.manual_seed(3)                                 # the same mask at every evaluation
        return F.scaled_dot_product_attention(a, b, c, dropout_p=p, is_causal=True)
    assert mt.gradcheck(fn, (q, k, v))
    # p = 1 drops everything
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    np.testing.assert_array_equal(out.numpy(), 0.0)


def test_attention_float32_close_to_float64():
    for name in ("causal", "padding_mask", "additive_mask"):
        q, k, v, kw = _attention_inputs(name)
        kw32 = {key: (val.float() if isinstance(val, mt.Tensor) and val.dtype == mt.float64 else val)
                for key, val in kw.items()}
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        o64 = F.scaled_dot_product_attention(q, k, v, **kw)
        o32 = F.scaled_dot_product_attention(q32, k32, v32, **kw32)
        assert o32.dtype == mt.float32
        np.testing.assert_allclose(o32.numpy(), o64.numpy(), rtol=1e-4, atol=1e-5)
        g = RNG.standard_normal(o64.shape)
        o64.backward(mt.tensor(g))
        o32.backward(mt.tensor(g.astype(np.float32)))
        for a, b in ((q32, q), (k32, k), (v32, v)):
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-3, atol=1e-4)


def test_attention_threads_agree():
    # several (b, h) pairs per thread, blocks of rows, causal trimming: 1 and 2 threads agree
    q, k, v = (randn(3, 4, 70, 8, dtype=np.float32) for _ in range(3))
    prev = mt.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            mt.set_num_threads(n)
            for t in (q, k, v):
                t.grad = None
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.sum().backward()
            outs.append([o.numpy().copy(), q.grad.numpy().copy(), k.grad.numpy().copy()])
    finally:
        mt.set_num_threads(prev)
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    want = ref_attention(q.numpy().astype(np.float64), k.numpy().astype(np.float64),
                         v.numpy().astype(np.float64), is_causal=True)
    np.testing.assert_allclose(outs[0][0], want, rtol=1e-4, atol=1e-5)


# ---- gradchecks of the other ops (float64, random upstream gradient) -------------------

GRADCHECKS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), [(2, 3, 4), (5, 4), (5,)]),
    "linear_nobias": (lambda x, w: F.linear(x, w), [(3, 4), (2, 4)]),
    "linear_transposed_x": (lambda x, w, b: F.linear(x.transpose(0, 1), w, b), [(4, 3), (2, 4), (2,)]),
    "gelu": (lambda x: F.gelu(x), [(3, 5)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), [(3, 5)]),
    "silu": (lambda x: F.silu(x), [(3, 5)]),
    "relu": (lambda x: F.relu(x), [(3, 5)]),
    "sigmoid": (lambda x: F.sigmoid(x), [(3, 5)]),
    "tanh": (lambda x: F.tanh(x), [(3, 5)]),
    "softmax": (lambda x: F.softmax(x, dim=0), [(3, 5)]),
    "log_softmax": (lambda x: F.log_softmax(x, dim=-1), [(3, 5)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [(3, 4), (4,), (4,)]),
    "layer_norm_2d": (lambda x, w, b: F.layer_norm(x, (2, 3), w, b), [(2, 2, 3), (2, 3), (2, 3)]),
    "layer_norm_plain": (lambda x: F.layer_norm(x, 5), [(3, 5)]),
    "layer_norm_sliced": (lambda x, w: F.layer_norm(x[:, 1:], 4, w), [(3, 5), (4,)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), [(3, 4), (4,)]),
    "rms_norm_plain": (lambda x: F.rms_norm(x, [2, 3]), [(2, 2, 3)]),
    "mse_mean": (lambda a, b: F.mse_loss(a, b), [(3, 4), (3, 4)]),
    "mse_sum": (lambda a, b: F.mse_loss(a, b, reduction="sum"), [(3, 4), (3, 4)]),
    "mse_none": (lambda a, b: F.mse_loss(a, b, reduction="none"), [(3, 4), (3, 4)]),
    "embedding": (lambda w: F.embedding(mt.tensor([[0, 3, 3], [3, 1, 0]]), w), [(4, 3)]),
}


@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_gradcheck(name):
    fn, shapes = GRADCHECKS[name]
    inputs = [randn(*s) for s in shapes]
    assert mt.gradcheck(fn, inputs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_gradcheck(reduction):
    x = randn(7, 4)
    t = mt.tensor([0, 3, -100, 2, 2, -100, 1])
    assert mt.gradcheck(lambda a: F.cross_entropy(a, t, reduction=reduction), (x,))
    x3 = randn(2, 4, 3)                                   # (N, C, d)
    t3 = mt.tensor([[0, 3, -100], [1, 1, 2]])
    assert mt.gradcheck(lambda a: F.cross_entropy(a, t3, reduction=reduction), (x3,))
    xl = randn(2, 3, 4)                                   # (B, T, C) with (B, T)
    tl = mt.tensor([[0, 3, -100], [1, 1, 2]])
    assert mt.gradcheck(lambda a: F.cross_entropy(a, tl, reduction=reduction), (xl,))


def test_dropout_gradient_is_the_mask():
    x = randn(50, 40)
    mt.manual_seed(0)
    y = F.dropout(x, 0.25)
    g = RNG.standard_normal(y.shape)
    y.backward(mt.tensor(g))
    kept = y.numpy() != 0
    np.testing.assert_allclose(y.numpy()[kept], x.numpy()[kept] / 0.75, rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), np.where(kept, g / 0.75, 0.0), rtol=1e-12)

    def fn(a):
        mt.manual_seed(1)
        return F.dropout(a, 0.4)
    assert mt.gradcheck(fn, (randn(4, 5),))


def test_dropout_behaviour():
    x = mt.ones(20000)
    mt.manual_seed(5)
    a = F.dropout(x, 0.3).numpy()
    mt.manual_seed(5)
    b = F.dropout(x, 0.3).numpy()
    np.testing.assert_array_equal(a, b)                  # reproducible under manual_seed
    assert abs((a == 0).mean() - 0.3) < 0.02
    assert abs(a.mean() - 1.0) < 0.03                    # scaled by 1/(1-p)
    assert F.dropout(x, 0.3, training=False) is x
    assert F.dropout(x, 0.0) is x
    np.testing.assert_array_equal(F.dropout(x, 1.0).numpy(), 0.0)


# ---- float32 against float64 ------------------------------------------------------------

@pytest.mark.parametrize("name", ["linear", "gelu", "gelu_tanh", "silu", "layer_norm", "layer_norm_2d",
                                  "rms_norm", "mse_mean", "embedding"])
def test_float32_close_to_float64(name):
    fn, shapes = GRADCHECKS[name]
    x64 = [randn(*s) for s in shapes]
    x32 = [t.detach().float().requires_grad_() for t in x64]
    y64, y32 = fn(*x64), fn(*x32)
    assert y32.dtype == mt.float32
    np.testing.assert_allclose(y32.numpy(), y64.numpy(), rtol=1e-4, atol=1e-5)
    g = RNG.standard_normal(y64.shape)
    y64.backward(mt.tensor(g))
    y32.backward(mt.tensor(g.astype(np.float32)))
    for a, b in zip(x32, x64):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-3, atol=1e-4)


def test_cross_entropy_float32_close_to_float64():
    x = randn(64, 33)
    t = RNG.integers(0, 33, 64)
    t[::5] = -100
    x32 = x.detach().float().requires_grad_()
    l64 = F.cross_entropy(x, mt.tensor(t))
    l32 = F.cross_entropy(x32, mt.tensor(t))
    assert l32.dtype == mt.float32
    assert l32.item() == pytest.approx(l64.item(), rel=1e-5)
    l64.backward()
    l32.backward()
    np.testing.assert_allclose(x32.grad.numpy(), x.grad.numpy(), rtol=1e-4, atol=1e-6)


# ---- bad inputs -------------------------------------------------------------------------

def test_errors_name_the_problem():
    x = randn(3, 4)
    with pytest.raises(mt.ShapeError, match=r"\(3, 4\).*\(5, 3\)"):
        F.linear(x, randn(5, 3))
    with pytest.raises(ValueError):                      # ShapeError is also a ValueError
        F.linear(x, randn(5, 4), randn(4))
    with pytest.raises(TypeError, match="float64.*float32|float32.*float64"):
        F.linear(x, randn(5, 4, dtype=np.float32))
    with pytest.raises(TypeError, match="floating"):
        F.gelu(mt.tensor([1, 2]))
    with pytest.raises(ValueError, match="approximate"):
        F.gelu(x, approximate="fast")
    with pytest.raises(mt.ShapeError, match=r"\(3, 4\).*\(5,\)"):
        F.layer_norm(x, 5)
    with pytest.raises(mt.ShapeError, match="weight"):
        F.layer_norm(x, 4, randn(3))
    with pytest.raises(mt.ShapeError, match=r"\(3, 4\).*\(2,\)"):
        F.rms_norm(x, (2,))


def test_cross_entropy_errors():
    x = randn(4, 5)
    with pytest.raises(IndexError, match=r"7.*5 classes"):
        F.cross_entropy(x, mt.tensor([0, 7, 1, 2]))
    with pytest.raises(IndexError, match=r"-3.*5 classes"):
        F.cross_entropy(x, mt.tensor([0, -3, 1, 2]))
    with pytest.raises(mt.ShapeError, match=r"\(4, 5\).*\(3,\)"):
        F.cross_entropy(x, mt.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError):                    # ShapeError is also a RuntimeError
        F.cross_entropy(x, mt.tensor([[0, 1, 2, 3]]))
    with pytest.raises(TypeError, match="int64"):
        F.cross_entropy(x, mt.tensor([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(x, mt.tensor([0, 1, 2, 3]), reduction="avg")


def test_embedding_errors():
    w = randn(6, 2)
    with pytest.raises(IndexError, match=r"index 6 .*num_embeddings=6"):
        F.embedding(mt.tensor([1, 6]), w)
    with pytest.raises(IndexError, match=r"-1"):
        F.embedding(mt.tensor([-1]), w)
    with pytest.raises(TypeError, match="integer"):
        F.embedding(mt.tensor([1.0]), w)


def test_dropout_errors():
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(randn(3), p)


def test_attention_errors():
    q, k, v = randn(2, 4, 3), randn(2, 5, 3), randn(2, 5, 3)
    with pytest.raises(mt.ShapeError, match=r"\(2, 4, 3\).*\(2, 5, 2\)"):
        F.scaled_dot_product_attention(q, randn(2, 5, 2), v)
    with pytest.raises(mt.ShapeError):
        F.scaled_dot_product_attention(q, k, randn(2, 4, 3))
    with pytest.raises(mt.ShapeError, match=r"\(3, 5\)"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(np.ones((3, 5), bool)))
    with pytest.raises(mt.ShapeError, match="batch"):
        F.scaled_dot_product_attention(randn(3, 4, 3), k, v)
    with pytest.raises(RuntimeError, match="not both"):   # torch's class
        F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(np.ones((4, 5), bool)), is_causal=True)
    with pytest.raises(TypeError, match="bool"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(np.ones((4, 5), np.int64)))
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=2.0)
    with pytest.raises(TypeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k.float(), v)


def test_a_wrong_rule_fails_gradcheck():
    """The checks above can fail: a node with a deliberately wrong backward is caught."""
    from microtensor.core._core import Node, wrap, attach

    class WrongGelu(Node):
        def backward(self, g):
            return (g * 0.5,)                              # the derivative at 0 only

    def wrong_gelu(x):
        out = wrap(ref_gelu(x.numpy()))
        attach(out, WrongGelu(), (x,))
        return out
    with pytest.raises(RuntimeError, match="Jacobian mismatch"):
        mt.gradcheck(wrong_gelu, (randn(3, 3),))


# ---- the builds of the kernels (baseline, AVX2+FMA, AVX-512) agree ---------------------

def test_kernel_builds_agree():
    from conftest import kernel_builds_here
    builds = [b[1] for b in kernel_builds_here()]
    if len(builds) < 2:
        pytest.skip("this CPU runs one build of the kernels only (no AVX2+FMA)")
    rng = np.random.default_rng(1003)      # its own draws: not shifted by the tests above
    x = rng.standard_normal(100_003).astype(np.float32) * 4
    x[:6] = [0.0, -0.0, 30.0, -30.0, 90.0, -90.0]
    g = rng.standard_normal(100_003).astype(np.float32)
    for name in ("gelu", "gelu_tanh", "silu"):
        outs = []
        for mod in builds:
            y, d = np.empty_like(x), np.empty_like(x)
            getattr(mod, name + "_forward")(y, x, 1)
            getattr(mod, name + "_backward")(d, g, x, 1)
            outs.append((y, d))
        for y, d in outs[1:]:
            np.testing.assert_allclose(outs[0][0], y, rtol=1e-5, atol=1e-6)
            # backward is g * f'(x): the builds round f' differently (fused multiply-adds
            # against separate ones), and the tanh GELU's 1 - t^2 loses digits to
            # cancellation near |x| = 3.5 (t = -0.9993): an error of ~1e-6 in f', times g
            diff = np.abs(outs[0][1] - d)
            bound = 1e-5 * np.abs(outs[0][1]) + 1e-6 * np.maximum(np.abs(g), 1.0)
            worst = int(np.argmax(diff - bound))
            assert np.all(diff <= bound), (name, float(x[worst]), float(outs[0][1][worst]),
                                           float(d[worst]))
    # and the float32 polynomials agree with float64 libm through the public ops
    x64 = mt.tensor(x.astype(np.float64))
    for fn in (F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu, lambda t: F.softmax(t, 0)):
        np.testing.assert_allclose(fn(mt.tensor(x)).numpy(), fn(x64).numpy(), rtol=2e-6, atol=1e-6)


# ---- PyTorch ---------------------------------------------------------------------------

def _torch_pair(torch, arr):
    return mt.tensor(arr, requires_grad=True), torch.tensor(arr, requires_grad=True)


def _compare_with_torch(torch, mt_fn, torch_fn, arrays, rtol=1e-10, atol=1e-12):
    pairs = [_torch_pair(torch, a) for a in arrays]
    ym = mt_fn(*[m for m, _ in pairs])
    yt = torch_fn(*[t for _, t in pairs])
    np.testing.assert_allclose(ym.numpy(), yt.detach().numpy(), rtol=rtol, atol=atol)
    g = RNG.standard_normal(tuple(yt.shape))
    ym.backward(mt.tensor(g))
    yt.backward(torch.tensor(g))
    for m, t in pairs:
        np.testing.assert_allclose(m.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol)


def test_matches_torch_elementwise_and_norms():
    torch = pytest.importorskip("torch")
    TF = torch.nn.functional
    a = lambda *s: RNG.standard_normal(s)
    _compare_with_torch(torch, F.linear, TF.linear, [a(2, 3, 4), a(5, 4), a(5)])
    _compare_with_torch(torch, F.gelu, TF.gelu, [a(4, 6)])
    _compare_with_torch(torch, lambda x: F.gelu(x, approximate="tanh"),
                        lambda x: TF.gelu(x, approximate="tanh"), [a(4, 6)])
    _compare_with_torch(torch, F.silu, TF.silu, [a(4, 6)])
    _compare_with_torch(torch, lambda x, w, b: F.layer_norm(x, (3, 4), w, b),
                        lambda x, w, b: TF.layer_norm(x, (3, 4), w, b), [a(2, 3, 4), a(3, 4), a(3, 4)])
    _compare_with_torch(torch, lambda x, w: F.rms_norm(x, (4,), w),
                        lambda x, w: TF.rms_norm(x, (4,), w), [a(2, 3, 4), a(4)])
    _compare_with_torch(torch, F.mse_loss, TF.mse_loss, [a(3, 4), a(3, 4)])
    _compare_with_torch(torch, lambda x: F.softmax(x, 1), lambda x: TF.softmax(x, 1), [a(3, 4, 5)])
    _compare_with_torch(torch, lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1), [a(3, 4, 5)])
    w = a(7, 3)
    idx = RNG.integers(0, 7, (2, 5))
    _compare_with_torch(torch, lambda w: F.embedding(mt.tensor(idx), w),
                        lambda w: TF.embedding(torch.tensor(idx), w), [w])


def test_matches_torch_cross_entropy():
    torch = pytest.importorskip("torch")
    TF = torch.nn.functional
    x = RNG.standard_normal((8, 6)) * 3
    t = RNG.integers(0, 6, 8)
    t[[2, 5]] = -100
    for reduction in ("mean", "sum", "none"):
        for ls in (0.0, 0.1):
            _compare_with_torch(torch, lambda a: F.cross_entropy(a, mt.tensor(t), reduction=reduction, label_smoothing=ls),
                                lambda a: TF.cross_entropy(a, torch.tensor(t), reduction=reduction, label_smoothing=ls),
                                [x])
    x3 = RNG.standard_normal((2, 6, 3))
    t3 = RNG.integers(0, 6, (2, 3))
    _compare_with_torch(torch, lambda a: F.cross_entropy(a, mt.tensor(t3)),
                        lambda a: TF.cross_entropy(a, torch.tensor(t3)), [x3])


@pytest.mark.parametrize("name", ["plain", "causal", "causal_cross_short_q", "causal_cross_long_q",
                                  "bool_mask", "padding_mask", "additive_mask", "scale", "T1"])
def test_matches_torch_attention(name):
    torch = pytest.importorskip("torch")
    TF = torch.nn.functional
    q, k, v, kwargs = _attention_inputs(name)
    tkw = {key: (torch.tensor(val.numpy()) if isinstance(val, mt.Tensor) else val) for key, val in kwargs.items()}
    _compare_with_torch(torch, lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs),
                        lambda a, b, c: TF.scaled_dot_product_attention(a, b, c, **tkw),
                        [q.numpy(), k.numpy(), v.numpy()])
