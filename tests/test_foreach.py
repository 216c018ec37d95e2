"""microtensor.kernels._foreach: one call over a list of arrays (clip_grad_norm_'s sum of
squares over every gradient, and its scaling), checked against numpy element by element,
at sizes that divide neither the eight running sums, nor the blocks, nor the thread
count, and its guards one field at a time."""
import math

import numpy as np
import pytest

import microtensor as mt
from microtensor.kernels import _foreach

SIZES = [0, 1, 7, 8, 9, 16383, 16384, 16385, 40001]   # around 8 lanes and the 16384 block


def _arrays(rng, dtypes=(np.float32, np.float64), scale=1.0):
    out = []
    for i, n in enumerate(SIZES):
        dtype = dtypes[i % len(dtypes)]
        out.append((rng.standard_normal(n) * scale).astype(dtype).reshape(-1))
    out.append((rng.standard_normal((33, 17)) * scale).astype(dtypes[0]))   # 2-D
    return out


def _exact_sum_of_squares(arrays):
    return math.fsum(float(x) ** 2 for a in arrays for x in a.astype(np.float64).ravel())


@pytest.mark.parametrize("dtypes", [(np.float32,), (np.float64,), (np.float32, np.float64)])
@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e20])
def test_sum_of_squares_is_the_sum_over_every_array(dtypes, scale):
    rng = np.random.default_rng(0)
    arrays = _arrays(rng, dtypes, scale)
    got = _foreach.sum_of_squares(arrays, 2)
    want = _exact_sum_of_squares(arrays)
    # double accumulation of ~100k terms: a few ulps of double, far below float32's
    assert got == pytest.approx(want, rel=1e-12)


def test_sum_of_squares_has_the_same_bits_at_every_thread_count():
    rng = np.random.default_rng(1)
    arrays = _arrays(rng) + [rng.standard_normal(300_001).astype(np.float32)]
    first = _foreach.sum_of_squares(arrays, 1)
    for threads in (2, 3, 7, 0, -1):
        assert _foreach.sum_of_squares(arrays, threads) == first


def test_sum_of_squares_of_nothing_and_of_non_finite_values():
    assert _foreach.sum_of_squares([], 2) == 0.0
    assert _foreach.sum_of_squares([np.zeros(0, np.float32)], 2) == 0.0
    assert math.isnan(_foreach.sum_of_squares([np.ones(5), np.array([1.0, np.nan])], 2))
    assert _foreach.sum_of_squares([np.array([np.inf], np.float32)], 1) == math.inf


@pytest.mark.parametrize("scale", [0.5, 1 / 3, 0.1234567, 0.0, math.nan])
def test_mul_scales_in_place_with_numpys_rounding(scale):
    rng = np.random.default_rng(2)
    arrays = _arrays(rng)
    want = []
    for a in arrays:
        # numpy's product with a float64 scalar, cast back (clip's coefficient is float64
        # when any gradient is; a float32 one is exact in double, next test)
        with np.errstate(invalid="ignore"):
            want.append(np.multiply(a, np.float64(scale), out=a.copy(), casting="unsafe"))
    ids = [id(a) for a in arrays]
    _foreach.mul_(arrays, scale, 2)
    assert [id(a) for a in arrays] == ids
    for a, w in zip(arrays, want):
        np.testing.assert_array_equal(a, w)


def test_mul_with_a_float32_coefficient_on_float32_arrays_is_numpys_float32_product():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(50_001).astype(np.float32)
    coef = np.float32(1.0) / (np.float32(7.3) + np.float32(1e-6))
    want = a * coef
    _foreach.mul_([a], float(coef), 3)
    np.testing.assert_array_equal(a, want)


def _good():
    return [np.ones(10, np.float32), np.ones((3, 4))]


