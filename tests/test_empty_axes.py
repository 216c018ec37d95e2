"""Ops on tensors with a size-0 axis, forward and backward, against torch.

The differential fuzzer found two such gaps at once: logsumexp over an empty dim returned
-inf outside the graph (no grad_fn, so a program's later gradients drew other random
weights), and matmul's backward reshaped with -1 next to a 0 (numpy refuses). Each case
here runs every placement of the empty axis."""
import itertools

import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")


def both(shape, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape)
    return mt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)


def check(ours, theirs, leaves):
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert ours.requires_grad == theirs.requires_grad
    np.testing.assert_array_equal(ours.detach().numpy(), theirs.detach().numpy())
    up = np.random.default_rng(1).standard_normal(tuple(ours.shape))
    ours.backward(mt.tensor(up))
    theirs.backward(torch.tensor(up))
    for mine, their in leaves:
        assert mine.grad is not None and tuple(mine.grad.shape) == tuple(their.grad.shape)
        np.testing.assert_allclose(mine.grad.numpy(), their.grad.numpy(), rtol=1e-12)


SHAPES = [(0,), (0, 3), (3, 0), (2, 0, 3), (0, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("keepdim", [False, True])
def test_logsumexp_over_every_dim_of_an_empty_tensor_stays_in_the_graph(shape, keepdim):
    for dim in list(range(-len(shape), len(shape))) + [tuple(range(len(shape)))]:
        a, t = both(shape)
        check(mt.logsumexp(a, dim, keepdim), torch.logsumexp(t, dim, keepdim), [(a, t)])


MATMUL = [((0, 3), (3, 4)), ((3, 0), (0, 4)), ((3, 4), (4, 0)), ((2, 3, 0), (0, 4)),
          ((2, 0, 3), (3, 4)), ((0, 3, 4), (4, 2)), ((2, 3, 4), (4, 0)), ((3, 3, 3), (3, 0)),
          ((2, 0, 3), (2, 3, 4)), ((2, 3, 0), (2, 0, 4)), ((0,), (0,)), ((0,), (0, 3)),
          ((3, 0), (0,)), ((2, 3, 0), (0,))]


def operand(shape, transposed, seed):
    """(mt leaf, torch leaf, mt operand, torch operand): the operand of `shape` a transposed
    view of its leaf when asked (stored the other way round, as a Linear's weight is)."""
    if not transposed or len(shape) < 2:
        a, t = both(shape, seed)
        return a, t, a, t
    a, t = both(shape[:-2] + (shape[-1], shape[-2]), seed)
    return a, t, a.transpose(-1, -2), t.transpose(-1, -2)


@pytest.mark.parametrize("shapes", MATMUL, ids=str)
@pytest.mark.parametrize("transposed", list(itertools.product([False, True], repeat=2)))
def test_matmul_with_a_size_zero_axis_forward_and_backward(shapes, transposed):
    a, ta, x, tx = operand(shapes[0], transposed[0], 0)
    b, tb, y, ty = operand(shapes[1], transposed[1], 2)
    check(x @ y, tx @ ty, [(a, ta), (b, tb)])
