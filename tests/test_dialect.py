"""PyTorch's dialect beyond the core: every added name against torch (values, dtypes,
gradients with a random upstream gradient) and a float64 gradcheck where it is
differentiable; modules, schedulers, switches; the device/dtype dialect a torch script
types (`device='cpu'`, `mt.float32`, `mt.cuda.is_available()`)."""
import math
import warnings

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn as nn
import microtensor.nn.functional as F
from microtensor.core import dialect
from microtensor.ops import extra as ops_extra
from microtensor.ops import index as ops_index
from microtensor.ops import linalg as ops_linalg

torch = pytest.importorskip("torch")

rng = np.random.default_rng(0)


pytestmark = pytest.mark.usefixtures("one_thread")   # tiny shapes (tests/conftest.py)


def normal(shape):
    return rng.standard_normal(shape)


def positive(shape):
    return rng.uniform(0.5, 2.0, shape)


def unit(shape):
    return rng.uniform(-0.9, 0.9, shape)


def prob(shape):
    return rng.uniform(0.05, 0.95, shape)


def distinct(shape):
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.37 - n * 0.15).reshape(shape)


def away(shape):
    """At least 0.1 from 0 and from integers + 0.5 (the kinks of sign, round, abs)."""
    x = rng.uniform(0.1, 0.4, shape) + rng.integers(-2, 3, shape)
    return x * rng.choice([-1.0, 1.0], shape)


IDX = np.array([[0, 2, 1, 0], [2, 2, 0, 1]])
W4 = np.array([0.5, 1.0, 2.0, 1.5])
SPECIAL = np.array([math.nan, 0.0, math.inf, -math.inf])      # where SPECIAL_AT: non-finite
SPECIAL_AT = np.array([True, False, True, True])

