"""mt.optim: update rules against the textbook formulas in numpy (and torch.optim when
installed), param groups, state dicts through checkpoints, schedulers."""
import json
import math

import numpy as np
import pytest

import microtensor as mt
from microtensor import nn
from microtensor.optim import lr_scheduler


# -- textbook references, written out in numpy -----------------------------------------

def ref_sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    buf = None
    for g in grads:
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(p, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             decoupled=False, amsgrad=False):
    b1, b2 = betas
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    v_max = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        v_max = np.maximum(v_max, v)
        m_hat = m / (1 - b1 ** t)
        v_hat = (v_max if amsgrad else v) / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def make_grads(shape, n, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def run_mt(opt_cls, p0, grads, **kwargs):
    p = mt.Parameter(p0.copy())
    opt = opt_cls([p], **kwargs)
    for g in grads:
        p.grad = mt.from_numpy(g.copy())
        opt.step()
    return p.numpy(), opt


CASES = [
    (mt.optim.SGD, ref_sgd, dict(lr=0.1)),
    (mt.optim.SGD, ref_sgd, dict(lr=0.1, weight_decay=0.05)),
    (mt.optim.SGD, ref_sgd, dict(lr=0.05, momentum=0.9)),
    (mt.optim.SGD, ref_sgd, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (mt.optim.SGD, ref_sgd, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02)),
    (mt.optim.Adam, ref_adam, dict(lr=1e-2)),
    (mt.optim.Adam, ref_adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (mt.optim.Adam, ref_adam, dict(lr=1e-2, amsgrad=True)),
    (mt.optim.AdamW, lambda p, g, **k: ref_adam(p, g, decoupled=True, **k),
     dict(lr=1e-2, weight_decay=0.1)),
    (mt.optim.AdamW, lambda p, g, **k: ref_adam(p, g, decoupled=True, **k),
     dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)),
]


@pytest.mark.parametrize("opt_cls, ref, kwargs", CASES)
def test_update_matches_textbook_float64(opt_cls, ref, kwargs):
    p0 = np.random.default_rng(1).standard_normal((7, 5))
    grads = make_grads(p0.shape, 6)
    got, _ = run_mt(opt_cls, p0, grads, **kwargs)
    np.testing.assert_allclose(got, ref(p0, grads, **kwargs), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("opt_cls, ref, kwargs", CASES[::3])
def test_update_float32_close_to_float64_textbook(opt_cls, ref, kwargs):
    p0 = np.random.default_rng(2).standard_normal((33,)).astype(np.float32)
    grads = make_grads(p0.shape, 4, dtype=np.float32)
    got, opt = run_mt(opt_cls, p0, grads, **kwargs)
    assert got.dtype == np.float32
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, mt.Tensor):
                assert value.dtype == mt.float32
    expected = ref(p0.astype(np.float64), [g.astype(np.float64) for g in grads], **kwargs)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)


def test_the_comparison_can_fail_without_bias_correction():
    # a rule that forgets Adam's bias correction must not pass the check above
    p0 = np.random.default_rng(3).standard_normal(10)
    grads = make_grads(p0.shape, 3)
    got, _ = run_mt(mt.optim.Adam, p0, grads, lr=1e-2)
    p, m, v = p0.copy(), 0.0, 0.0
    for g in grads:
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - 1e-2 * m / (np.sqrt(v) + 1e-8)
    assert not np.allclose(got, p, rtol=1e-6)


def test_large_parameter_uses_the_threaded_path():
    # more elements than the kernel's single-thread threshold
    p0 = np.random.default_rng(4).standard_normal(70_001)
    grads = make_grads(p0.shape, 3)
    for opt_cls, ref, kwargs in (CASES[4], CASES[6], CASES[8]):
        got, _ = run_mt(opt_cls, p0, grads, **kwargs)
        np.testing.assert_allclose(got, ref(p0, grads, **kwargs), rtol=1e-12, atol=1e-14)


def test_step_is_in_place_and_skips_parameters_without_grad():
    a = mt.Parameter(np.ones((3, 2)))
    b = mt.Parameter(np.ones(4))
    data_a, data_b = a.numpy(), b.numpy()
    opt = mt.optim.AdamW([a, b], lr=0.1)
    a.grad = mt.ones(3, 2, dtype=mt.float64)
    opt.step()
    assert a.numpy() is data_a and b.numpy() is data_b
    assert a.is_leaf and a.requires_grad
    assert not np.allclose(data_a, 1.0)
    np.testing.assert_array_equal(data_b, 1.0)
    assert b not in opt.state and opt.state[a]["step"] == 1


def test_non_contiguous_parameter_is_updated_in_place():
    base = np.random.default_rng(5).standard_normal((4, 6))
    p0 = base.T.copy()
    p = mt.Parameter(base.T)                   # a transposed view: not C-contiguous
    grads = make_grads((6, 4), 3)
    opt = mt.optim.Adam([p], lr=0.05, weight_decay=0.1)
    for g in grads:
        p.grad = mt.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(base.T, ref_adam(p0, grads, lr=0.05, weight_decay=0.1),
                               rtol=1e-12)


