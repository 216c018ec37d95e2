"""maximize= of SGD, Adam and AdamW against torch 2.13: the same trajectories over several
steps, for each option that changes the update (momentum, dampening, nesterov,
weight_decay, amsgrad) and on each of the kernels' paths (a group's parameters in one
adam_step_many call, a strided parameter updated on a copy by adam_step, float32)."""
import itertools

import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 6


def _start(dtype, strided):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((5, 7)), rng.standard_normal(13), rng.standard_normal((3, 4))]
    params = [mt.tensor(a.astype(dtype), requires_grad=True) for a in arrays]
    if strided:        # stored transposed: a parameter the kernels cannot take flat
        t = mt.tensor(np.ascontiguousarray(arrays[0].T).astype(dtype)).t()
        assert not t._data.flags.c_contiguous
        params[0] = t.detach().requires_grad_()
    tparams = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
    return params, tparams


def _grads(step, shapes, dtype):
    """The same gradients for both, different at every step (their signs change too)."""
    rng = np.random.default_rng(100 + step)
    return [(rng.standard_normal(s) * (1 + step)).astype(dtype) for s in shapes]


def _run(make_ours, make_theirs, dtype=np.float64, strided=False):
    params, tparams = _start(dtype, strided)
    opt, topt = make_ours(params), make_theirs(tparams)
    for step in range(STEPS):
        grads = _grads(step, [tuple(p.shape) for p in params], dtype)
        for p, tp, g in zip(params, tparams, grads):
            p.grad = mt.tensor(g)
            tp.grad = torch.tensor(g)
        opt.step()
        topt.step()
        for p, g in zip(params, grads):
            np.testing.assert_array_equal(p.grad.numpy(), g)     # the gradient is not negated
        for i, (p, tp) in enumerate(zip(params, tparams)):
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(p.detach().numpy(), tp.detach().numpy(),
                                       err_msg=f"step {step}, parameter {i}", **tol)
    return params


SGD_OPTIONS = [dict(momentum=m, dampening=d, nesterov=n, weight_decay=w)
               for m, d, n, w in itertools.product([0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.1])
               if not (n and (m == 0 or d != 0))]


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_maximize_matches_torch(options, maximize):
    _run(lambda ps: mt.optim.SGD(ps, lr=0.05, maximize=maximize, **options),
         lambda ps: torch.optim.SGD(ps, lr=0.05, maximize=maximize, **options))


ADAM_OPTIONS = [dict(weight_decay=w, amsgrad=a) for w in (0.0, 0.1) for a in (False, True)]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("path", ["together", "strided", "float32"])
def test_adam_maximize_matches_torch(name, maximize, options, path):
    dtype = np.float32 if path == "float32" else np.float64
    _run(lambda ps: getattr(mt.optim, name)(ps, lr=0.02, betas=(0.8, 0.95), maximize=maximize, **options),
         lambda ps: getattr(torch.optim, name)(ps, lr=0.02, betas=(0.8, 0.95), maximize=maximize, **options),
         dtype=dtype, strided=path == "strided")


@pytest.mark.parametrize("path", ["strided", "float32"])
def test_sgd_maximize_on_each_path(path):
    options = dict(momentum=0.9, nesterov=True, weight_decay=0.1)
    _run(lambda ps: mt.optim.SGD(ps, lr=0.05, maximize=True, **options),
         lambda ps: torch.optim.SGD(ps, lr=0.05, maximize=True, **options),
         dtype=np.float32 if path == "float32" else np.float64, strided=path == "strided")


def test_maximize_climbs_and_is_a_keyword_as_in_torch():
    for make in (lambda ps: mt.optim.SGD(ps, lr=0.1, maximize=True),
                 lambda ps: mt.optim.Adam(ps, lr=0.1, maximize=True),
                 lambda ps: mt.optim.AdamW(ps, lr=0.1, maximize=True)):
        x = mt.tensor([0.3, -0.2], requires_grad=True)
        opt = make([x])
        for _ in range(20):
            opt.zero_grad()
            (-(x * x).sum()).backward()          # maximum at 0
            opt.step()
        assert np.abs(x.numpy()).max() < 0.3
        assert opt.param_groups[0]["maximize"] is True
    with pytest.raises(TypeError):
        mt.optim.SGD([mt.zeros(1, requires_grad=True)], 0.1, 0, 0, 0, False, True)


def test_maximize_round_trips_through_a_state_dict_and_old_ones_load():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    opt = mt.optim.Adam([x], maximize=True)
    state = opt.state_dict()
    assert state["param_groups"][0]["maximize"] is True
    fresh = mt.optim.Adam([x])
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["maximize"] is True
    # a checkpoint from before maximize existed: the step runs as minimize
    old = opt.state_dict()
    old["param_groups"] = [{k: v for k, v in g.items() if k != "maximize"}
                           for g in old["param_groups"]]
    fresh.load_state_dict(old)
    x.grad = mt.tensor([1.0, 1.0])
    before = x.numpy().copy()
    fresh.step()
    assert (x.numpy() < before).all()