@pytest.mark.parametrize("kernel", ["sum_of_squares", "mul_"])
@pytest.mark.parametrize("bad, error, words", [
    ([1.0, 2.0], TypeError, "item 0 is a float"),
    (np.ones(3), TypeError, "list"),
    ([np.ones(3, np.float32), np.ones(3, np.int64)], TypeError, "item 1 has dtype int64"),
    ([np.ones(3, np.float16)], TypeError, "float16"),
    ([np.ones(3, np.complex64)], TypeError, "complex64"),
    ([np.ones((4, 4), np.float32)[:, ::2]], ValueError, "item 0 is not C-contiguous"),
    ([np.ones((4, 4), np.float32).T], ValueError, "not C-contiguous"),
])
def test_each_guard_names_the_item(kernel, bad, error, words):
    fn = getattr(_foreach, kernel)
    args = (1.0, 1) if kernel == "mul_" else (1,)
    fn(_good(), *args)                                   # the good call
    with pytest.raises(error, match=words):
        fn(bad, *args)


def test_mul_refuses_a_read_only_array_and_changes_nothing():
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    first = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="item 1 is read-only"):
        _foreach.mul_([first, ro], 2.0, 1)
    np.testing.assert_array_equal(first, 1.0)            # checked before anything is written
    assert _foreach.sum_of_squares([ro], 1) == 4.0       # reading it is fine


def test_clip_grad_norm_scales_every_kind_of_gradient_as_numpy_does():
    # contiguous float32 and float64 gradients go through the kernel; a strided one and
    # a read-only one through numpy: the same total and the same scaled values
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (16385,), (7,)]]
    grads.append(rng.standard_normal((6, 8)).astype(np.float32)[:, ::2])   # strided
    ro = rng.standard_normal(9).astype(np.float32)
    ro.flags.writeable = False
    grads.append(ro)
    params = []
    for g in grads:
        p = mt.zeros(*g.shape, requires_grad=True)
        p.grad = mt.from_numpy(g) if g.flags.writeable else mt.tensor(g)
        if not g.flags.writeable:
            p.grad._data = g                              # keep it read-only
        params.append(p)
    before = [np.array(p.grad._data) for p in params]
    total = math.sqrt(_exact_sum_of_squares(before))
    norm = mt.nn.utils.clip_grad_norm_(params, 0.5)
    assert float(norm) == pytest.approx(total, rel=1e-6)
    coef = np.float32(0.5) / (np.float32(total) + np.float32(1e-6))
    for p, b in zip(params, before):
        np.testing.assert_allclose(p.grad.numpy(), b * coef, rtol=2e-7)


# ---- optim/_adamw.pyx: adam_step_many, every parameter of a group in one call -----------

from microtensor.optim import _adamw    # noqa: E402

ADAM_SIZES = [0, 1, 7, 16383, 16384, 16385, 40001]      # around the kernel's 2^14 block


def _adam_lists(rng, dtype):
    n = len(ADAM_SIZES)
    make = lambda scale, positive=False: [
        (np.abs(rng.standard_normal(s)) if positive else rng.standard_normal(s)).astype(dtype) * scale
        for s in ADAM_SIZES]
    return dict(params=make(1.0), grads=make(1.0), exp_avgs=make(0.1),
                exp_avg_sqs=make(0.1, True), max_exp_avg_sqs=make(0.2, True),
                steps=np.arange(1, n + 1, dtype=np.float64) * 3)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_step_many_is_adam_step_on_each_parameter(dtype, decoupled, amsgrad, threads):
    # the same update, bit for bit, as one adam_step per parameter (each its own step
    # count), whatever the team
    lists = _adam_lists(np.random.default_rng(5), dtype)
    want = {k: [a.copy() for a in v] for k, v in lists.items() if k not in ("grads", "steps")}
    for i, n in enumerate(ADAM_SIZES):
        if n:
            _adamw.adam_step(want["params"][i], lists["grads"][i], want["exp_avgs"][i],
                             want["exp_avg_sqs"][i], want["max_exp_avg_sqs"][i], 1e-2, 0.9,
                             0.99, 1e-8, 0.1, lists["steps"][i], decoupled, amsgrad, 1)
    _adamw.adam_step_many(lists["params"], lists["grads"], lists["exp_avgs"],
                          lists["exp_avg_sqs"], lists["max_exp_avg_sqs"], lists["steps"],
                          1e-2, 0.9, 0.99, 1e-8, 0.1, decoupled, amsgrad, threads)
    for key, arrays in want.items():
        if key == "max_exp_avg_sqs" and not amsgrad:
            continue
        for i, (w, g) in enumerate(zip(arrays, lists[key])):
            np.testing.assert_array_equal(g, w, err_msg=f"{key}[{i}]")


