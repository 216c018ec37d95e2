"""Where NaN and inf go in scaled_dot_product_attention, row by row, against torch's
math backend (`sdpa_kernel(SDPBackend.MATH)`, the backend microtensor follows:
docs/FUSED_OPS.md).

Torch's math backend adds -inf to the masked scores, so a +inf or NaN score in a
masked entry turns into NaN and poisons its whole row, and 0 * inf in P @ v (an inf
in v) is NaN too; torch's default CPU kernel (flash attention) skips the masked blocks
and gives fewer NaN rows. The fused kernel trims the causal triangle only for a head
whose inputs are finite and small: these tests put +-inf, NaN and overflowing values
into q, k and v of heads that are contiguous and heads that are views of one
(B, T, 3C) projection (as models/ make them), causal and not, with bool and float
masks, at T on both sides of the kernel's row block (64 rows under is_causal), in
every kernel build, at one thread and two, and compare the NaN and inf pattern of
the output and of every gradient element by element, the finite values closely.
"""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from conftest import kernel_builds_here  # noqa: E402

B, NH, HS = 2, 2, 4
C = NH * HS


@pytest.fixture
def use_build(monkeypatch):
    def use(build):
        monkeypatch.setattr(F._kernels, "fused", build[1])
        monkeypatch.setattr(F._kernels, "attention", build[2])
    return use


def _builds():
    return [pytest.param(b, id=b[0]) for b in kernel_builds_here()]


# where the bad value goes: (which of q/k/v, position t, column within the head, value);
# the batch entry and the head are fixed (b = 1, head 0): the other heads stay finite
def _huge(dtype):
    return np.finfo(dtype).max / 4


POISONS = {
    "pos_inf_in_last_key": ("k", -1, 0, np.inf),
    "pos_inf_in_middle_key": ("k", "mid", 1, np.inf),
    "neg_inf_in_first_key": ("k", 0, 2, -np.inf),
    "nan_in_key": ("k", "mid", 3, np.nan),
    "pos_inf_in_query": ("q", 1, 0, np.inf),
    "nan_in_query": ("q", -1, 1, np.nan),
    "inf_in_value": ("v", "mid", 0, np.inf),
    "nan_in_value": ("v", 0, 2, np.nan),
    "overflowing_key": ("k", "mid", 0, _huge),
}

MASKS = ["none", "causal", "bool", "float"]


def _input(T, dtype, poison):
    """x (B, T, 3C) with one value set in q, k or v of batch entry 1, head 0."""
    x = np.random.default_rng(T).standard_normal((B, T, 3 * C)).astype(dtype)
    part, t, col, value = POISONS[poison]
    t = T // 2 if t == "mid" else t
    offset = "qkv".index(part) * C
    x[1, t, offset + col] = value(dtype) if callable(value) else value
    return x


def _mask(kind, T, dtype):
    rng = np.random.default_rng(99)
    if kind == "bool":
        m = rng.random((T, T)) < 0.7
        m[:, 0] = True
        m[3 % T, :] = False                    # a row that attends to nothing: zeros
        return m
    if kind == "float":
        m = rng.standard_normal((B, 1, T, T)).astype(dtype)
        m[rng.random(m.shape) < 0.2] = -np.inf
        return m
    return None


def _heads(x, T, strided, split):
    """q, k, v (B, NH, T, HS): views of x's three column bands (strided), or copies."""
    q, k, v = split(x)
    heads = [h.view(B, T, NH, HS).transpose(1, 2) for h in (q, k, v)]
    return heads if strided else [h.contiguous() for h in heads]


def _same_pattern(ours, theirs, what, dtype):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isposinf(ours), np.isposinf(theirs), err_msg=f"{what}: +inf")
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs), err_msg=f"{what}: -inf")
    finite = np.isfinite(theirs)
    scale = np.abs(theirs[finite]).max(initial=1.0)
    tol = 1e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(ours[finite] / scale, theirs[finite] / scale, rtol=tol, atol=tol,
                               err_msg=what)