def test_param_groups_have_their_own_options():
    rng = np.random.default_rng(6)
    w0, b0 = rng.standard_normal((4, 3)), rng.standard_normal(4)
    gw, gb = make_grads(w0.shape, 5, seed=1), make_grads(b0.shape, 5, seed=2)
    w, b = mt.Parameter(w0.copy()), mt.Parameter(b0.copy())
    opt = mt.optim.AdamW([{"params": [w], "weight_decay": 0.1},
                          {"params": [b], "weight_decay": 0.0, "lr": 0.02}], lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    for g1, g2 in zip(gw, gb):
        w.grad, b.grad = mt.from_numpy(g1), mt.from_numpy(g2)
        opt.step()
    np.testing.assert_allclose(w.numpy(), ref_adam(w0, gw, lr=0.01, weight_decay=0.1, decoupled=True), rtol=1e-12)
    np.testing.assert_allclose(b.numpy(), ref_adam(b0, gb, lr=0.02, weight_decay=0.0, decoupled=True), rtol=1e-12)


def test_sgd_param_groups_and_add_param_group():
    a, b = mt.Parameter(np.ones(3)), mt.Parameter(np.ones(3))
    opt = mt.optim.SGD([a], lr=0.1, momentum=0.5)
    opt.add_param_group({"params": b, "lr": 1.0, "nesterov": True})
    assert opt.param_groups[1]["momentum"] == 0.5
    ga, gb = make_grads((3,), 3, seed=3), make_grads((3,), 3, seed=4)
    for x, y in zip(ga, gb):
        a.grad, b.grad = mt.from_numpy(x), mt.from_numpy(y)
        opt.step()
    np.testing.assert_allclose(a.numpy(), ref_sgd(np.ones(3), ga, lr=0.1, momentum=0.5), rtol=1e-12)
    np.testing.assert_allclose(b.numpy(), ref_sgd(np.ones(3), gb, lr=1.0, momentum=0.5, nesterov=True), rtol=1e-12)


def test_zero_grad():
    p = mt.Parameter(np.ones(3))
    opt = mt.optim.SGD([p], lr=0.1)
    p.grad = mt.ones(3, dtype=mt.float64)
    opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(p.grad.numpy(), 0.0)
    opt.zero_grad()
    assert p.grad is None


def test_closure_returns_loss():
    p = mt.Parameter(np.array([3.0]))
    opt = mt.optim.SGD([p], lr=0.25)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss) == 9.0
    np.testing.assert_allclose(p.numpy(), [3.0 - 0.25 * 6.0])


def test_bad_arguments():
    p = mt.Parameter(np.ones(2))
    with pytest.raises(TypeError, match="iterable"):
        mt.optim.SGD(p, lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        mt.optim.Adam([])
    with pytest.raises(ValueError, match="learning rate"):
        mt.optim.Adam([p], lr=-1)
    with pytest.raises(ValueError, match="beta"):
        mt.optim.AdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Nesterov"):
        mt.optim.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        mt.optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)
    with pytest.raises(ValueError, match="non-leaf"):
        mt.optim.SGD([p * 2], lr=0.1)
    with pytest.raises(TypeError, match="Tensors"):
        mt.optim.SGD([np.ones(2)], lr=0.1)


def test_module_double_after_optimizer_creation():
    layer = nn.Linear(3, 2)
    opt = mt.optim.Adam(layer.parameters(), lr=0.1)
    x = mt.randn(4, 3)
    layer(x).sum().backward()
    opt.step()
    layer.double()
    opt.zero_grad()
    layer(x.double()).sum().backward()
    opt.step()        # the float32 state is recast to the float64 parameters
    for p in layer.parameters():
        assert p.dtype == mt.float64
        assert opt.state[p]["exp_avg"].dtype == mt.float64


# -- state dicts --------------------------------------------------------------------

def _train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = mt.from_numpy(g.copy())
        opt.step()