def _bad(lists, field, how):
    a = lists[field][2]
    if how == "not_array":
        lists[field][2] = list(a)
    elif how == "dtype":
        lists[field][2] = a.astype(np.float64)
    elif how == "int":
        lists[field][2] = a.astype(np.int64)
    elif how == "two_d":
        lists[field][2] = a.reshape(7, 1)
    elif how == "strided":
        lists[field][2] = np.repeat(a, 2)[::2]
    elif how == "short":
        lists[field][2] = a[:-1]
    elif how == "read_only":
        a.flags.writeable = False


@pytest.mark.parametrize("field", ["params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"])
@pytest.mark.parametrize("how", ["not_array", "dtype", "int", "two_d", "strided", "short", "read_only"])
def test_adam_step_many_checks_every_array_before_it_writes(field, how):
    rng = np.random.default_rng(6)
    lists = _adam_lists(rng, np.float32)
    lists = {k: v[:4] for k, v in lists.items()}        # sizes 0, 1, 7, 16383
    call = lambda L: _adamw.adam_step_many(L["params"], L["grads"], L["exp_avgs"], L["exp_avg_sqs"],
                                           L["max_exp_avg_sqs"], L["steps"], 1e-2, 0.9, 0.99,
                                           1e-8, 0.1, True, True, 2)
    before = {k: [a.copy() for a in v] for k, v in lists.items() if k != "steps"}
    _bad(lists, field, how)
    if how == "read_only" and field == "grads":
        call(lists)                                      # a gradient is only read
        return
    words = {"params": "parameter", "grads": "gradient", "exp_avgs": "exp_avg",
             "exp_avg_sqs": "exp_avg_sq", "max_exp_avg_sqs": "max_exp_avg_sq"}[field] + " 2 "
    if how == "short" and field == "params":
        # a parameter's size is the one the others must have: its gradient is named
        words = "gradient 2 has 7 elements, but its parameter has 6"
    with pytest.raises((TypeError, ValueError), match=words):
        call(lists)
    for key, arrays in before.items():                   # nothing moved
        for i, (b, a) in enumerate(zip(arrays, lists[key])):
            if i != 2:
                np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{key}[{i}]")


def test_adam_step_many_checks_the_lists_lengths():
    lists = _adam_lists(np.random.default_rng(7), np.float64)
    args = (1e-2, 0.9, 0.99, 1e-8, 0.1, True, True, 1)
    with pytest.raises(ValueError, match="7 parameters, but 6 gradients"):
        _adamw.adam_step_many(lists["params"], lists["grads"][:-1], lists["exp_avgs"],
                              lists["exp_avg_sqs"], lists["max_exp_avg_sqs"], lists["steps"], *args)
    with pytest.raises(ValueError, match="6 steps"):
        _adamw.adam_step_many(lists["params"], lists["grads"], lists["exp_avgs"],
                              lists["exp_avg_sqs"], lists["max_exp_avg_sqs"], lists["steps"][:-1], *args)
    with pytest.raises(ValueError, match="5 max_exp_avg_sq"):
        _adamw.adam_step_many(lists["params"], lists["grads"], lists["exp_avgs"],
                              lists["exp_avg_sqs"], lists["max_exp_avg_sqs"][:5], lists["steps"], *args)


def test_adamw_step_failing_on_one_parameter_moves_none_and_counts_no_step():
    # one kernel call per group: a state buffer damaged for the third parameter stops the
    # step before any parameter moves, and the step counts stay as they were
    ps = [mt.tensor(np.random.default_rng(8).standard_normal(n).astype(np.float32),
                    requires_grad=True) for n in (3, 5, 7)]
    for p in ps:
        p.grad = mt.ones(*p.shape)
    opt = mt.optim.AdamW(ps, lr=0.1)
    opt.step()
    before = [p.numpy().copy() for p in ps]
    opt.state[ps[2]]["exp_avg"] = mt.zeros(6)
    with pytest.raises(Exception, match="exp_avg"):
        opt.step()
    for p, b in zip(ps, before):
        np.testing.assert_array_equal(p.numpy(), b)
    assert [opt.state[p]["step"] for p in ps] == [1, 1, 1]