def _compare(x, T, mask_kind, strided, dtype):
    mask = _mask(mask_kind, T, dtype)
    causal = mask_kind == "causal"
    g = np.random.default_rng(5).standard_normal((B, NH, T, HS)).astype(dtype)

    mx = mt.tensor(x, requires_grad=True)
    mq, mk, mv = _heads(mx, T, strided, lambda a: a.split(C, dim=2))
    if strided:
        assert not mq._data.flags.c_contiguous     # the heads are read where they lie
    out = F.scaled_dot_product_attention(mq, mk, mv, is_causal=causal,
                                         attn_mask=None if mask is None else mt.tensor(mask))
    out.backward(mt.tensor(g))

    tx = torch.tensor(x, requires_grad=True)
    tq, tk, tv = _heads(tx, T, strided, lambda a: a.split(C, dim=2))
    with sdpa_kernel(SDPBackend.MATH):
        t_out = TF.scaled_dot_product_attention(
            tq, tk, tv, is_causal=causal, attn_mask=None if mask is None else torch.tensor(mask))
    t_out.backward(torch.tensor(g))

    _same_pattern(out.numpy(), t_out.detach().numpy(), "output", dtype)
    _same_pattern(mx.grad.numpy(), tx.grad.numpy(), "gradient of the projection", dtype)
    return np.isnan(t_out.detach().numpy())


@pytest.mark.parametrize("build", _builds())
@pytest.mark.parametrize("strided", [True, False], ids=["strided_heads", "contiguous_heads"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_nonfinite_pattern_matches_torch_math(poison, mask_kind, strided, build, use_build):
    use_build(build)
    for dtype in (np.float32, np.float64):
        _compare(_input(10, dtype, poison), 10, mask_kind, strided, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "float"])
@pytest.mark.parametrize("poison", ["pos_inf_in_middle_key", "nan_in_value", "overflowing_key"])
def test_nonfinite_pattern_across_row_blocks_and_threads(poison, mask_kind, threads):
    """T = 150: three causal row blocks of 64 (two of 128 without), each (b, h) its own
    thread at two threads (the poisoned head's neighbours stay finite)."""
    before = mt.get_num_threads()
    mt.set_num_threads(threads)
    try:
        _compare(_input(150, np.float32, poison), 150, mask_kind, True, np.float32)
    finally:
        mt.set_num_threads(before)


def test_causal_inf_in_a_key_poisons_the_rows_torch_math_poisons():
    """The case that differs between torch's backends: a +inf in the last key of a causal
    head is NaN, in the math backend, on every row whose score there is +inf (rows before
    the key too: +inf + -inf); the flash kernel's output has it on the last row only.
    The rows are those of torch's math backend, and more than the last one."""
    T = 10
    x = _input(T, np.float64, "pos_inf_in_last_key")
    x[1, :, 0] = np.abs(x[1, :, 0]) + 0.1            # every query meets +inf there
    nan_rows = _compare(x, T, "causal", True, np.float64).any(-1)
    assert nan_rows[1, 0].all()                       # the poisoned head: every row
    assert not nan_rows[0].any() and not nan_rows[1, 1].any()    # the other heads: none


def test_nonfinite_pattern_through_compiled_views():
    """mt.compile's fused attention on views of the projection (attention_on_views)."""
    T = 12
    causal = True

    class Attention(mt.nn.Module):
        def forward(self, x):
            q, k, v = x.split(C, dim=2)
            q, k, v = (h.view(B, T, NH, HS).transpose(1, 2) for h in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return y.transpose(1, 2).contiguous().view(B, T, C)

    compiled = mt.compile(Attention())
    for poison in ("pos_inf_in_middle_key", "inf_in_value", "nan_in_query"):
        x = _input(T, np.float64, poison)
        g = np.random.default_rng(3).standard_normal((B, T, C))
        mx = mt.tensor(x, requires_grad=True)
        for _ in range(2):                            # recorded, then replayed
            mx.grad = None
            out = compiled(mx)
            out.backward(mt.tensor(g))
        tx = torch.tensor(x, requires_grad=True)
        tq, tk, tv = (h.view(B, T, NH, HS).transpose(1, 2) for h in tx.split(C, dim=2))
        with sdpa_kernel(SDPBackend.MATH):
            t_out = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        t_out = t_out.transpose(1, 2).reshape(B, T, C)
        t_out.backward(torch.tensor(g))
        _same_pattern(out.numpy(), t_out.detach().numpy(), f"{poison}: output", np.float64)
        _same_pattern(mx.grad.numpy(), tx.grad.numpy(), f"{poison}: gradient", np.float64)