# name -> (microtensor fn, torch fn, input makers); inputs are float64 and get gradients
CASES = {
    "sin": (mt.sin, torch.sin, [(normal, (3, 4))]),
    "cos": (lambda x: x.cos(), torch.cos, [(normal, (3, 4))]),
    "tan": (mt.tan, torch.tan, [(unit, (3, 4))]),
    "asin": (mt.asin, torch.asin, [(unit, (5,))]),
    "acos": (mt.acos, torch.acos, [(unit, (5,))]),
    "atan": (mt.atan, torch.atan, [(normal, (5,))]),
    "sinh": (mt.sinh, torch.sinh, [(normal, (5,))]),
    "cosh": (mt.cosh, torch.cosh, [(normal, (5,))]),
    "asinh": (mt.asinh, torch.asinh, [(normal, (5,))]),
    "atanh": (mt.atanh, torch.atanh, [(unit, (5,))]),
    "log1p": (mt.log1p, torch.log1p, [(positive, (3, 4))]),
    "expm1": (lambda x: x.expm1(), torch.expm1, [(normal, (3, 4))]),
    "exp2": (mt.exp2, torch.exp2, [(normal, (3, 4))]),
    "log2": (mt.log2, torch.log2, [(positive, (3, 4))]),
    "log10": (lambda x: x.log10(), torch.log10, [(positive, (3, 4))]),
    "rsqrt": (mt.rsqrt, torch.rsqrt, [(positive, (3, 4))]),
    "reciprocal": (lambda x: x.reciprocal(), torch.reciprocal, [(positive, (3, 4))]),
    "square": (mt.square, torch.square, [(normal, (3, 4))]),
    "erf": (mt.erf, torch.erf, [(normal, (3, 4))]),
    "erfc": (mt.erfc, torch.erfc, [(normal, (3, 4))]),
    "erfinv": (mt.erfinv, torch.erfinv, [(unit, (3, 4))]),
    "logit": (mt.logit, torch.logit, [(prob, (3, 4))]),
    "frac": (mt.frac, torch.frac, [(away, (3, 4))]),
    "sign": (mt.sign, torch.sign, [(away, (3, 4))]),
    "floor": (mt.floor, torch.floor, [(away, (3, 4))]),
    "ceil": (lambda x: x.ceil(), torch.ceil, [(away, (3, 4))]),
    "trunc": (mt.trunc, torch.trunc, [(away, (3, 4))]),
    "round": (mt.round, torch.round, [(away, (3, 4))]),
    "round_decimals": (lambda x: mt.round(x, decimals=1), lambda x: torch.round(x, decimals=1),
                       [(normal, (6,))]),
    "clamp_min": (lambda x: x.clamp_min(0.3), lambda x: x.clamp_min(0.3), [(away, (3, 4))]),
    "clamp_max": (lambda x: mt.clamp_max(x, 0.3), lambda x: torch.clamp_max(x, 0.3),
                  [(away, (3, 4))]),
    "xlogy": (mt.xlogy, torch.xlogy, [(positive, (3, 4)), (positive, (4,))]),
    "lerp": (mt.lerp, torch.lerp, [(normal, (3, 4)), (normal, (3, 4)), (prob, (4,))]),
    "addmm": (lambda a, b, c: mt.addmm(a, b, c, beta=0.5, alpha=2.0),
              lambda a, b, c: torch.addmm(a, b, c, beta=0.5, alpha=2.0),
              [(normal, (3, 5)), (normal, (3, 4)), (normal, (4, 5))]),
    "cumsum": (lambda x: x.cumsum(1), lambda x: x.cumsum(1), [(normal, (3, 4))]),
    "cumsum_dim0": (lambda x: mt.cumsum(x, dim=0), lambda x: torch.cumsum(x, dim=0),
                    [(normal, (3, 2, 2))]),
    "cumprod": (lambda x: x.cumprod(-1), lambda x: x.cumprod(-1), [(normal, (3, 4))]),
    "cumprod_zeros": (lambda x: mt.cumprod(x * mt.tensor([1.0, 0.0, 1.0, 1.0], dtype=mt.float64), 1),
                      lambda x: torch.cumprod(x * torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), 1),
                      [(normal, (2, 4))]),
    "prod": (lambda x: x.prod(1), lambda x: x.prod(1), [(normal, (3, 4))]),
    "prod_all": (mt.prod, torch.prod, [(normal, (2, 3))]),
    "cummax": (lambda x: x.cummax(1), lambda x: x.cummax(1), [(distinct, (3, 4))]),
    "cummin": (lambda x: mt.cummin(x, 0), lambda x: torch.cummin(x, 0), [(distinct, (3, 4))]),
    "median": (mt.median, torch.median, [(distinct, (3, 4))]),
    "median_dim": (lambda x: x.median(1, keepdim=True), lambda x: x.median(1, keepdim=True),
                   [(distinct, (3, 4))]),
    "atan2": (mt.atan2, torch.atan2, [(normal, (3, 4)), (normal, (4,))]),
    "fmod": (lambda a: mt.fmod(a * 3, 1.3), lambda a: torch.fmod(a * 3, 1.3), [(away, (3, 4))]),
    "nan_to_num": (lambda x: mt.nan_to_num(mt.where(mt.tensor(SPECIAL_AT), mt.tensor(SPECIAL), x),
                                           posinf=5.0, neginf=-7.0),
                   lambda x: torch.nan_to_num(torch.where(torch.tensor(SPECIAL_AT), torch.tensor(SPECIAL), x),
                                              posinf=5.0, neginf=-7.0),
                   [(away, (4,))]),
    "index_add": (lambda x, s: x.index_add(1, mt.tensor([2, 0, 2]), s, alpha=0.5),
                  lambda x, s: x.index_add(1, torch.tensor([2, 0, 2]), s, alpha=0.5),
                  [(normal, (2, 4)), (normal, (2, 3))]),
    "index_fill": (lambda x: x.index_fill(0, mt.tensor([1]), -2.0),
                   lambda x: x.index_fill(0, torch.tensor([1]), -2.0), [(normal, (3, 4))]),
    "tensor_split": (lambda x: mt.tensor_split(x, 3, dim=1), lambda x: torch.tensor_split(x, 3, dim=1),
                     [(normal, (2, 5))]),
    "tensor_split_indices": (lambda x: x.tensor_split([1, 4, 9]), lambda x: x.tensor_split([1, 4, 9]),
                             [(normal, (6,))]),
    "rot90": (lambda x: x.rot90(1, (0, 2)), lambda x: x.rot90(1, (0, 2)), [(normal, (2, 3, 4))]),
    "rot90_k3": (lambda x: mt.rot90(x, -1), lambda x: torch.rot90(x, -1), [(normal, (2, 3))]),
    "cross": (mt.cross, lambda a, b: torch.linalg.cross(a, b), [(normal, (4, 3)), (normal, (4, 3))]),
    "kron": (mt.kron, torch.kron, [(normal, (2, 3)), (normal, (2, 2))]),
    "logcumsumexp": (lambda x: mt.logcumsumexp(x, 1), lambda x: torch.logcumsumexp(x, 1),
                     [(normal, (3, 4))]),
    "gather": (lambda x: x.gather(0, mt.tensor(IDX)), lambda x: x.gather(0, torch.tensor(IDX)),
               [(normal, (3, 4))]),
    "gather_dim1_smaller": (lambda x: mt.gather(x, 1, mt.tensor(IDX[:, :2])),
                            lambda x: torch.gather(x, 1, torch.tensor(IDX[:, :2])),
                            [(normal, (3, 4))]),
    "take_along_dim": (lambda x: mt.take_along_dim(x, mt.tensor(IDX[:, :1]), dim=1),
                       lambda x: torch.take_along_dim(x, torch.tensor(IDX[:, :1]), dim=1),
                       [(normal, (2, 4))]),
    "take_along_dim_flat": (lambda x: mt.take_along_dim(x, mt.tensor([5, 0, 5])),
                            lambda x: torch.take_along_dim(x, torch.tensor([5, 0, 5])),
                            [(normal, (2, 3))]),
    "take": (lambda x: mt.take(x, mt.tensor([[0, 5], [5, 3]])),
             lambda x: torch.take(x, torch.tensor([[0, 5], [5, 3]])), [(normal, (2, 3))]),
    "scatter": (lambda x, s: x.scatter(1, mt.tensor([[0, 2], [3, 1], [1, 0]]), s),
                lambda x, s: x.scatter(1, torch.tensor([[0, 2], [3, 1], [1, 0]]), s),
                [(normal, (3, 4)), (normal, (3, 2))]),
    "scatter_value": (lambda x: mt.scatter(x, 0, mt.tensor([[1, 0]]), value=2.5),
                      lambda x: torch.scatter(x, 0, torch.tensor([[1, 0]]), value=2.5),
                      [(normal, (2, 3))]),
    "scatter_add": (lambda x, s: mt.scatter_add(x, 0, mt.tensor(IDX), s),
                    lambda x, s: torch.scatter_add(x, 0, torch.tensor(IDX), s),
                    [(normal, (3, 4)), (normal, (2, 4))]),
    "masked_select": (lambda x: x.masked_select(mt.tensor([True, False, True, True])),
                      lambda x: x.masked_select(torch.tensor([True, False, True, True])),
                      [(normal, (3, 4))]),
    "sort": (lambda x: x.sort(1), lambda x: x.sort(1), [(distinct, (3, 5))]),
    "sort_descending": (lambda x: mt.sort(x, 0, descending=True),
                        lambda x: torch.sort(x, 0, descending=True), [(distinct, (4, 3))]),
    "topk": (lambda x: x.topk(3), lambda x: x.topk(3), [(distinct, (2, 6))]),
    "topk_smallest_dim0": (lambda x: mt.topk(x, 2, dim=0, largest=False),
                           lambda x: torch.topk(x, 2, dim=0, largest=False), [(distinct, (4, 3))]),
    "kthvalue": (lambda x: mt.kthvalue(x, 2, 1), lambda x: torch.kthvalue(x, 2, 1),
                 [(distinct, (3, 4))]),
    "msort": (mt.msort, torch.msort, [(distinct, (4, 3))]),
    "flip": (lambda x: x.flip(0, 2), lambda x: x.flip(0, 2), [(normal, (2, 3, 4))]),
    "fliplr": (mt.fliplr, torch.fliplr, [(normal, (2, 3))]),
    "flipud": (mt.flipud, torch.flipud, [(normal, (2, 3))]),
    "roll": (lambda x: x.roll(1, 1), lambda x: x.roll(1, 1), [(normal, (2, 5))]),
    "roll_flat": (lambda x: mt.roll(x, -4), lambda x: torch.roll(x, -4), [(normal, (2, 5))]),
    "roll_two_dims": (lambda x: mt.roll(x, (1, -2), (0, 1)), lambda x: torch.roll(x, (1, -2), (0, 1)),
                      [(normal, (3, 4))]),
    "repeat": (lambda x: x.repeat(2, 1, 3), lambda x: x.repeat(2, 1, 3), [(normal, (2, 3))]),
    "tile": (lambda x: x.tile((2,)), lambda x: x.tile((2,)), [(normal, (2, 3))]),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=0),
                          lambda x: x.repeat_interleave(2, dim=0), [(normal, (2, 3))]),
    "repeat_interleave_tensor": (lambda x: mt.repeat_interleave(x, mt.tensor([1, 0, 3]), dim=1),
                                 lambda x: torch.repeat_interleave(x, torch.tensor([1, 0, 3]), dim=1),
                                 [(normal, (2, 3))]),
    "repeat_interleave_flat": (lambda x: mt.repeat_interleave(x, 2),
                               lambda x: torch.repeat_interleave(x, 2), [(normal, (2, 2))]),
    "narrow": (lambda x: x.narrow(1, 1, 2), lambda x: x.narrow(1, 1, 2), [(normal, (3, 4))]),
    "select": (lambda x: x.select(1, -1), lambda x: x.select(1, -1), [(normal, (3, 4))]),
    "unbind": (lambda x: x.unbind(1), lambda x: x.unbind(1), [(normal, (2, 3))]),
    "movedim": (lambda x: x.movedim((0, 1), (2, 0)), lambda x: x.movedim((0, 1), (2, 0)),
                [(normal, (2, 3, 4))]),
    "swapaxes": (lambda x: x.swapaxes(0, 2), lambda x: x.swapaxes(0, 2), [(normal, (2, 3, 4))]),
    "t": (lambda x: x.t(), lambda x: x.t(), [(normal, (2, 3))]),
    "t_1d": (mt.t, torch.t, [(normal, (3,))]),
    "diagonal": (lambda x: x.diagonal(1), lambda x: x.diagonal(1), [(normal, (3, 4))]),
    "diagonal_dims": (lambda x: mt.diagonal(x, -1, 2, 0), lambda x: torch.diagonal(x, -1, 2, 0),
                      [(normal, (3, 2, 4))]),
    "diag_vector": (lambda x: mt.diag(x, 1), lambda x: torch.diag(x, 1), [(normal, (3,))]),
    "diag_vector_below": (lambda x: mt.diag(x, -2), lambda x: torch.diag(x, -2), [(normal, (2,))]),
    "diag_matrix": (lambda x: x.diag(), lambda x: x.diag(), [(normal, (3, 4))]),
    "trace": (lambda x: x.trace(), lambda x: x.trace(), [(normal, (3, 4))]),
    "broadcast_to": (lambda x: x.broadcast_to((2, 3, 4)), lambda x: x.broadcast_to((2, 3, 4)),
                     [(normal, (3, 1))]),
    "broadcast_tensors": (lambda a, b: mt.broadcast_tensors(a, b),
                          lambda a, b: torch.broadcast_tensors(a, b),
                          [(normal, (3, 1)), (normal, (4,))]),
    "hstack": (lambda a, b: mt.hstack([a, b]), lambda a, b: torch.hstack([a, b]),
               [(normal, (2, 3)), (normal, (2, 1))]),
    "vstack": (lambda a, b: mt.vstack([a, b]), lambda a, b: torch.vstack([a, b]),
               [(normal, (3,)), (normal, (2, 3))]),
    "meshgrid_ij": (lambda a, b: mt.meshgrid(a, b, indexing="ij"),
                    lambda a, b: torch.meshgrid(a, b, indexing="ij"), [(normal, (3,)), (normal, (2,))]),
    "meshgrid_xy": (lambda a, b: mt.meshgrid(a, b, indexing="xy"),
                    lambda a, b: torch.meshgrid(a, b, indexing="xy"), [(normal, (3,)), (normal, (2,))]),
    "mm": (lambda a, b: a.mm(b), lambda a, b: a.mm(b), [(normal, (2, 3)), (normal, (3, 4))]),
    "bmm": (mt.bmm, torch.bmm, [(normal, (2, 2, 3)), (normal, (2, 3, 4))]),
    "mv": (mt.mv, torch.mv, [(normal, (2, 3)), (normal, (3,))]),
    "dot": (lambda a, b: a.dot(b), lambda a, b: a.dot(b), [(normal, (5,)), (normal, (5,))]),
    "inner": (mt.inner, torch.inner, [(normal, (2, 3)), (normal, (4, 3))]),
    "outer": (lambda a, b: a.outer(b), lambda a, b: a.outer(b), [(normal, (3,)), (normal, (4,))]),
    "baddbmm": (mt.baddbmm, torch.baddbmm, [(normal, (2, 2, 4)), (normal, (2, 2, 3)), (normal, (2, 3, 4))]),
    "tensordot": (lambda a, b: mt.tensordot(a, b, ([1, 0], [0, 2])),
                  lambda a, b: torch.tensordot(a, b, ([1, 0], [0, 2])),
                  [(normal, (2, 3, 4)), (normal, (3, 5, 2))]),
    "einsum_bmm": (lambda a, b: mt.einsum("bij,bjk->bik", a, b),
                   lambda a, b: torch.einsum("bij,bjk->bik", a, b), [(normal, (2, 3, 4)), (normal, (2, 4, 2))]),
    "einsum_outer": (lambda a, b: mt.einsum("i,j->ij", a, b), lambda a, b: torch.einsum("i,j->ij", a, b),
                     [(normal, (3,)), (normal, (4,))]),
    "einsum_trace": (lambda a: mt.einsum("ii", a), lambda a: torch.einsum("ii", a), [(normal, (3, 3))]),
    "einsum_diag": (lambda a: mt.einsum("ii->i", a), lambda a: torch.einsum("ii->i", a), [(normal, (3, 3))]),
    "einsum_transpose": (lambda a: mt.einsum("ij->ji", a), lambda a: torch.einsum("ij->ji", a),
                         [(normal, (2, 3))]),
    "einsum_ellipsis": (lambda a, b: mt.einsum("...ij,...jk->...ik", a, b),
                        lambda a, b: torch.einsum("...ij,...jk->...ik", a, b),
                        [(normal, (2, 2, 3)), (normal, (2, 3, 2))]),
    "einsum_attention": (lambda q, k: mt.einsum("bhtd,bhsd->bhts", q, k),
                         lambda q, k: torch.einsum("bhtd,bhsd->bhts", q, k),
                         [(normal, (1, 2, 3, 4)), (normal, (1, 2, 5, 4))]),
    "einsum_implicit_chain": (lambda a, b, c: mt.einsum("ij,jk,kl", a, b, c),
                              lambda a, b, c: torch.einsum("ij,jk,kl", a, b, c),
                              [(normal, (2, 3)), (normal, (3, 4)), (normal, (4, 2))]),
    "einsum_broadcast_batch": (lambda a, b: mt.einsum("bij,bj->bi", a, b),
                               lambda a, b: torch.einsum("bij,bj->bi", a, b),
                               [(normal, (2, 3, 4)), (normal, (1, 4))]),
    "einsum_sum_all": (lambda a: mt.einsum("ijk->", a), lambda a: torch.einsum("ijk->", a),
                       [(normal, (2, 3, 2))]),
    "norm": (lambda x: x.norm(), lambda x: x.norm(), [(normal, (3, 4))]),
    "norm_dim_p1": (lambda x: mt.norm(x, 1, dim=1, keepdim=True),
                    lambda x: torch.norm(x, 1, dim=1, keepdim=True), [(away, (3, 4))]),
    "vector_norm_p3": (lambda x: mt.linalg.vector_norm(x, 3, dim=0),
                       lambda x: torch.linalg.vector_norm(x, 3, dim=0), [(away, (3, 4))]),
    "vector_norm_inf": (lambda x: mt.linalg.vector_norm(x, math.inf, dim=-1),
                        lambda x: torch.linalg.vector_norm(x, math.inf, dim=-1), [(distinct, (3, 4))]),
    "linalg_norm_matrix": (mt.linalg.norm, torch.linalg.norm, [(normal, (3, 4))]),
    "matrix_norm_batched": (mt.linalg.matrix_norm, torch.linalg.matrix_norm, [(normal, (2, 3, 4))]),
    "dist": (lambda a, b: mt.dist(a, b, 3), lambda a, b: torch.dist(a, b, 3),
             [(normal, (3, 4)), (normal, (4,))]),
    "cdist": (mt.cdist, torch.cdist, [(normal, (3, 2)), (normal, (4, 2))]),
    "std_mean": (lambda x: mt.std_mean(x, 1), lambda x: torch.std_mean(x, 1), [(normal, (3, 4))]),
    "var_mean": (lambda x: mt.var_mean(x, 0, correction=0),
                 lambda x: torch.var_mean(x, 0, correction=0), [(normal, (3, 4))]),
    "float_power": (lambda x: mt.float_power(x, 3), lambda x: torch.float_power(x, 3),
                    [(normal, (4,))]),
    # nn.functional
    "F.pad_constant": (lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
                       lambda x: torch.nn.functional.pad(x, (1, 2, 0, 1), value=0.5), [(normal, (2, 3, 4))]),
    "F.pad_crop": (lambda x: F.pad(x, (-1, 2)), lambda x: torch.nn.functional.pad(x, (-1, 2)),
                   [(normal, (2, 4))]),
    "F.pad_reflect": (lambda x: F.pad(x, (2, 1), mode="reflect"),
                      lambda x: torch.nn.functional.pad(x, (2, 1), mode="reflect"), [(normal, (2, 3, 4))]),
    "F.pad_replicate": (lambda x: F.pad(x, (2, 1, 1, 0), mode="replicate"),
                        lambda x: torch.nn.functional.pad(x, (2, 1, 1, 0), mode="replicate"),
                        [(normal, (1, 2, 3, 4))]),
    "F.pad_circular": (lambda x: F.pad(x, (1, 2), mode="circular"),
                       lambda x: torch.nn.functional.pad(x, (1, 2), mode="circular"), [(normal, (1, 2, 4))]),
    "F.binary_cross_entropy": (lambda x, t: F.binary_cross_entropy(x, t),
                               lambda x, t: torch.nn.functional.binary_cross_entropy(x, t),
                               [(prob, (3, 4)), (prob, (3, 4))]),
    "F.binary_cross_entropy_weight_sum": (
        lambda x, t: F.binary_cross_entropy(x, t, mt.tensor(W4), reduction="sum"),
        lambda x, t: torch.nn.functional.binary_cross_entropy(x, t, torch.tensor(W4), reduction="sum"),
        [(prob, (3, 4)), (prob, (3, 4))]),
    "F.bce_with_logits": (lambda x, t: F.binary_cross_entropy_with_logits(x, t),
                          lambda x, t: torch.nn.functional.binary_cross_entropy_with_logits(x, t),
                          [(normal, (3, 4)), (prob, (3, 4))]),
    "F.bce_with_logits_pos_weight": (
        lambda x, t: F.binary_cross_entropy_with_logits(x, t, mt.tensor(W4), pos_weight=mt.tensor(W4[::-1].copy()),
                                                        reduction="none"),
        lambda x, t: torch.nn.functional.binary_cross_entropy_with_logits(
            x, t, torch.tensor(W4), pos_weight=torch.tensor(W4[::-1].copy()), reduction="none"),
        [(normal, (3, 4)), (prob, (3, 4))]),
    "F.l1_loss": (F.l1_loss, torch.nn.functional.l1_loss, [(normal, (3, 4)), (normal, (3, 4))]),
    "F.smooth_l1_loss": (lambda x, t: F.smooth_l1_loss(x, t, beta=0.5),
                         lambda x, t: torch.nn.functional.smooth_l1_loss(x, t, beta=0.5),
                         [(normal, (3, 4)), (normal, (3, 4))]),
    "F.huber_loss": (lambda x, t: F.huber_loss(x, t, reduction="sum", delta=0.7),
                     lambda x, t: torch.nn.functional.huber_loss(x, t, reduction="sum", delta=0.7),
                     [(normal, (3, 4)), (normal, (3, 4))]),
    "F.kl_div": (lambda x, t: F.kl_div(x, t, reduction="batchmean"),
                 lambda x, t: torch.nn.functional.kl_div(x, t, reduction="batchmean"),
                 [(normal, (3, 4)), (prob, (3, 4))]),
    "F.kl_div_log_target": (lambda x, t: F.kl_div(x, t, reduction="sum", log_target=True),
                            lambda x, t: torch.nn.functional.kl_div(x, t, reduction="sum", log_target=True),
                            [(normal, (3, 4)), (normal, (3, 4))]),
    "F.normalize": (lambda x: F.normalize(x, dim=-1), lambda x: torch.nn.functional.normalize(x, dim=-1),
                    [(normal, (3, 4))]),
    "F.softplus": (lambda x: F.softplus(x * 10, beta=2.0, threshold=5.0),
                   lambda x: torch.nn.functional.softplus(x * 10, beta=2.0, threshold=5.0),
                   [(away, (3, 4))]),
    "F.leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda x: torch.nn.functional.leaky_relu(x, 0.2),
                     [(away, (3, 4))]),
    "F.elu": (lambda x: F.elu(x, 0.7), lambda x: torch.nn.functional.elu(x, 0.7), [(away, (3, 4))]),
    "F.selu": (F.selu, torch.nn.functional.selu, [(away, (3, 4))]),
    "F.celu": (lambda x: F.celu(x, 0.5), lambda x: torch.nn.functional.celu(x, 0.5), [(away, (3, 4))]),
    "F.relu6": (lambda x: F.relu6(x * 4), lambda x: torch.nn.functional.relu6(x * 4), [(away, (3, 4))]),
    "F.hardtanh": (F.hardtanh, torch.nn.functional.hardtanh, [(away, (3, 4))]),
    "F.hardsigmoid": (F.hardsigmoid, torch.nn.functional.hardsigmoid, [(normal, (3, 4))]),
    "F.hardswish": (F.hardswish, torch.nn.functional.hardswish, [(normal, (3, 4))]),
    "F.mish": (F.mish, torch.nn.functional.mish, [(normal, (3, 4))]),
    "F.logsigmoid": (F.logsigmoid, torch.nn.functional.logsigmoid, [(normal, (3, 4))]),
    "F.softsign": (F.softsign, torch.nn.functional.softsign, [(normal, (3, 4))]),
    "F.softmin": (lambda x: F.softmin(x, dim=1), lambda x: torch.nn.functional.softmin(x, dim=1),
                  [(normal, (3, 4))]),
    "F.tanhshrink": (F.tanhshrink, torch.nn.functional.tanhshrink, [(normal, (3, 4))]),
    "F.glu": (F.glu, torch.nn.functional.glu, [(normal, (3, 4))]),
    "F.cosine_similarity": (F.cosine_similarity, torch.nn.functional.cosine_similarity,
                            [(normal, (3, 4)), (normal, (3, 4))]),
    "F.pairwise_distance": (F.pairwise_distance, torch.nn.functional.pairwise_distance,
                            [(normal, (3, 4)), (normal, (3, 4))]),
    "F.batch_norm_training": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, training=True),
        [(normal, (4, 3, 2)), (normal, (3,)), (normal, (3,))]),
}


