"""Gradients of slices of one tensor: the engine keeps the slices' gradients until the
tensor's own gradient is complete and then builds it once (the q, k, v of one
projection: no zero fill when the slices tile it, a plain copy where they do not
overlap, an addition where they do). Checked against numpy for every way slices can
meet: tiling, overlapping, leaving gaps, mixed with a dense gradient, keys that are not
plain slices; on a leaf and on an op's result; with a hook on the result."""
import itertools

import numpy as np
import pytest

import microtensor as mt

RNG = np.random.default_rng(0)


def _dirty_heap(shape):
    """Freed memory full of non-zero values, where an uninitialised buffer of `shape`
    would be carved from: a gap left unfilled then shows up."""
    junk = [np.full(shape, 7.5) for _ in range(4)]
    del junk


# each case: x's shape, then the pieces taken from x: (key, weight); the loss is
# sum(weight * x[key]) over the pieces, so dx = sum of the weights placed at their keys
CASES = {
    "tiling_three_ways": ((4, 5, 9), [(np.s_[:, :, 0:3], 1), (np.s_[:, :, 3:6], 2),
                                      (np.s_[:, :, 6:9], 3)]),
    "tiling_out_of_order": ((6, 4), [(np.s_[4:], 1), (np.s_[:2], 2), (np.s_[2:4], 3)]),
    "overlapping": ((5, 6), [(np.s_[:, :4], 1), (np.s_[:, 2:], 2)]),
    "same_slice_twice": ((5, 6), [(np.s_[1:3], 1), (np.s_[1:3], 2)]),
    "gaps": ((7, 3), [(np.s_[:2], 1), (np.s_[4:6], 2)]),
    "tiling_in_two_dims": ((4, 4), [(np.s_[:2, :2], 1), (np.s_[:2, 2:], 2),
                                    (np.s_[2:, :], 3)]),
    "strided_and_plain": ((8, 3), [(np.s_[::2], 1), (np.s_[1::2], 2)]),
    "integer_and_slice": ((4, 3), [(np.s_[1], 1), (np.s_[1:], 2), (np.s_[:1], 3)]),
    "negative_bounds": ((6, 2), [(np.s_[-2:], 1), (np.s_[:-2], 2)]),
    "ellipsis": ((3, 4, 5), [(np.s_[..., :2], 1), (np.s_[..., 2:], 2)]),
    "empty_piece": ((4, 3), [(np.s_[:4], 1), (np.s_[4:], 2)]),
}


def _expected(shape, pieces, dense_weight=0.0):
    want = np.full(shape, dense_weight)
    for key, weight in pieces:
        want[key] += weight
    return want


def _orders(pieces):
    """Every order of the pieces: the engine's order of arrival follows the order the ops
    were made in, and an overlap must add whichever piece arrives first."""
    return [list(p) for p in itertools.permutations(pieces)]


@pytest.mark.parametrize("dense", [False, True], ids=["slices_only", "with_a_dense_gradient"])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "op_result"])
@pytest.mark.parametrize("name, order", [(n, i) for n in CASES
                                          for i in range(len(_orders(CASES[n][1])))])
def test_slice_gradients_sum_to_numpys(name, order, leaf, dense):
    shape, pieces = CASES[name]
    pieces = _orders(pieces)[order]
    x = mt.tensor(RNG.standard_normal(shape), requires_grad=True)
    base = x if leaf else x * 1.0                         # an op's result: a node, not a leaf
    seen = []
    if not leaf:
        base.register_hook(lambda g: seen.append(g.numpy().copy()))
    loss = None
    for key, weight in pieces:
        term = (base[key] * weight).sum()
        loss = term if loss is None else loss + term
    if dense:
        loss = loss + (base * 0.5).sum()
    _dirty_heap(shape)
    loss.backward()
    want = _expected(shape, pieces, 0.5 if dense else 0.0)
    np.testing.assert_array_equal(x.grad.numpy(), want)
    if not leaf:
        np.testing.assert_array_equal(seen[0], want)      # the hook saw the whole gradient


def test_the_gpt_head_split_gives_the_projections_gradient():
    # qkv (B, T, 3C) from a linear, split in three, each part viewed as heads: the
    # projection's gradient is the three parts' gradients side by side
    B, T, C = 2, 5, 6
    x = mt.tensor(RNG.standard_normal((B, T, C)), requires_grad=True)
    w = mt.tensor(RNG.standard_normal((3 * C, C)), requires_grad=True)
    qkv = mt.nn.functional.linear(x, w)
    ups = [RNG.standard_normal((B, 2, T, C // 2)) for _ in range(3)]
    parts = qkv.split(C, dim=2)
    loss = sum(((p.view(B, T, 2, C // 2).transpose(1, 2)) * mt.tensor(u)).sum()
               for p, u in zip(parts, ups))
    _dirty_heap((B, T, 3 * C))
    loss.backward()
    g = np.concatenate([u.transpose(0, 2, 1, 3).reshape(B, T, C) for u in ups], axis=2)
    np.testing.assert_allclose(w.grad.numpy(), g.reshape(-1, 3 * C).T @ x.numpy().reshape(-1, C),
                               rtol=1e-12)