@pytest.mark.parametrize("make", [
    lambda ps: mt.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: mt.optim.Adam([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.03}], lr=0.01,
                             weight_decay=0.01),
    lambda ps: mt.optim.AdamW(ps, lr=0.01, amsgrad=True),
])
def test_state_dict_round_trip_through_a_checkpoint(make, tmp_path):
    rng = np.random.default_rng(7)
    shapes = [(3, 4), (4,)]
    params = [mt.Parameter(rng.standard_normal(s)) for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(6)]
    opt = make(params)
    _train(opt, params, grads[:3])

    arrays, meta = mt.optim.flatten_state_dict(opt.state_dict())
    weights = {f"p{i}": p for i, p in enumerate(params)}
    mt.save({**weights, **arrays}, tmp_path / "ckpt.safetensors", metadata={"optimizer": meta})
    _train(opt, params, grads[3:])

    tensors, metadata = mt.load(tmp_path / "ckpt.safetensors", with_metadata=True)
    resumed = [mt.Parameter(tensors[f"p{i}"].numpy().copy()) for i in range(len(shapes))]
    opt2 = make(resumed)
    opt2.load_state_dict(mt.optim.unflatten_state_dict(tensors, metadata["optimizer"]))
    assert opt2.param_groups[0].keys() == opt.param_groups[0].keys()
    _train(opt2, resumed, grads[3:])
    for a, b in zip(params, resumed):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_state_dict_layout_and_load_errors():
    a, b = mt.Parameter(np.ones(2)), mt.Parameter(np.ones(3))
    opt = mt.optim.Adam([{"params": [a]}, {"params": [b]}])
    a.grad = mt.ones(2, dtype=mt.float64)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == [0] and sd["param_groups"][1]["params"] == [1]
    assert set(sd["state"]) == {0} and sd["state"][0]["step"] == 1
    # load_state_dict copies: the loaded optimizer does not share buffers
    opt2 = mt.optim.Adam([{"params": [mt.Parameter(np.ones(2))]}, {"params": [mt.Parameter(np.ones(3))]}])
    opt2.load_state_dict(sd)
    (state2,) = opt2.state.values()
    assert not np.shares_memory(state2["exp_avg"].numpy(), opt.state[a]["exp_avg"].numpy())
    with pytest.raises(ValueError, match="parameter groups"):
        mt.optim.Adam([a, b]).load_state_dict(sd)
    with pytest.raises(ValueError, match="group has 2"):
        mt.optim.Adam([{"params": [a, b]}, {"params": [mt.Parameter(np.ones(1))]}]).load_state_dict(sd)
    with pytest.raises(ValueError, match="not a flattened optimizer state"):
        mt.optim.unflatten_state_dict({}, json.dumps({"format": "microtensor.optimizer/1"}))


# -- schedulers -----------------------------------------------------------------------

def _two_group_opt():
    return mt.optim.SGD([{"params": [mt.Parameter(np.ones(1))], "lr": 0.1},
                         {"params": [mt.Parameter(np.ones(1))], "lr": 0.5}], lr=0.1)


def test_lambda_lr_values():
    opt = _two_group_opt()
    sched = lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    assert sched.get_last_lr() == [0.1, 0.5]
    for epoch in range(1, 6):
        opt.step()
        sched.step()
        assert sched.get_last_lr() == [0.1 * 0.9 ** epoch, 0.5 * 0.9 ** epoch]
        assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr()


def test_cosine_matches_closed_form_over_a_period():
    opt = _two_group_opt()
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    for t in range(1, 21):
        sched.step()
        for base, lr in zip((0.1, 0.5), sched.get_last_lr()):
            expected = 0.01 + (base - 0.01) * (1 + math.cos(math.pi * t / 10)) / 2
            assert lr == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_scheduler_state_dict_round_trip():
    opt = _two_group_opt()
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=0.001)
    for _ in range(4):
        sched.step()
    saved_sched = json.loads(json.dumps(sched.state_dict()))
    arrays, meta = mt.optim.flatten_state_dict(opt.state_dict())
    opt2 = _two_group_opt()
    opt2.load_state_dict(mt.optim.unflatten_state_dict(arrays, meta))
    sched2 = lr_scheduler.CosineAnnealingLR(opt2, T_max=7, eta_min=0.001)
    sched2.load_state_dict(saved_sched)
    for _ in range(5):
        sched.step()
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()


# -- against torch.optim ------------------------------------------------------------

TORCH_CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("name, kwargs", TORCH_CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_against_torch(name, kwargs, dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    p0 = [rng.standard_normal((5, 3)).astype(dtype), rng.standard_normal(3).astype(dtype)]
    ours = [mt.Parameter(p.copy()) for p in p0]
    theirs = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    opt = getattr(mt.optim, name)([{"params": ours[:1]}, {"params": ours[1:], "lr": 0.03}], **kwargs)
    topt = getattr(torch.optim, name)([{"params": theirs[:1]}, {"params": theirs[1:], "lr": 0.03}], **kwargs)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = rng.standard_normal(a.shape).astype(dtype)
            a.grad = mt.from_numpy(g.copy())
            b.grad = torch.from_numpy(g.copy())
        opt.step()
        topt.step()
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-7)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.detach().numpy(), **tol)


@pytest.mark.parametrize("kind", ["lambda", "cosine"])
def test_schedulers_against_torch(kind):
    torch = pytest.importorskip("torch")
    opt = _two_group_opt()
    topt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.5}], lr=0.1)
    if kind == "lambda":
        warmup = lambda e: min(1.0, (e + 1) / 5) * 0.97 ** e    # noqa: E731
        sched = lr_scheduler.LambdaLR(opt, warmup)
        tsched = torch.optim.lr_scheduler.LambdaLR(topt, warmup)
    else:
        sched = lr_scheduler.CosineAnnealingLR(opt, T_max=8, eta_min=0.003)
        tsched = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=8, eta_min=0.003)
    for _ in range(30):
        assert sched.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=1e-14, abs=1e-17)
        topt.step()
        sched.step()
        tsched.step()