# torch's hardsigmoid backward multiplies by 1/6 rounded to float32 even in float64
GRAD_RTOL = {"F.hardsigmoid": 1e-7}


def _inputs(name):
    return [maker(shape) for maker, shape in CASES[name][2]]


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_values_and_gradients(name):
    fn, torch_fn, _ = CASES[name]
    arrays = _inputs(name)
    ours = [mt.tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, tout = _outputs(fn(*ours)), _outputs(torch_fn(*theirs))
    assert len(out) == len(tout)
    upstream = []
    for o, t in zip(out, tout):
        assert tuple(o.shape) == tuple(t.shape), name
        assert str(o.numpy().dtype) == str(t.detach().numpy().dtype), name
        np.testing.assert_allclose(o.numpy(), t.detach().numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
        upstream.append(rng.standard_normal(o.shape) if o.numpy().dtype.kind == "f" else None)
    # gradients against torch's with one random upstream gradient
    pairs = [(o, t, u) for o, t, u in zip(out, tout, upstream)
             if u is not None and o.requires_grad and t.requires_grad]
    if not pairs:
        return
    torch.autograd.backward([t for _, t, _ in pairs], [torch.tensor(u) for _, _, u in pairs])
    sum(((o * mt.tensor(u)).sum() for o, _, u in pairs), mt.tensor(0.0, dtype=mt.float64)).backward()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ga = None if a.grad is None else a.grad.numpy()
        gb = None if b.grad is None else b.grad.numpy()
        if gb is None or not np.any(gb):
            assert ga is None or not np.any(ga), f"{name}: input {i} got a gradient torch has not"
            continue
        assert ga is not None, f"{name}: input {i} got no gradient"
        np.testing.assert_allclose(ga, gb, rtol=GRAD_RTOL.get(name, 1e-8), atol=1e-10,
                                   err_msg=f"{name} input {i}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck_float64(name):
    fn = CASES[name][0]
    tensors = [mt.tensor(a, requires_grad=True) for a in _inputs(name)]
    outs = [o for o in _outputs(fn(*tensors)) if o.numpy().dtype.kind == "f"]
    if not any(o.requires_grad for o in outs):
        pytest.fail(f"{name}: no output carries a gradient")
    assert mt.gradcheck(fn, tensors)


def test_a_wrong_rule_fails_the_gradcheck():
    """The checks above can fail: a cumsum whose backward forgets to reverse the scan."""
    class Wrong(ops_extra.CumsumBackward):
        def backward(self, g):
            return (np.cumsum(np.asarray(g), self.dim),)

    x = mt.tensor(normal((2, 4)), requires_grad=True)

    def wrong_cumsum(t):
        out = ops_extra.cumsum(t.detach(), 1)
        node = Wrong()
        node.dim, node.dtype, node.shape, node.shape1 = 1, t.numpy().dtype, t.shape, t.shape
        return mt.core._core.attach(out, node, (t,))

    assert not mt.gradcheck(wrong_cumsum, (x,), raise_exception=False)


# ---- results without gradients ----------------------------------------------------------

def _same(ours, theirs):
    if isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _same(a, b)
        return
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, mt.Tensor)
        assert str(ours.numpy().dtype) == str(theirs.numpy().dtype)
        assert tuple(ours.shape) == tuple(theirs.shape)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    else:
        assert type(ours) is type(theirs) and ours == theirs


def test_no_grad_functions_match_torch():
    x = np.array([[0.0, 1.5, -2.0, 1.5], [3.0, 0.0, 0.0, -1.0]])
    i = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    a, t = mt.tensor(x), torch.tensor(x)
    ai, ti = mt.tensor(i), torch.tensor(i)
    b = np.array([[0.0, 1.5 + 1e-9, -2.0, 1.6], [3.0, 0.0, 1e-12, -1.0]])
    d35 = distinct((3, 5))
    pairs = [
        (mt.allclose(a, mt.tensor(b)), torch.allclose(t, torch.tensor(b))),
        (mt.isclose(a, mt.tensor(b), atol=0), torch.isclose(t, torch.tensor(b), atol=0)),
        (mt.equal(a, mt.tensor(x)), torch.equal(t, torch.tensor(x))),
        (mt.equal(a, mt.tensor(b)), torch.equal(t, torch.tensor(b))),
        (a.nonzero(), t.nonzero()),
        (mt.nonzero(a, as_tuple=True), torch.nonzero(t, as_tuple=True)),
        (mt.argwhere(a), torch.argwhere(t)),
        (a.count_nonzero(), t.count_nonzero()),
        (mt.count_nonzero(a, dim=1), torch.count_nonzero(t, dim=1)),
        (mt.any(a > 2, dim=1), torch.any(t > 2, dim=1)),
        (mt.all(a != 0, dim=0, keepdim=True), torch.all(t != 0, dim=0, keepdim=True)),
        ((a > 2).all(), (t > 2).all()),
        (mt.unique(ai), torch.unique(ti)),
        (mt.unique(ai, return_inverse=True, return_counts=True),
         torch.unique(ti, return_inverse=True, return_counts=True)),
        (ai.bincount(), ti.bincount()),
        (mt.bincount(ai, minlength=12), torch.bincount(ti, minlength=12)),
        (mt.bincount(ai, weights=mt.tensor(i * 0.5)), torch.bincount(ti, weights=torch.tensor(i * 0.5))),
        (mt.histc(a, bins=4, min=-2, max=3), torch.histc(t, bins=4, min=-2, max=3)),
        (mt.sign(ai - 4), torch.sign(ti - 4)),
        (mt.cumsum(ai, 0), torch.cumsum(ti, 0)),
        (mt.cumsum(mt.tensor([True, False, True]), 0), torch.cumsum(torch.tensor([True, False, True]), 0)),
        (mt.prod(mt.tensor([2, 3, 4])), torch.prod(torch.tensor([2, 3, 4]))),
        (mt.isinf(mt.tensor([1.0, math.inf, -math.inf])), torch.isinf(torch.tensor([1.0, math.inf, -math.inf]))),
        (mt.isneginf(mt.tensor([1.0, -math.inf])), torch.isneginf(torch.tensor([1.0, -math.inf]))),
        (mt.logical_xor(a > 0, a < 2), torch.logical_xor(t > 0, t < 2)),
        (mt.eye(3, 2), torch.eye(3, 2)),
        (mt.eye(2, dtype=mt.int64), torch.eye(2, dtype=torch.int64)),
        (mt.tril_indices(3, 4, 1), torch.tril_indices(3, 4, 1)),
        (mt.triu_indices(3, 3), torch.triu_indices(3, 3)),
        (mt.tensor(d35).argsort(dim=1, descending=True),
         torch.tensor(d35).argsort(dim=1, descending=True)),
        (mt.argsort(mt.tensor([2, 1, 2, 1, 0]), stable=True),
         torch.argsort(torch.tensor([2, 1, 2, 1, 0]), stable=True)),
        (mt.sort(mt.tensor([2, 1, 2, 1, 0]), descending=True, stable=True),
         torch.sort(torch.tensor([2, 1, 2, 1, 0]), descending=True, stable=True)),
        (mt.sort(mt.tensor([1.0, math.nan, -1.0]), descending=True).indices,
         torch.sort(torch.tensor([1.0, math.nan, -1.0]), descending=True).indices),
        (mt.repeat_interleave(mt.tensor([2, 0, 1])), torch.repeat_interleave(torch.tensor([2, 0, 1]))),
        (mt.broadcast_shapes((3, 1), (2, 1, 4)), tuple(torch.broadcast_shapes((3, 1), (2, 1, 4)))),
        (a.is_floating_point(), t.is_floating_point()),
        (ai.is_floating_point(), ti.is_floating_point()),
        (F.one_hot(mt.tensor([0, 2, 1])), torch.nn.functional.one_hot(torch.tensor([0, 2, 1]))),
        (F.one_hot(mt.tensor([[0], [1]]), num_classes=4),
         torch.nn.functional.one_hot(torch.tensor([[0], [1]]), num_classes=4)),
        (mt.topk(mt.tensor([3, 1, 4, 1, 5]), 2), torch.topk(torch.tensor([3, 1, 4, 1, 5]), 2)),
        (mt.cummax(mt.tensor([1.0, 3.0, 3.0, math.nan, 2.0, math.nan]), 0).indices,
         torch.cummax(torch.tensor([1.0, 3.0, 3.0, math.nan, 2.0, math.nan]), 0).indices),
        (mt.cummin(mt.tensor([3, 1, 1, 2, 0]), 0), torch.cummin(torch.tensor([3, 1, 1, 2, 0]), 0)),
        (mt.unique_consecutive(mt.tensor([1, 1, 2, 2, 2, 1, 3]), return_inverse=True, return_counts=True),
         torch.unique_consecutive(torch.tensor([1, 1, 2, 2, 2, 1, 3]), return_inverse=True,
                                  return_counts=True)),
        (mt.median(mt.tensor([4, 1, 3, 2])), torch.median(torch.tensor([4, 1, 3, 2]))),
        (mt.true_divide(mt.tensor([3]), 2), torch.true_divide(torch.tensor([3]), 2)),
    ]
    for k, (ours, theirs) in enumerate(pairs):
        try:
            _same(ours, theirs)
        except AssertionError as e:
            raise AssertionError(f"case {k}: {ours!r} vs {theirs!r}") from e


def test_gumbel_softmax():
    logits = mt.tensor(normal((4, 5)), requires_grad=True)
    soft = F.gumbel_softmax(logits, tau=0.5)
    np.testing.assert_allclose(soft.sum(-1).detach().numpy(), 1.0, rtol=1e-12)
    hard = F.gumbel_softmax(logits, hard=True)
    assert set(np.unique(hard.detach().numpy())) <= {0.0, 1.0}
    np.testing.assert_array_equal(hard.detach().numpy().sum(-1), 1.0)
    (hard * mt.tensor(normal((4, 5)))).sum().backward()   # the soft sample's gradient
    assert logits.grad is not None and np.abs(logits.grad.numpy()).sum() > 0
    # the noise is Gumbel: over many draws the argmax follows softmax(logits)
    mt.manual_seed(1)
    p = np.array([0.1, 0.2, 0.7])
    draws = F.gumbel_softmax(mt.tensor(np.log(np.tile(p, (4000, 1)))), hard=True).numpy()
    np.testing.assert_allclose(draws.mean(0), p, atol=0.03)


def test_inplace_forms():
    x = normal((3, 4))
    cases = [
        ("masked_fill_", lambda m, t: t.masked_fill_(m.tensor(x > 0), 0.5)),
        ("scatter_", lambda m, t: t.scatter_(1, m.tensor([[0], [2], [1]]), m.full((3, 1), 7.0, dtype=m.float64))),
        ("scatter_add_", lambda m, t: t.scatter_add_(0, m.tensor([[2, 0, 1, 1]]), m.ones(1, 4, dtype=m.float64))),
        ("index_add_", lambda m, t: t.index_add_(0, m.tensor([2, 2]), m.ones(2, 4, dtype=m.float64))),
        ("index_fill_", lambda m, t: t.index_fill_(1, m.tensor([0, 3]), 9.0)),
        ("pow_", lambda m, t: t.pow_(2)),
        ("clamp_min_", lambda m, t: t.clamp_min_(0.1)),
        ("exp_", lambda m, t: t.exp_()),
        ("relu_", lambda m, t: t.relu_()),
        ("fill_diagonal_", lambda m, t: t.fill_diagonal_(3.0)),
        ("lerp_", lambda m, t: t.lerp_(m.ones(3, 4, dtype=m.float64), 0.25)),
    ]
    for name, op in cases:
        ours, theirs = mt.tensor(x), torch.tensor(x)
        assert op(mt, ours) is ours, name
        op(torch, theirs)
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-12, err_msg=name)
    # where autograd would miss the change, it is refused (no silent wrong gradient)
    y = mt.tensor(x, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="requires grad"):
        y.masked_fill_(y > 0, 0.0)
    with mt.no_grad():
        y.masked_fill_(y > 0, 0.0)
    t = mt.ones(2, 2)
    t.apply_(lambda v: v * 3)
    assert t.tolist() == [[3.0, 3.0], [3.0, 3.0]] and t.share_memory_() is t
    assert t.data_ptr() == t.numpy().ctypes.data


def test_random_sampling_is_seeded_and_in_range():
    mt.manual_seed(3)
    a = mt.bernoulli(mt.full((1000,), 0.3))
    mt.manual_seed(3)
    assert mt.equal(a, mt.bernoulli(mt.full((1000,), 0.3)))
    assert set(a.tolist()) <= {0.0, 1.0} and 0.2 < a.mean().item() < 0.4
    n = mt.normal(mt.zeros(2000) + 2.0, 0.5)
    assert abs(n.mean().item() - 2.0) < 0.1 and abs(n.std().item() - 0.5) < 0.05
    assert mt.normal(0.0, 1.0, size=(3, 2)).shape == (3, 2)
    p = mt.poisson(mt.full((2000,), 4.0))
    assert abs(p.mean().item() - 4.0) < 0.3
    e = mt.zeros(2000).exponential_(2.0)
    assert (e.numpy() >= 0).all() and abs(e.mean().item() - 0.5) < 0.05
    r = mt.zeros(100, dtype=mt.int64).random_(0, 5)
    assert set(r.tolist()) <= set(range(5))
    b = mt.zeros(100).bernoulli_(0.5)
    assert set(b.tolist()) <= {0.0, 1.0}
    with pytest.raises(RuntimeError, match=r"\[0, 1\]"):
        mt.bernoulli(mt.tensor([1.5]))
    arr = np.arange(3.0)
    assert np.shares_memory(mt.as_tensor(arr).numpy(), arr)
    _same(mt.logspace(0, 2, 3), torch.logspace(0, 2, 3))
    _same(mt.as_tensor([1, 2], dtype=mt.float64), torch.as_tensor([1, 2], dtype=torch.float64))


def test_new_tensor_methods_and_type_as():
    x = mt.tensor([[1.0, 2.0]], dtype=mt.float64)
    tx = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    _same(x.new_zeros(2, 3), tx.new_zeros(2, 3))
    _same(x.new_ones((1, 2)), tx.new_ones((1, 2)))
    _same(x.new_full((2,), 7), tx.new_full((2,), 7))
    _same(x.new_tensor([1, 2]), tx.new_tensor([1, 2]))
    _same(x.new_zeros(3, dtype=mt.int64), tx.new_zeros(3, dtype=torch.int64))
    _same(mt.tensor([1, 2]).type_as(x), torch.tensor([1, 2]).type_as(tx))
    y = x.new_ones(2, requires_grad=True)
    assert y.requires_grad and y.is_leaf
    r = mt.randn_like(x)
    assert r.shape == x.shape and r.dtype == x.dtype
    assert mt.rand_like(x).dtype == x.dtype and mt.empty_like(x).shape == (1, 2)
    assert mt.randint_like(mt.zeros(3, dtype=mt.int64), 5).dtype == mt.int64


def test_every_registered_method_is_callable_on_a_tensor():
    t = mt.ones(2, 2)
    rows = [row for row in mt.ops.registry() if row.method is not None]
    assert len(rows) > 200
    for row in rows:
        method = getattr(t, row.name, None)
        assert callable(method), f"Tensor.{row.name} is not registered"
        assert mt.Tensor.__dict__[row.name] is row.method or row.name == "abs", row


def test_errors_name_the_problem():
    x = mt.randn(3, 4)
    with pytest.raises(IndexError, match="out of bounds"):
        x.gather(1, mt.tensor([[4]]))
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.cumsum(2)
    with pytest.raises(RuntimeError, match="out of range"):
        x.topk(5)
    with pytest.raises(TypeError, match="index"):
        x.gather(0, mt.tensor([[0.5]]))
    with pytest.raises(ValueError, match="operands"):
        mt.einsum("ij,jk->ik", x)
    with pytest.raises(ValueError):
        mt.einsum("ijk->i", x)
    with pytest.raises(mt.ShapeError):
        mt.einsum("ij,jk->ik", x, mt.randn(3, 2))
    with pytest.raises(RuntimeError, match="repeat"):
        x.repeat(2)
    with pytest.raises(RuntimeError, match="2 dimensions"):
        mt.randn(2, 2, 2).t()
    with pytest.raises(mt.ShapeError):
        mt.mm(x, x)
    with pytest.raises(RuntimeError, match="non-negative"):
        F.one_hot(mt.tensor([-1, 2]))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(mt.tensor([1.5]), mt.tensor([1.0]))
    with pytest.raises(ValueError, match="padding"):
        F.pad(x, (1,))


def test_ops_respect_no_grad_and_inference_mode():
    x = mt.randn(3, 4, requires_grad=True)
    with mt.no_grad():
        assert not x.cumsum(0).requires_grad and not x.topk(2).values.requires_grad
    with mt.inference_mode():
        assert mt.is_inference_mode_enabled() and not mt.einsum("ij->j", x).requires_grad
    assert not mt.is_inference_mode_enabled() and mt.is_grad_enabled()

    @mt.inference_mode()
    def f(t):
        return t.sin()

    assert not f(x).requires_grad and mt.is_grad_enabled()
    with mt.inference_mode(False):
        assert x.sin().requires_grad


def test_inplace_change_of_a_saved_tensor_is_detected():
    """Ops that read their output in backward are checked by the engine's version counter;
    ops that keep their own copy are not disturbed by later in-place changes."""
    if not hasattr(mt.core._core, "declare_saved"):
        pytest.fail("the core has no declare_saved (version counters)")
    x = mt.randn(4, dtype=mt.float64, requires_grad=True)
    y = x.exp()
    with pytest.raises(RuntimeError, match="not recorded"):
        y.add_(1.0)      # in grad mode the engine refuses in-place ops it cannot record
    with mt.no_grad():
        y.add_(1.0)      # exp's backward reads its output: counted, and caught below
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    z = x.cumsum(0)
    with mt.no_grad():
        z.mul_(2.0)      # cumsum's backward needs no saved value: as torch, no error
    z.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 3.0, 2.0, 1.0])


