"""Losses at their edges, against torch: cross_entropy with class weights, label
smoothing and ignore_index (an all-ignored batch: NaN loss for 'mean', a gradient of
exactly 0), and nll_loss with weight= (torch's semantics: 'mean' divides by the summed
weights of the counted targets), ignore_index and every layout. Gradients are also
checked against central differences in float64 with a random upstream gradient."""
import itertools

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as mF

torch = pytest.importorskip("torch")
tF = torch.nn.functional

LAYOUTS = {"1d": ((5,), ()), "2d": ((6, 5), (6,)), "3d": ((3, 5, 4), (3, 4)),
           "4d": ((2, 5, 2, 3), (2, 2, 3))}
IGNORE = 2


def case(layout, ignored, seed=0):
    """Logits and targets; `ignored`: 'none', 'some' or 'all' targets equal IGNORE."""
    xs, ts = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs)
    t = rng.integers(0, 5, size=ts)
    t = np.where(t == IGNORE, 4, t)
    if ignored == "all":
        t = np.full(ts, IGNORE)
    elif ignored == "some":
        t = np.where(rng.random(ts) < 0.5, IGNORE, t)
        t.reshape(-1)[0] = IGNORE
        if t.size > 1:
            t.reshape(-1)[-1] = 1
    return x, t


WEIGHT = np.array([0.5, 2.0, 1.5, 0.25, 3.0])


def run(lib, fn_name, x, t, upstream, **kw):
    F = tF if lib is torch else mF
    xt = lib.tensor(x, dtype=lib.float64, requires_grad=True)
    if kw.get("weight") is not None:
        kw["weight"] = lib.tensor(kw["weight"], dtype=lib.float64)
    loss = getattr(F, fn_name)(xt, lib.tensor(t, dtype=lib.int64), **kw)
    (loss * lib.tensor(upstream, dtype=lib.float64)).sum().backward()
    return loss.detach().numpy(), xt.grad.numpy()


def upstream_for(reduction, t, seed=1):
    shape = t.shape if reduction == "none" else ()
    return np.random.default_rng(seed).standard_normal(shape)


def check_against_torch(fn_name, layout, ignored, reduction, **kw):
    x, t = case(layout, ignored)
    g = upstream_for(reduction, t)
    lm, gm = run(mt, fn_name, x, t, g, reduction=reduction, ignore_index=IGNORE, **kw)
    lt, gt = run(torch, fn_name, x, t, g, reduction=reduction, ignore_index=IGNORE, **kw)
    np.testing.assert_allclose(lm, lt, rtol=1e-12, atol=1e-14, equal_nan=True)
    np.testing.assert_allclose(gm, gt, rtol=1e-12, atol=1e-14, equal_nan=True)
    assert np.array_equal(np.isnan(gm), np.isnan(gt))
    if ignored == "all":
        assert np.array_equal(gm, np.zeros_like(gm))           # exactly 0, never NaN
        if reduction == "mean":
            assert np.isnan(lm)
    return x, t


def gradcheck(fn_name, x, t, reduction, **kw):
    F = getattr(mF, fn_name)
    g = mt.tensor(upstream_for(reduction, t, seed=7), dtype=mt.float64)
    tt = mt.tensor(t, dtype=mt.int64)
    if kw.get("weight") is not None:
        kw["weight"] = mt.tensor(kw["weight"], dtype=mt.float64)

    def f(xx):
        return (F(xx, tt, reduction=reduction, ignore_index=IGNORE, **kw) * g).sum()
    assert mt.gradcheck(f, [mt.tensor(x, dtype=mt.float64, requires_grad=True)])


# ---- cross_entropy: every combination of weight, smoothing, reduction, layout ----------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignored", ["all", "some", "none"])
def test_cross_entropy_ignore_index_weight_smoothing(ignored, weighted, smoothing, reduction,
                                                     layout):
    kw = {"weight": WEIGHT if weighted else None, "label_smoothing": smoothing}
    x, t = check_against_torch("cross_entropy", layout, ignored, reduction, **kw)
    if ignored != "all" or reduction != "mean":
        gradcheck("cross_entropy", x, t, reduction, **kw)


