"""scaled_dot_product_attention(enable_gqa=True), grouped-query attention, against torch
2.13: key and value with fewer heads than query (each kv head serving Hq / Hkv query
heads in a row), forward and backward with a random upstream gradient, on contiguous
heads and on heads that are views of one (B, T, 3C)-like projection, with masks,
causal or not; float64 gradchecks; torch's errors where the heads do not divide."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("one_thread")
RNG = np.random.default_rng(17)

# name: (q shape, k shape, v shape, mask shape or None, mask kind, is_causal)
CASES = {
    "two_groups": ((2, 4, 5, 3), (2, 2, 7, 3), (2, 2, 7, 2), None, None, False),
    "three_per_group_causal": ((1, 6, 7, 4), (1, 2, 7, 4), (1, 2, 7, 4), None, None, True),
    "one_kv_head": ((2, 5, 3, 2), (2, 1, 4, 2), (2, 1, 4, 3), None, None, False),
    "k_and_v_differ": ((2, 4, 3, 2), (2, 2, 5, 2), (2, 1, 5, 3), None, None, True),
    "kv_batch_broadcast": ((3, 6, 4, 2), (1, 3, 4, 2), (1, 3, 4, 2), None, None, False),
    "three_dims": ((6, 3, 4), (2, 5, 4), (2, 5, 4), None, None, False),
    "five_dims": ((2, 2, 4, 3, 2), (2, 1, 2, 3, 2), (2, 1, 2, 3, 2), None, None, True),
    "float_mask_per_head": ((2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 2), (4, 3, 5), "float", False),
    "float_mask_per_batch": ((2, 6, 3, 2), (2, 3, 5, 2), (2, 3, 5, 2), (2, 1, 3, 5), "float", False),
    "bool_mask_2d": ((2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 2), (3, 5), "bool", False),
    "bool_mask_per_head": ((1, 4, 3, 2), (1, 2, 5, 2), (1, 2, 5, 2), (1, 4, 3, 5), "bool", False),
}


def _mask(shape, kind):
    if shape is None:
        return None
    if kind == "bool":
        m = RNG.random(shape) < 0.7
        m[..., 0] = True                  # every row sees one key (torch gives NaN otherwise)
        return m
    return RNG.standard_normal(shape)


def _compare(q, k, v, mask, is_causal, mask_grad=False):
    """Our forward and gradients (q, k, v and a float mask) against torch's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    tmask = None if mask is None else torch.tensor(mask, requires_grad=mask_grad)
    with sdpa_kernel(SDPBackend.MATH):
        t_out = TF.scaled_dot_product_attention(*ts, attn_mask=tmask, is_causal=is_causal,
                                                enable_gqa=True)
    ours = [mt.tensor(a, requires_grad=True) for a in (q, k, v)]
    mmask = None if mask is None else mt.tensor(mask, requires_grad=mask_grad)
    out = F.scaled_dot_product_attention(*ours, attn_mask=mmask, is_causal=is_causal,
                                         enable_gqa=True)
    assert tuple(out.shape) == tuple(t_out.shape)
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), rtol=1e-12, atol=1e-13)
    g = RNG.standard_normal(out.shape)
    t_out.backward(torch.tensor(g))
    out.backward(mt.tensor(g))
    pairs = list(zip(ours, ts)) + ([(mmask, tmask)] if mask_grad else [])
    for i, (a, b) in enumerate(pairs):
        assert a.grad.shape == tuple(b.grad.shape), i
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-11, atol=1e-12,
                                   err_msg=f"gradient of input {i}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_gqa_matches_torch(name):
    qs, ks, vs, ms, kind, causal = CASES[name]
    q, k, v = (RNG.standard_normal(s) for s in (qs, ks, vs))
    _compare(q, k, v, _mask(ms, kind), causal, mask_grad=kind == "float")


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_on_heads_that_are_views_of_one_projection(causal):
    """q, k, v as models/ make them: one (B, T, (Hq + 2 Hkv) hs) projection, split and
    viewed (B, T, H, hs) then transposed (B, H, T, hs): strided heads, no copies."""
    B, T, Hq, Hkv, hs = 2, 9, 6, 2, 4
    x = RNG.standard_normal((B, T, (Hq + 2 * Hkv) * hs))
    mx = mt.tensor(x, requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)

    def heads(proj, split):
        q, k, v = split(proj)
        return (q.view(B, T, Hq, hs).transpose(1, 2), k.view(B, T, Hkv, hs).transpose(1, 2),
                v.view(B, T, Hkv, hs).transpose(1, 2))

    sizes = [Hq * hs, Hkv * hs, Hkv * hs]
    mq, mk, mv = heads(mx, lambda p: p.split(sizes, dim=2))
    assert not mq._data.flags.c_contiguous
    tq, tk, tv = heads(tx, lambda p: p.split(sizes, dim=2))
    out = F.scaled_dot_product_attention(mq, mk, mv, is_causal=causal, enable_gqa=True)
    t_out = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), rtol=1e-12, atol=1e-13)
    g = RNG.standard_normal(out.shape)
    out.backward(mt.tensor(g))
    t_out.backward(torch.tensor(g))
    np.testing.assert_allclose(mx.grad.numpy(), tx.grad.numpy(), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", ["two_groups", "k_and_v_differ", "float_mask_per_head",
                                  "five_dims"])
def test_gqa_gradchecks(name):
    qs, ks, vs, ms, kind, causal = CASES[name]
    q, k, v = (mt.tensor(RNG.standard_normal(s), requires_grad=True) for s in (qs, ks, vs))
    mask = _mask(ms, kind)
    mask = None if mask is None else mt.tensor(mask)

    def fn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)
    assert mt.gradcheck(fn, (q, k, v))
    assert mt.gradgradcheck(fn, (q, k, v))


def test_gqa_with_equal_heads_is_the_plain_call():
    q, k, v = (mt.tensor(RNG.standard_normal((2, 3, 4, 2))) for _ in range(3))
    np.testing.assert_array_equal(
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True).numpy(),
        F.scaled_dot_product_attention(q, k, v).numpy())


@pytest.mark.parametrize("shapes", [((2, 6, 3, 4), (2, 4, 5, 4), (2, 4, 5, 4)),
                                    ((2, 6, 3, 4), (2, 3, 5, 4), (2, 4, 5, 4))])
def test_gqa_refuses_heads_that_do_not_divide_as_torch(shapes):
    ts = [torch.randn(*s) for s in shapes]
    with pytest.raises(RuntimeError, match="must divide the number of heads"):
        TF.scaled_dot_product_attention(*ts, enable_gqa=True)
    ms = [mt.randn(*s) for s in shapes]
    with pytest.raises(RuntimeError, match="must divide the number of heads"):
        F.scaled_dot_product_attention(*ms, enable_gqa=True)


def test_gqa_needs_a_head_dim_as_torch():
    with pytest.raises(IndexError):
        TF.scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4),
                                        enable_gqa=True)
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(mt.randn(3, 4), mt.randn(5, 4), mt.randn(5, 4),
                                       enable_gqa=True)


def test_mismatched_heads_without_gqa_are_refused_as_torch():
    shapes = ((2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 2))
    with pytest.raises(RuntimeError):
        TF.scaled_dot_product_attention(*[torch.randn(*s) for s in shapes])
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        F.scaled_dot_product_attention(*[mt.randn(*s) for s in shapes])