# ---- modules -----------------------------------------------------------------------------

MODULES = [
    (lambda: nn.Sigmoid(), lambda: torch.nn.Sigmoid()),
    (lambda: nn.Softmax(dim=1), lambda: torch.nn.Softmax(dim=1)),
    (lambda: nn.LogSoftmax(dim=-1), lambda: torch.nn.LogSoftmax(dim=-1)),
    (lambda: nn.Softmin(dim=0), lambda: torch.nn.Softmin(dim=0)),
    (lambda: nn.LeakyReLU(0.2), lambda: torch.nn.LeakyReLU(0.2)),
    (lambda: nn.ELU(alpha=0.5), lambda: torch.nn.ELU(alpha=0.5)),
    (lambda: nn.SELU(), lambda: torch.nn.SELU()),
    (lambda: nn.CELU(), lambda: torch.nn.CELU()),
    (lambda: nn.Softplus(beta=2.0), lambda: torch.nn.Softplus(beta=2.0)),
    (lambda: nn.Mish(), lambda: torch.nn.Mish()),
    (lambda: nn.Hardtanh(-2.0, 2.0), lambda: torch.nn.Hardtanh(-2.0, 2.0)),
    (lambda: nn.ReLU6(), lambda: torch.nn.ReLU6()),
    (lambda: nn.Hardsigmoid(), lambda: torch.nn.Hardsigmoid()),
    (lambda: nn.Hardswish(), lambda: torch.nn.Hardswish()),
    (lambda: nn.LogSigmoid(), lambda: torch.nn.LogSigmoid()),
    (lambda: nn.Softsign(), lambda: torch.nn.Softsign()),
    (lambda: nn.Tanhshrink(), lambda: torch.nn.Tanhshrink()),
    (lambda: nn.GLU(), lambda: torch.nn.GLU()),
    (lambda: nn.Tanh(), lambda: torch.nn.Tanh()),
    (lambda: nn.Flatten(), lambda: torch.nn.Flatten()),
    (lambda: nn.Flatten(0, 1), lambda: torch.nn.Flatten(0, 1)),
    (lambda: nn.Unflatten(1, (2, 2)), lambda: torch.nn.Unflatten(1, (2, 2))),
]