def test_one_padding_only_batch_leaves_the_weights_finite():
    """The training loop the bug broke: a padding-only batch between two real ones."""
    mt.manual_seed(0)
    model = mt.nn.Linear(4, 5).double()
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    w = mt.tensor(WEIGHT, dtype=mt.float64)
    for targets in ([0, 1, 3], [IGNORE] * 3, [4, 0, 1]):
        x = mt.randn(3, 4, dtype=mt.float64)
        loss = mF.cross_entropy(model(x), mt.tensor(targets), weight=w, label_smoothing=0.1,
                                ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for p in model.parameters():
            assert np.isfinite(p.detach().numpy()).all()


# ---- nll_loss: weight=, ignore_index, every layout, every reduction --------------------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignored", ["all", "some", "none"])
def test_nll_loss_weight_and_ignore_index(ignored, weighted, reduction, layout):
    kw = {"weight": WEIGHT if weighted else None}
    x, t = check_against_torch("nll_loss", layout, ignored, reduction, **kw)
    if ignored != "all" or reduction != "mean":
        gradcheck("nll_loss", x, t, reduction, **kw)


def test_nll_loss_mean_divides_by_the_summed_weights():
    x, t = case("2d", "some")
    lp = mF.log_softmax(mt.tensor(x), 1)
    got = mF.nll_loss(lp, mt.tensor(t), weight=mt.tensor(WEIGHT), ignore_index=IGNORE).item()
    keep = t != IGNORE
    picked = lp.numpy()[np.arange(len(t)), t][keep]
    want = -(picked * WEIGHT[t[keep]]).sum() / WEIGHT[t[keep]].sum()
    assert got == pytest.approx(want, rel=1e-12)
    assert got != pytest.approx(-(picked * WEIGHT[t[keep]]).sum() / keep.sum(), rel=1e-6)


def test_nll_loss_zero_total_weight_is_nan_where_torch_says():
    """Counted targets whose weights are all 0: NaN loss, NaN at those entries only."""
    x = np.random.default_rng(3).standard_normal((4, 5))
    t = np.array([0, 0, IGNORE, 0])
    w = np.array([0.0, 1.0, 2.0, 1.0, 1.0])
    for fn in ("nll_loss", "cross_entropy"):
        lm, gm = run(mt, fn, x, t, np.array(1.0), weight=w, ignore_index=IGNORE)
        lt, gt = run(torch, fn, x, t, np.array(1.0), weight=w, ignore_index=IGNORE)
        assert np.isnan(lm) and np.isnan(lt)
        assert np.array_equal(np.isnan(gm), np.isnan(gt)), fn
        np.testing.assert_array_equal(np.nan_to_num(gm), np.nan_to_num(gt))


@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_positional_order_legacy_arguments_and_module_as_torch(weighted):
    x, t = case("3d", "some")
    results = []
    for lib, F in ((mt, mF), (torch, tF)):
        lp = F.log_softmax(lib.tensor(x, dtype=lib.float64), 1)
        tt = lib.tensor(t, dtype=lib.int64)
        w = lib.tensor(WEIGHT, dtype=lib.float64) if weighted else None
        out = [F.nll_loss(lp, tt, w, None, IGNORE),                     # torch's order
               F.nll_loss(lp, tt, w, ignore_index=IGNORE, size_average=False),
               F.nll_loss(lp, tt, w, ignore_index=IGNORE, reduce=False),
               lib.nn.NLLLoss(weight=w, ignore_index=IGNORE)(lp, tt),
               lib.nn.NLLLoss(w, reduction="sum", ignore_index=IGNORE)(lp, tt)]
        results.append([o.numpy() for o in out])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("bad", ["weight_shape", "target_shape", "out_of_bounds", "float_target"])
def test_nll_loss_refuses_bad_input_naming_it(bad):
    lp = mF.log_softmax(mt.randn(3, 5), 1)
    t, w = mt.tensor([0, 1, 4]), None
    match = {"weight_shape": "weight", "target_shape": "target shape",
             "out_of_bounds": "out of bounds", "float_target": "dtype"}[bad]
    if bad == "weight_shape":
        w = mt.ones(4)
    elif bad == "target_shape":
        t = mt.tensor([0, 1])
    elif bad == "out_of_bounds":
        t = mt.tensor([0, 5, 1])
    else:
        t = mt.tensor([0.0, 1.0, 2.0])
    with pytest.raises(Exception, match=match):
        mF.nll_loss(lp, t, weight=w)
