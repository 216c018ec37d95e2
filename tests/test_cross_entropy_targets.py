"""F.cross_entropy's targets beyond class indices, against torch: probability ("soft")
targets of the input's shape, class weights, label smoothing, every reduction, the
gradients of input and target (float64, with a random upstream gradient), and torch's
exception classes and words for targets of the wrong shape or dtype."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def _probs(rng, shape, dim):
    p = rng.random(shape) + 0.05
    return p / p.sum(dim, keepdims=True)


def _check(x, t, rng, index_target=False, **kw):
    """Value and gradients (input, and a float target) of mt against torch."""
    xm = mt.tensor(x, requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    if index_target:
        tm, tt = mt.tensor(t), torch.tensor(t)
    else:
        tm, tt = mt.tensor(t, requires_grad=True), torch.tensor(t, requires_grad=True)
    kw_t = {k: torch.tensor(v.numpy()) if isinstance(v, mt.Tensor) else v for k, v in kw.items()}
    lm, lt = F.cross_entropy(xm, tm, **kw), TF.cross_entropy(xt, tt, **kw_t)
    np.testing.assert_allclose(lm.detach().numpy(), lt.detach().numpy(), rtol=1e-10, atol=1e-12)
    up = rng.standard_normal(tuple(lt.shape))
    lm.backward(mt.tensor(up))
    lt.backward(torch.tensor(up))
    np.testing.assert_allclose(xm.grad.numpy(), xt.grad.numpy(), rtol=1e-9, atol=1e-12)
    if not index_target:
        np.testing.assert_allclose(tm.grad.numpy(), tt.grad.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(5,), (4, 5), (3, 5, 2), (2, 4, 3, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_probability_targets_match_torch(shape, reduction, smoothing, weighted):
    rng = np.random.default_rng(len(shape) * 7 + int(weighted))
    dim = 1 if len(shape) >= 2 else 0
    x = rng.standard_normal(shape) * 3
    t = _probs(rng, shape, dim)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    if weighted:
        kw["weight"] = mt.tensor(rng.random(shape[dim]) + 0.5)
    _check(x, t, rng, **kw)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_class_weights_with_index_targets_match_torch(shape, reduction, smoothing):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    t = rng.integers(0, shape[1], (shape[0],) + shape[2:])
    t.reshape(-1)[1] = -100                               # one ignored target
    w = mt.tensor(rng.random(shape[1]) + 0.5)
    _check(x, t, rng, index_target=True, weight=w, reduction=reduction,
           label_smoothing=smoothing)


def test_cross_entropy_loss_module_takes_weight():
    rng = np.random.default_rng(4)
    w = rng.random(5) + 0.5
    x, t = rng.standard_normal((3, 5)), _probs(rng, (3, 5), 1)
    ours = mt.nn.CrossEntropyLoss(weight=mt.tensor(w), label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=torch.tensor(w), label_smoothing=0.1)
    np.testing.assert_allclose(ours(mt.tensor(x), mt.tensor(t)).item(),
                               theirs(torch.tensor(x), torch.tensor(t)).item(), rtol=1e-12)
    assert "weight" in ours.state_dict()


def test_probability_targets_are_twice_differentiable():
    rng = np.random.default_rng(5)
    x = mt.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    t = mt.tensor(_probs(rng, (3, 4), 1), requires_grad=True)
    w = mt.tensor(rng.random(4) + 0.5)
    assert mt.gradgradcheck(lambda a, b: F.cross_entropy(a, b, weight=w, label_smoothing=0.1),
                            [x, t])


BAD_TARGETS = {
    "float target of index shape": lambda lib: lib.zeros(4),
    "long target of the input's shape": lambda lib: lib.zeros(4, 5, dtype=lib.int64),
    "float target of another shape": lambda lib: lib.rand(4, 6),
    "batch size differs": lambda lib: lib.zeros(3, dtype=lib.int64),
    "a trailing dim": lambda lib: lib.zeros(4, 1, dtype=lib.int64),
    "bool target": lambda lib: lib.zeros(4, dtype=lib.bool),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_bad_targets_raise_torchs_exception(case):
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    with pytest.raises(Exception) as theirs:
        TF.cross_entropy(torch.tensor(x), BAD_TARGETS[case](torch))
    with pytest.raises(type(theirs.value)) as ours:
        F.cross_entropy(mt.tensor(x), BAD_TARGETS[case](mt))
    words = str(theirs.value).split(" (")[0].rstrip(".")
    if case not in ("float target of another shape", "a trailing dim"):
        assert str(ours.value).startswith(words), (str(ours.value), words)


def test_ignore_index_with_probability_targets_is_refused_as_torch():
    x, t = np.zeros((2, 3)), np.full((2, 3), 1 / 3)
    with pytest.raises(RuntimeError, match="ignore_index is not supported for floating point"):
        TF.cross_entropy(torch.tensor(x), torch.tensor(t), ignore_index=1)
    with pytest.raises(RuntimeError, match="ignore_index is not supported for floating point"):
        F.cross_entropy(mt.tensor(x), mt.tensor(t), ignore_index=1)