@pytest.mark.parametrize("k", range(len(MODULES)))
def test_activation_modules_match_torch(k):
    ours, theirs = MODULES[k][0](), MODULES[k][1]()
    x = normal((3, 4, 2))
    out = ours(mt.tensor(x))
    expected = theirs(torch.tensor(x))
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-10, atol=1e-12)
    assert repr(ours) == repr(theirs)


def test_loss_modules_match_torch():
    logits, target = normal((5, 4)), np.array([0, 3, 1, 1, -100])
    p, y = prob((5, 4)), prob((5, 4))
    cases = [
        (nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss(), (logits, target)),
        (nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1),
         torch.nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1), (logits, target)),
        (nn.NLLLoss(), torch.nn.NLLLoss(), (np.log(p), target)),
        (nn.MSELoss(), torch.nn.MSELoss(), (p, y)),
        (nn.L1Loss(reduction="sum"), torch.nn.L1Loss(reduction="sum"), (p, y)),
        (nn.SmoothL1Loss(beta=0.1), torch.nn.SmoothL1Loss(beta=0.1), (p, y)),
        (nn.HuberLoss(delta=0.2), torch.nn.HuberLoss(delta=0.2), (p, y)),
        (nn.BCELoss(), torch.nn.BCELoss(), (p, y)),
        (nn.BCEWithLogitsLoss(), torch.nn.BCEWithLogitsLoss(), (logits, y)),
        (nn.KLDivLoss(reduction="batchmean"), torch.nn.KLDivLoss(reduction="batchmean"),
         (np.log(p), y)),
    ]
    for ours, theirs, (a, b) in cases:
        ta = mt.tensor(a, requires_grad=True)
        tb = mt.tensor(b)
        got = ours(ta, tb)
        xa = torch.tensor(a, requires_grad=True)
        expected = theirs(xa, torch.tensor(b))
        np.testing.assert_allclose(got.item(), expected.item(), rtol=1e-10, err_msg=repr(ours))
        got.backward()
        expected.backward()
        np.testing.assert_allclose(ta.grad.numpy(), xa.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=repr(ours))
        assert repr(ours) == repr(theirs)
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss(reduction="avg")


