"""Indexing against PyTorch on random keys: ints, slices (stops past the end, starts
before the beginning, steps over 1), index arrays and whole dims mixed in every order.
Values, the gradient (a random upstream) and index assignment must equal PyTorch's."""
import numpy as np
import pytest

import microtensor as mt

SHAPE = (2, 5, 6, 5, 3, 4)


def random_key(rng):
    """One key: a part per leading dim, at most two index arrays (of one length)."""
    parts, arrays = [], 0
    length = int(rng.integers(1, 4))
    for size in SHAPE[:int(rng.integers(1, len(SHAPE) + 1))]:
        kind = rng.choice(["int", "slice", "slice", "array", "all"])
        if kind == "int":
            parts.append(int(rng.integers(-size, size)))
        elif kind == "slice":
            start = None if rng.random() < 0.2 else int(rng.integers(-size - 3, size + 3))
            stop = None if rng.random() < 0.2 else int(rng.integers(-size - 3, size + 6))
            parts.append(slice(start, stop, int(rng.choice([1, 1, 2, 3]))))
        elif kind == "array" and arrays < 2:
            arrays += 1
            parts.append(rng.integers(-size, size, size=length))
        else:
            parts.append(slice(None))
    return tuple(parts)


def as_torch_key(key, torch):
    return tuple(torch.tensor(k) if isinstance(k, np.ndarray) else k for k in key)


def as_mt_key(key):
    return tuple(mt.tensor(k) if isinstance(k, np.ndarray) else k for k in key)


@pytest.mark.parametrize("seed", range(6))
def test_random_keys_index_as_torch(seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(SHAPE)
    for _ in range(60):
        key = random_key(rng)
        x, tx = mt.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
        tout = tx[as_torch_key(key, torch)]
        out = x[as_mt_key(key)]
        assert out.shape == tuple(tout.shape), f"x[{key}]: {out.shape} vs torch {tuple(tout.shape)}"
        np.testing.assert_array_equal(out.numpy(), tout.detach().numpy(), err_msg=str(key))
        if out.numel() == 0:
            continue
        up = rng.standard_normal(out.shape)
        out.backward(mt.tensor(up))
        tout.backward(torch.tensor(up))
        np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-12, err_msg=str(key))


@pytest.mark.parametrize("seed", range(3))
def test_random_keys_assign_as_torch(seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(100 + seed)
    data = rng.standard_normal(SHAPE)
    for _ in range(60):
        key = random_key(rng)
        if any(isinstance(k, np.ndarray) and len(np.unique(k)) < len(k) for k in key):
            continue                       # repeated indices: which write wins is unspecified
        x, tx = mt.tensor(data), torch.tensor(data)
        shape = tuple(tx[as_torch_key(key, torch)].shape)
        value = rng.standard_normal(shape)
        x[as_mt_key(key)] = mt.tensor(value)
        tx[as_torch_key(key, torch)] = torch.tensor(value)
        np.testing.assert_array_equal(x.numpy(), tx.numpy(), err_msg=str(key))


def test_the_reported_key():
    """x[1, :, 3:11:2, d, 0:2]: a stop past the end beside an index array."""
    x = mt.tensor(np.arange(np.prod(SHAPE)).reshape(SHAPE))
    d = mt.tensor([0, 2])
    assert x[1, :, 3:11:2, d, 0:2].shape == (5, 2, 2, 2, 4)