def test_batchnorm1d_matches_torch_in_train_and_eval():
    ours, theirs = nn.BatchNorm1d(3).double(), torch.nn.BatchNorm1d(3).double()
    for _ in range(3):
        x = normal((6, 3))
        np.testing.assert_allclose(ours(mt.tensor(x)).detach().numpy(),
                                   theirs(torch.tensor(x)).detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-12)
    assert int(ours.num_batches_tracked.item()) == 3
    ours.eval(), theirs.eval()
    x = normal((4, 3, 2))
    np.testing.assert_allclose(ours(mt.tensor(x)).detach().numpy(),
                               theirs(torch.tensor(x)).detach().numpy(), rtol=1e-10)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    assert repr(ours) == repr(theirs)
    # momentum=None: a cumulative average, and no bias
    ours, theirs = nn.BatchNorm1d(2, momentum=None, bias=False).double(), \
        torch.nn.BatchNorm1d(2, momentum=None, bias=False).double()
    for _ in range(3):
        x = normal((5, 2))
        ours(mt.tensor(x)), theirs(torch.tensor(x))
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-12)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())


# ---- schedulers --------------------------------------------------------------------------

def _schedule(make, opt_name, steps, module):
    p = module.zeros(2, requires_grad=True)
    opt = (module.optim.SGD([p], lr=0.1, momentum=0.9) if opt_name == "sgd"
           else module.optim.AdamW([p], lr=0.1))
    sched = make(module.optim.lr_scheduler, opt)
    lrs, moms = [opt.param_groups[0]["lr"]], []
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0].get("momentum", opt.param_groups[0].get("betas")))
    return lrs, moms, sched


SCHEDULES = {
    "StepLR": lambda L, o: L.StepLR(o, step_size=4, gamma=0.5),
    "MultiStepLR": lambda L, o: L.MultiStepLR(o, milestones=[3, 7, 7, 12], gamma=0.5),
    "ExponentialLR": lambda L, o: L.ExponentialLR(o, gamma=0.9),
    "LinearLR": lambda L, o: L.LinearLR(o, start_factor=0.1, total_iters=8),
    "ConstantLR": lambda L, o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "PolynomialLR": lambda L, o: L.PolynomialLR(o, total_iters=10, power=2.0),
    "MultiplicativeLR": lambda L, o: L.MultiplicativeLR(o, lambda e: 0.95),
    "CosineAnnealingWarmRestarts": lambda L, o: L.CosineAnnealingWarmRestarts(o, 4, 2, 0.001),
    "OneCycleLR": lambda L, o: L.OneCycleLR(o, max_lr=1.0, total_steps=25),
    "OneCycleLR_three_phase": lambda L, o: L.OneCycleLR(o, max_lr=1.0, total_steps=25,
                                                        three_phase=True, anneal_strategy="linear"),
    "SequentialLR_warmup_cosine": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, 0.1, 1.0, 5), L.CosineAnnealingLR(o, T_max=15, eta_min=0.01)], [5]),
    "SequentialLR_three": lambda L, o: L.SequentialLR(
        o, [L.ConstantLR(o, 0.5, 3), L.ExponentialLR(o, 0.9), L.StepLR(o, 3, 0.5)], [4, 10]),
    "CyclicLR_triangular2": lambda L, o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3,
                                                    step_size_down=5, mode="triangular2"),
    "CyclicLR_exp_range": lambda L, o: L.CyclicLR(o, [0.01], 0.1, step_size_up=4,
                                                  mode="exp_range", gamma=0.97),
    "ChainedScheduler": lambda L, o: L.ChainedScheduler([L.ConstantLR(o, 0.5, 3),
                                                         L.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_schedulers_match_torch(name, opt_name):
    make = SCHEDULES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, our_moms, _ = _schedule(make, opt_name, 24, mt)
        theirs, their_moms, _ = _schedule(make, opt_name, 24, torch)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)
    assert [tuple(m) if isinstance(m, tuple) else m for m in our_moms] == \
        [tuple(m) if isinstance(m, tuple) else m for m in their_moms]


def test_reduce_lr_on_plateau_matches_torch():
    metrics = [1.0, 0.9, 0.9, 0.95, 0.91, 0.9, 0.92, 0.8, 0.85, 0.85, 0.85, 0.85, 0.9]
    lrs = []
    for module in (mt, torch):
        p = module.zeros(1, requires_grad=True)
        opt = module.optim.SGD([p], lr=1.0)
        sched = module.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=2, factor=0.5,
                                                            cooldown=1)
        seen = []
        for m in metrics:
            sched.step(m)
            seen.append(opt.param_groups[0]["lr"])
        lrs.append(seen)
    assert lrs[0] == lrs[1]


def test_scheduler_state_round_trips_through_a_checkpoint(tmp_path):
    p = mt.zeros(2, requires_grad=True)
    opt = mt.optim.SGD([p], lr=0.1)
    L = mt.optim.lr_scheduler
    sched = L.SequentialLR(opt, [L.LinearLR(opt, 0.1, 1.0, 3), L.StepLR(opt, 2)], [3])
    for _ in range(4):
        opt.step()
        sched.step()
    mt.save({"sched": sched.state_dict(), "opt": opt.state_dict()}, tmp_path / "s.ckpt")
    ck = mt.load(tmp_path / "s.ckpt")
    p2 = mt.zeros(2, requires_grad=True)
    opt2 = mt.optim.SGD([p2], lr=0.1)
    sched2 = L.SequentialLR(opt2, [L.LinearLR(opt2, 0.1, 1.0, 3), L.StepLR(opt2, 2)], [3])
    sched2.load_state_dict(ck["sched"])
    opt2.load_state_dict(ck["opt"])
    for _ in range(5):
        opt.step(), opt2.step()
        sched.step(), sched2.step()
        assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


# ---- dialect switches --------------------------------------------------------------------

def test_default_dtype_and_print_options():
    assert mt.get_default_dtype() == mt.float32
    mt.set_default_dtype(mt.float32)
    with pytest.raises(TypeError):
        mt.set_default_dtype(mt.int64)
    mt.set_printoptions(precision=2)
    assert dialect.PRINT_OPTIONS["precision"] == 2
    mt.set_printoptions(profile="default")
    with pytest.raises(ValueError):
        mt.set_printoptions(precision=-1)
    mt.set_float32_matmul_precision("high")
    assert mt.get_float32_matmul_precision() == "high"
    mt.set_float32_matmul_precision("highest")
    with pytest.raises(ValueError):
        mt.set_float32_matmul_precision("fast")


def test_set_default_dtype_float64_as_torch():
    """Needs the core's default-dtype setter (microtensor.core._core.set_default_float_dtype)."""
    try:
        mt.set_default_dtype(mt.float64)
        assert mt.tensor(1.5).dtype == mt.float64 and mt.zeros(2).dtype == mt.float64
        assert mt.get_default_dtype() == mt.float64
    finally:
        if hasattr(mt.core._core, "set_default_float_dtype"):
            mt.set_default_dtype(mt.float32)
    assert mt.tensor(1.5).dtype == mt.float32


def test_backends_and_amp_are_cpu_pass_throughs():
    mt.backends.cuda.matmul.allow_tf32 = True
    mt.backends.cudnn.allow_tf32 = True
    assert mt.backends.mps.is_available() is False
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = mt.amp.GradScaler(enabled=True)
    scaler = mt.amp.GradScaler(enabled=False)
    p = mt.ones(2, requires_grad=True)
    opt = mt.optim.SGD([p], lr=0.5)
    loss = (p * p).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    np.testing.assert_allclose(p.numpy(), [0.0, 0.0])
    with mt.amp.autocast(device_type="cpu", dtype=mt.float32):
        pass
    with pytest.raises(RuntimeError, match="cuda"):
        mt.amp.autocast(device_type="cuda")


# ---- the core's device and dtype dialect (what a torch script types) ---------------------

def test_device_argument_and_cuda_switches():
    """nanoGPT's spelling. Needs the core: device= on creation functions, Tensor.to(device),
    mt.device, mt.cuda.is_available()."""
    assert hasattr(mt, "device"), "mt.device is missing (core)"
    assert hasattr(mt, "cuda") and mt.cuda.is_available() is False, "mt.cuda.is_available (core)"
    pos = mt.arange(0, 5, dtype=mt.long, device="cpu")
    assert pos.tolist() == [0, 1, 2, 3, 4] and pos.dtype == mt.int64
    x = mt.zeros(2, 3, device=mt.device("cpu"))
    assert x.to("cpu") is x or np.array_equal(x.to("cpu").numpy(), x.numpy())
    assert x.device.type == "cpu" if hasattr(x.device, "type") else x.device == "cpu"
    with pytest.raises(RuntimeError, match="cuda"):
        mt.zeros(2, device="cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        x.to("cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        nn.Linear(2, 2).to("cuda")
    assert nn.Linear(2, 2).to("cpu") is not None
    assert mt.tensor([1, 2], dtype=mt.long, device="cpu").tolist() == [1, 2]
    assert mt.eye(2, device="cpu").shape == (2, 2)


def test_dtype_objects_print_as_mt_dtypes():
    """Needs the core: dtype objects that print as mt.float32 and compare with t.dtype."""
    assert str(mt.float32) == "mt.float32", f"str(mt.float32) is {str(mt.float32)!r}"
    assert mt.randn(2).dtype == mt.float32 and mt.arange(3).dtype == mt.long
    assert str(mt.ones(1, dtype=mt.float64).dtype) == "mt.float64"


def test_floor_divide_and_remainder_operators():
    """Needs the core: // and % with torch's (floor) semantics."""
    a, b = np.array([7.0, -7.0, 7.5, -0.5]), np.array([2.0, 2.0, -2.0, 3.0])
    _same(mt.tensor(a) // mt.tensor(b), torch.tensor(a) // torch.tensor(b))
    _same(mt.tensor(a) % mt.tensor(b), torch.tensor(a) % torch.tensor(b))
    _same(mt.tensor([7, -7]) // 2, torch.tensor([7, -7]) // 2)


# ---- the coverage table ------------------------------------------------------------------

def test_docs_api_md_is_generated_from_the_code():
    """docs/API.md is what `python -m microtensor.coverage --write` gives for this code."""
    from pathlib import Path
    from microtensor import coverage
    path = Path(__file__).resolve().parents[1] / "docs" / "API.md"
    assert path.read_text(encoding="utf-8") == coverage.render(), (
        "docs/API.md is stale: run `python -m microtensor.coverage --write`")
    rows = coverage.rows()
    assert len(rows) >= 200 and len({(r[0], r[1]) for r in rows}) == len(rows)
    # the table can say no: a name that does not exist is reported missing
    assert coverage._resolve("torch", "no_such_function") is None
    assert coverage._resolve("Tensor", "cumsum") is not None


# ---- binary min / max, tile(*dims), flip(dims=) ----------------------------------------

@pytest.mark.parametrize("form", ["function", "method"])
@pytest.mark.parametrize("which", ["max", "min"])
def test_binary_min_max_with_gradients_at_ties(form, which):
    # ties (a == b) are the kink: torch gives each side half the gradient
    a = np.array([[1.0, -2.0, 3.0, 0.5], [4.0, 4.0, -1.0, 2.0]])
    b = np.array([1.0, 5.0, -3.0, 0.5])                      # broadcast over rows
    up = rng.standard_normal((2, 4))
    res = []
    for lib in (mt, torch):
        x = lib.tensor(a, requires_grad=True)
        y = lib.tensor(b, requires_grad=True)
        out = getattr(lib, which)(x, y) if form == "function" else getattr(x, which)(y)
        (out * lib.tensor(up)).sum().backward()
        res.append((out.detach().numpy(), x.grad.numpy(), y.grad.numpy()))
    for ours, theirs in zip(*res):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-15)
    xa = mt.tensor(normal((3, 4)), requires_grad=True)
    yb = mt.tensor(normal((3, 4)), requires_grad=True)
    assert mt.gradcheck(lambda p, q: getattr(mt, which)(p, q), [xa, yb])
    # the reductions are unchanged
    assert getattr(mt, which)(mt.tensor(a)).item() == getattr(torch, which)(torch.tensor(a)).item()
    v, i = getattr(mt.tensor(a), which)(1)
    tv, ti = getattr(torch.tensor(a), which)(1)
    np.testing.assert_array_equal(v.numpy(), tv.numpy())


@pytest.mark.parametrize("call", [
    lambda lib, t: t.tile(2, 3), lambda lib, t: t.tile((2, 3)), lambda lib, t: t.tile([2]),
    lambda lib, t: lib.tile(t, (2, 1, 2)), lambda lib, t: lib.tile(t, dims=(3,)),
    lambda lib, t: t.tile(2, 1, 1),
])
def test_tile_spellings(call):
    a = normal((2, 3))
    x, tx = mt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    out, tout = call(mt, x), call(torch, tx)
    _same(out.detach(), tout.detach())
    up = normal(tuple(tout.shape))
    (out * mt.tensor(up)).sum().backward()
    (tout * torch.tensor(up)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy())


@pytest.mark.parametrize("call", [
    lambda lib, t: lib.flip(t, dims=[0]), lambda lib, t: lib.flip(t, dims=(0, 2)),
    lambda lib, t: t.flip(dims=[1]), lambda lib, t: t.flip(2), lambda lib, t: t.flip(0, 1),
    lambda lib, t: lib.flip(t, [-1]),
])
def test_flip_spellings(call):
    a = normal((2, 3, 4))
    x, tx = mt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    _same(call(mt, x).detach(), call(torch, tx).detach())
    up = normal((2, 3, 4))
    (call(mt, x) * mt.tensor(up)).sum().backward()
    (call(torch, tx) * torch.tensor(up)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy())


def test_flip_and_tile_refuse_dims_given_twice():
    with pytest.raises(TypeError):
        mt.flip(mt.ones(2, 2), 0, dims=[1])
    with pytest.raises(TypeError):
        mt.ones(2).tile(2, dims=(2,))


# ---- in-place operators through views ---------------------------------------------------

INPLACE_STATEMENTS = [
    "a[1] += b", "a[:, 0] *= 2", "a[1:, ::2] -= 0.5", "v = a[0]; v += b",
    "v = a.view(12); v[3] /= 4", "v = a.t(); v[1] *= -1", "a += 1; a[2] **= 2",
    "v = a; v -= b", "a[..., 1] //= 2", "a[0, 1:3] %= 0.75", "v = a[1]; v.add_(b)",
    "v = a.reshape(2, 6); v[1] += 3",
]


@pytest.mark.parametrize("statement", INPLACE_STATEMENTS)
def test_inplace_operators_write_through_views_as_torch(statement):
    start = normal((3, 4))
    got = {}
    for lib in (mt, torch):
        scope = {"a": lib.tensor(start), "b": lib.tensor(np.arange(4.0))}
        a = scope["a"]
        exec(statement, scope)
        assert scope["a"] is a                      # the name still holds the same tensor
        got[lib] = (a.numpy().copy(), a._version)
    np.testing.assert_allclose(got[mt][0], got[torch][0], rtol=1e-12)
    assert got[mt][1] == got[torch][1], "version counter"


def test_inplace_operator_bumps_the_version_a_saved_tensor_checks():
    x = mt.ones(3, requires_grad=True)
    h = x * 2.0
    y = h.exp()                                     # saves its output
    with mt.no_grad():
        y[1] *= 2.0                                 # through a view of y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_operators_refuse_what_torch_refuses():
    for lib in (mt, torch):
        i = lib.tensor([1, 2, 3])
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
            i /= 2
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
            i += 0.5
        s = lib.zeros(3)
        with pytest.raises(RuntimeError):
            s += lib.ones(2, 3)                     # would have to grow
        w = lib.ones(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            w += 1
    i = mt.tensor([1, 2, 3])
    i //= 2
    np.testing.assert_array_equal(i.numpy(), [0, 1, 1])


def test_inplace_operators_under_autograd():
    # y += x on a non-leaf: the right gradient (the name takes the new value, as torch)
    for lib in (mt, torch):
        w = lib.tensor([1.0, 2.0, 3.0], requires_grad=True)
        loss = (w * w).sum()
        loss += (w * 3).sum()
        loss *= 2
        loss.backward()
        np.testing.assert_allclose(w.grad.numpy(), [10.0, 14.0, 18.0])
    # where microtensor records no in-place op, it refuses rather than lose a gradient
    w = mt.ones(4, requires_grad=True)
    buf = mt.zeros(2, 4)
    with pytest.raises(RuntimeError, match="index assignment"):
        buf[1] += w * 2
    with pytest.raises(RuntimeError, match="index assignment"):
        buf[0] = w


# ---- t.stride(): the layout in torch's units --------------------------------------------

_LAYOUTS = {
    "contiguous": lambda m, t: t,
    "transpose": lambda m, t: t.transpose(0, 2),
    "permute": lambda m, t: t.permute(2, 0, 1),
    "mT": lambda m, t: t.mT,
    "step slice": lambda m, t: t[1:, ::2, 1::3],
    "narrow": lambda m, t: t.narrow(2, 1, 3),
    "select": lambda m, t: t[:, 1],
    "unsqueeze": lambda m, t: t.unsqueeze(1),
    "expand": lambda m, t: t[:, :1].expand(3, 4, 5),
    "view of a permute's copy": lambda m, t: t.permute(1, 0, 2).contiguous().view(4, 15),
    "chunk": lambda m, t: t.chunk(2, dim=2)[1],
    "unbind": lambda m, t: t.unbind(1)[2],
    "size-1 dims": lambda m, t: t[:1, :, :1],
    "empty rows": lambda m, t: t[:0],
    "empty middle": lambda m, t: t[:, 2:2],
    "0-d": lambda m, t: t[1, 2, 3],
    "new and empty": lambda m, t: m.zeros(3, 0, 5, dtype=t.dtype),
    "new, empty last": lambda m, t: m.ones(2, 0, dtype=t.dtype),
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bool"])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_stride_is_torchs_for_every_layout(layout, dtype):
    x = np.arange(60).reshape(3, 4, 5).astype(dtype)
    ours = _LAYOUTS[layout](mt, mt.tensor(x))
    theirs = _LAYOUTS[layout](torch, torch.tensor(x))
    assert ours.shape == tuple(theirs.shape)
    assert ours.stride() == theirs.stride(), layout
    for d in range(-ours.ndim, ours.ndim):
        assert ours.stride(d) == theirs.stride(d), (layout, d)
        assert type(ours.stride(d)) is int


def test_stride_refuses_a_dim_out_of_range_or_not_an_integer():
    t = mt.zeros(2, 3)
    for bad in (2, -3, 100):
        with pytest.raises(IndexError, match="out of range"):
            t.stride(bad)
    for bad in (1.0, "0", (0,), True):
        with pytest.raises(TypeError, match="integer"):
            t.stride(bad)
    with pytest.raises(IndexError, match="no dimensions"):
        mt.tensor(1.0).stride(0)
    assert mt.tensor(1.0).stride() == () and t.stride(np.int64(1)) == 1
