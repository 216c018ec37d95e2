"""F's losses: cross_entropy (one fused node, torch's logits/target layouts plus
class dim last), nll_loss (from differentiable ops) and mse_loss (one node), the
Backward node right above its forward function.
The kernels are read from `_kernels.fused` at call time: microtensor/ops/_kernels.py holds
the build chosen at import (and a test may swap it there).
"""
import math

import numpy as np

from microtensor.core._core import Tensor, Node, wrap, needs_graph, attach, ShapeError, register_ops
import microtensor.core._core as _core
from microtensor.autograd.graph_rules import _wants, _const, DifferentiableRule
from microtensor.ops.activations import softmax, log_softmax
from microtensor.ops import _kernels
from microtensor.core._core import ArgumentError
from microtensor.ops import extra as _ops
from microtensor.ops._common import _tensor
from microtensor.ops._functional_common import (
    DtypeError, declare_saved, _float_array, _contig, _owned_indices, _threads,
    _check_reduction,
)


# ---- losses ----------------------------------------------------------------------

def _ce_rows(x, t, op):
    """Logits and targets as (M, C) rows and (M,) targets, following torch's layouts:
    (C,) with (); (N, C) with (N,); (N, C, d1, ...) with (N, d1, ...) (class dim second).
    Also accepted: (..., C) with (...) (class dim last, e.g. (B, T, V) with (B, T));
    when both readings fit, torch's (class dim second) wins. Returns (rows, targets,
    out_shape, how) where `how` says how to map row gradients back."""
    if x.ndim == 0:
        raise ShapeError(f"{op}: input must have a class dimension, got shape {x.shape}")
    if x.ndim == 1:
        if t.shape != ():
            raise ShapeError(f"{op}: input shape {x.shape} needs a 0-d target, got target "
                             f"shape {t.shape}")
        return x.reshape(1, -1), t.reshape(1), (), "last"
    if x.ndim == 2 or t.shape == (x.shape[0],) + x.shape[2:]:
        if t.shape != (x.shape[0],) + x.shape[2:]:
            raise ShapeError(f"{op}: input shape {x.shape} and target shape {t.shape} do not "
                             f"fit (expected target shape {(x.shape[0],) + x.shape[2:]})")
        if x.ndim == 2:
            return x, t, t.shape, "last"
        rows = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])
        return rows, t.reshape(-1), t.shape, "second"
    if t.shape == x.shape[:-1]:
        return x.reshape(-1, x.shape[-1]), t.reshape(-1), t.shape, "last"
    raise ShapeError(f"{op}: input shape {x.shape} and target shape {t.shape} do not fit "
                     f"(expected target shape {(x.shape[0],) + x.shape[2:]}, class dim second, "
                     f"or {x.shape[:-1]}, class dim last)")


class CrossEntropyBackward(Node):
    """loss_i = logsumexp(x_i) - x_i[t_i];  dx_i = g_i * (softmax(x_i) - onehot(t_i)),
    g_i = 0 on ignored rows, divided by the number of counted rows for 'mean'
    (kernel: crossentropy_backward, which recomputes softmax from the saved log-sum-exp,
    kept as the pair (rowmax, logsum): exp((x - rowmax) - logsum))"""

    def backward(self, g):
        rows = self.rows                                 # (M, C)
        M, C = rows.shape
        if self.reduction == "none":
            dlosses = np.ascontiguousarray(np.broadcast_to(g, self.out_shape), dtype=rows.dtype).reshape(-1)
        else:
            # (with every target ignored nothing flows back: the kernel zeroes those rows)
            scale = float(g) / max(self.count, 1) if self.reduction == "mean" else float(g)
            dlosses = np.full(M, scale, dtype=rows.dtype)
        dlogits = np.empty_like(rows)
        if rows.size:
            _kernels.fused.crossentropy_backward(dlogits, dlosses, rows, self.rowmax, self.logsum,
                                         self.tgt, self.ignore_index, self.label_smoothing,
                                         _threads(rows.size))
        if self.how == "second":                         # (N*d, C) -> (N, C, d...)
            x_shape = self.x_shape
            dlogits = np.moveaxis(dlogits.reshape((x_shape[0],) + x_shape[2:] + (x_shape[1],)), -1, 1)
        return (dlogits.reshape(self.x_shape), None)

    def create_graph(self, g):
        """loss_i = logsumexp(x_i) - x_i[t_i];  dx_i = g_i (softmax(x_i) - q_i),
        q_i = (1 - eps) onehot(t_i) + eps / C;  0 on ignored rows, / count for 'mean'"""
        x = self.inputs[0]
        M, n_class = self.rows.shape
        if self.how == "second":                               # (N, C, d...) -> (N, d..., C)
            nd = len(self.x_shape)
            rows = _core.reshape(_core.permute(x, (0,) + tuple(range(2, nd)) + (1,)), (M, n_class))
        else:
            rows = _core.reshape(x, (M, n_class))
        dtype = g.dtype
        keep = self.tgt != self.ignore_index
        target = np.zeros((M, n_class), dtype=dtype)
        target[np.arange(M)[keep], self.tgt[keep]] = 1 - self.label_smoothing
        target[keep] += self.label_smoothing / n_class
        if self.reduction == "none":
            dloss = _core.mul(_core.reshape(g, (M, 1)), _const(keep[:, None], dtype))
        else:
            scale = 1.0 / max(self.count, 1) if self.reduction == "mean" else 1.0
            dloss = _core.mul(g, _const(keep[:, None] * scale, dtype))          # (M, 1)
        drows = _core.mul(_core.sub(softmax(rows, -1), target), dloss)
        if self.how == "second":
            x_shape = self.x_shape
            moved = _core.reshape(drows, (x_shape[0],) + tuple(x_shape[2:]) + (x_shape[1],))
            nd = len(x_shape)
            return (_core.permute(moved, (0, nd - 1) + tuple(range(1, nd - 1))), None)
        return (_core.reshape(drows, self.x_shape), None)


declare_saved(CrossEntropyBackward, 0)


def _kept_targets(tgt, C, ignore_index):
    """The mask of the targets not equal to ignore_index; IndexError naming the first
    of them that is not a class of C."""
    keep = tgt != ignore_index
    bad = keep & ((tgt < 0) | (tgt >= C))
    if bad.any():
        v = int(tgt[np.argmax(bad)])
        raise IndexError(f"cross_entropy: target {v} is out of bounds for {C} classes "
                         f"(valid: 0 to {C - 1}, or ignore_index={ignore_index})")
    return keep


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0):
    """loss = -log softmax(x)[target], averaged over the targets that are not ignore_index

    Layouts as torch: logits (N, C) with target (N,), (C,) with (), (N, C, d...) with
    (N, d...); also (..., C) with (...) (e.g. (B, T, V) logits with (B, T) targets)."""
    x = _float_array(input, "cross_entropy input")
    _check_reduction(reduction)
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    t = target._data if isinstance(target, Tensor) else np.asarray(target)
    if t.dtype.kind == "f" and x.ndim >= 1 and t.shape == x.shape:
        if ignore_index != -100:
            raise ArgumentError("ignore_index is not supported for floating point target")
        return _cross_entropy_probs(input, target, weight, reduction, label_smoothing)
    _check_target(x, t)
    if weight is not None:
        return _cross_entropy_weighted(input, t, weight, ignore_index, reduction,
                                       label_smoothing)
    rows, tgt, out_shape, how = _ce_rows(x, t, "cross_entropy")
    rows = _contig(rows)                                 # (M, C)
    tgt = _owned_indices(tgt)                            # (M,), checked below, kept for backward
    M, C = rows.shape
    if M and 0 <= tgt.min() and tgt.max() < C and not 0 <= ignore_index < C:
        count = M                       # every target a class, none ignored (the usual case)
    else:
        count = int(_kept_targets(tgt, C, ignore_index).sum())
    losses = np.empty(M, x.dtype)
    rowmax = np.empty(M, x.dtype)                        # each row's log-sum-exp as the
    logsum = np.empty(M, x.dtype)                        # pair (max, log-sum), never added
    if rows.size:
        _kernels.fused.crossentropy_forward(losses, rowmax, logsum, rows, tgt, int(ignore_index),
                                    float(label_smoothing), _threads(rows.size))
    else:
        losses[:] = 0
    if reduction == "none":
        out = losses.reshape(out_shape)
    elif reduction == "sum":
        out = np.asarray(losses.sum(dtype=np.float64), dtype=x.dtype)
    elif count:
        out = np.asarray(losses.sum(dtype=np.float64) / count, dtype=x.dtype)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):   # all ignored: nan, as torch
            out = np.asarray(losses.sum(dtype=np.float64) / count, dtype=x.dtype)
    out = wrap(out)
    if needs_graph((input,)):
        node = CrossEntropyBackward()
        node.rows, node.tgt, node.rowmax, node.logsum = rows, tgt, rowmax, logsum
        node.reduction, node.count, node.how = reduction, count, how
        node.x_shape, node.out_shape = x.shape, out_shape
        node.ignore_index, node.label_smoothing = int(ignore_index), float(label_smoothing)
        attach(out, node, (input, None))
    return out


def _check_target(x, t):
    """A class-index target: an integer dtype, not the input's shape (that is for
    probabilities), with torch's exception classes and words."""
    names = {"f": "Float", "b": "Bool", "c": "ComplexFloat"}
    if t.dtype.kind not in "iu":
        raise DtypeError(f"expected target dtype to be Long or Byte, but got "
                         f"{names.get(t.dtype.kind, str(t.dtype))} (cross_entropy: a class-index "
                         f"target is int64; a probability target is float, of the input's "
                         f"shape {x.shape}, got target shape {t.shape})")
    if x.ndim >= 1 and t.shape == x.shape:
        raise DtypeError("Expected floating point type for target with class probabilities, got "
                         f"Long (cross_entropy: target dtype {t.dtype}, shape {t.shape})")
    if x.ndim >= 2 and t.ndim >= 1 and t.shape[0] != x.shape[0] and t.ndim == x.ndim - 1:
        raise ShapeError(f"Expected input batch_size ({x.shape[0]}) to match target batch_size "
                         f"({t.shape[0]}). (cross_entropy: input shape {x.shape}, target "
                         f"shape {t.shape})")


def _class_weight(weight, n_classes, ndim_after):
    w = weight if isinstance(weight, Tensor) else wrap(np.asarray(weight))
    if w.ndim != 1 or w.shape[0] != n_classes:
        raise ShapeError(f"cross_entropy: weight tensor should be defined either for all "
                         f"{n_classes} classes or no classes but got weight tensor of "
                         f"shape: {list(w.shape)}")
    from microtensor.core import _core as C
    return C.reshape(w, (n_classes,) + (1,) * ndim_after)


def _cross_entropy_weighted(input, t, weight, ignore_index, reduction, label_smoothing):
    """Class-index targets with class weights, as torch: loss_n = -(1 - s) w[t_n] logp[n, t_n]
    - (s / C) sum_c w_c logp[n, c], ignored rows zero; 'mean' divides by the sum of
    w[t_n] over the counted rows. From differentiable ops (the fused kernel has no weights)."""
    from microtensor.core import _core as C
    x = input if isinstance(input, Tensor) else wrap(np.asarray(input))
    rows, tgt, out_shape, how = _ce_rows(x._data, t, "cross_entropy")
    dim = 1 if x.ndim >= 2 else 0
    n_classes = x.shape[dim]
    keep = _kept_targets(tgt, n_classes, ignore_index)
    tt = np.where(keep, tgt, 0).reshape(out_shape)
    mask = (np.expand_dims(tt, dim) == np.arange(n_classes).reshape(
        (n_classes,) + (1,) * (x.ndim - dim - 1))) & np.expand_dims(keep.reshape(out_shape), dim)
    w = _class_weight(weight, n_classes, x.ndim - dim - 1)
    logp_w = C.mul(log_softmax(x, dim), w)
    nll = C.neg(C.sum(C.mul(logp_w, wrap(mask.astype(x.dtype))), dim))
    losses = C.mul(nll, 1.0 - label_smoothing)
    if label_smoothing > 0:
        smooth = C.neg(C.sum(logp_w, dim))
        smooth = C.mul(smooth, wrap((keep.reshape(out_shape) * (label_smoothing / n_classes))
                                    .astype(x.dtype)))
        losses = C.add(losses, smooth)
    if reduction == "none":
        return losses
    total = C.sum(losses)
    if reduction == "sum":
        return total
    if not keep.any():
        return _nan_with_zero_grad(total)
    counted = C.sum(C.mul(C.reshape(w, (n_classes,) + (1,) * (x.ndim - dim - 1)),
                          wrap(mask.astype(x.dtype))))
    # only the counted rows are divided (an ignored row's gradient stays 0, also when the
    # counted weights sum to 0 and the others are NaN, as torch)
    if losses.ndim:
        total = C.sum(losses[np.nonzero(keep.reshape(out_shape))])
    return C.div(total, counted)


def _nan_with_zero_grad(total):
    """'mean' over no counted target, as torch: the loss is NaN (0 / 0) and the gradient
    exactly 0 (nothing was counted), not NaN (a division by 0 in the backward)."""
    from microtensor.core import _core as C
    return C.add(C.mul(total, 0.0), float("nan"))


def _cross_entropy_probs(input, target, weight, reduction, label_smoothing):
    """Probability ("soft") targets, as torch: loss = -sum_c w_c y_c log_softmax(x)_c over
    the class dim (dim 1, or 0 for a 1-D input), y = (1 - s) y + s / C with smoothing s;
    'mean' divides by the number of rows (not by the weights). Built from differentiable
    ops, so the target gets a gradient too and create_graph works through it."""
    from microtensor.core import _core as C
    x = input if isinstance(input, Tensor) else wrap(np.asarray(input))
    y = target if isinstance(target, Tensor) else wrap(np.asarray(target))
    dim = 1 if x.ndim >= 2 else 0
    n_classes = x.shape[dim]
    if label_smoothing > 0:
        y = C.add(C.mul(y, 1.0 - label_smoothing), label_smoothing / n_classes)
    terms = C.mul(log_softmax(x, dim), y)
    if weight is not None:
        terms = C.mul(terms, _class_weight(weight, n_classes, x.ndim - dim - 1))
    losses = C.neg(C.sum(terms, dim))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return C.sum(losses)
    return C.mean(losses)


_LEGACY = {(True, True): "mean", (False, True): "sum"}


def _legacy_reduction(size_average, reduce, reduction):
    """torch's deprecated size_average / reduce, read as torch reads them."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else bool(size_average)
    reduce = True if reduce is None else bool(reduce)
    return _LEGACY.get((size_average, reduce), "none")


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """loss_n = -w[t_n] input[n, t_n] (input holds log-probabilities; w = 1 without weight),
    0 where t_n is ignore_index; 'mean' divides the sum by the sum of w[t_n] over the
    counted targets (NaN, with a zero gradient, when none is counted), as torch.
    Layouts: (C,) with (), (N, C) with (N,), (N, C, d1, ...) with (N, d1, ...)."""
    from microtensor.core import _core as C
    logp = _tensor(input, "nll_loss")
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction)
    t = target._data if isinstance(target, Tensor) else np.asarray(target)
    if t.dtype.kind not in "iu":
        raise DtypeError(f"nll_loss: target must be an integer (int64) tensor of class "
                         f"indices, got dtype {t.dtype}")
    t = np.array(t, dtype=np.int64, copy=True)          # private: checked once, then used
    want = () if logp.ndim == 1 else (logp.shape[0],) + tuple(logp.shape[2:])
    if logp.ndim == 0 or t.shape != want:
        raise ShapeError(f"nll_loss: input shape {logp.shape} and target shape {t.shape} do "
                         f"not fit (expected (C,) and (), (N, C) and (N,), or (N, C, d1, ...) "
                         f"and (N, d1, ...))")
    dim = 0 if logp.ndim == 1 else 1
    n_classes = logp.shape[dim]
    if weight is None:
        w = np.ones(n_classes, dtype=logp.dtype)
    else:
        w = np.asarray(weight._data if isinstance(weight, Tensor) else weight)
        if w.shape != (n_classes,):
            raise ShapeError(f"nll_loss: weight tensor should be defined either for all "
                             f"{n_classes} classes or no classes but got weight tensor of "
                             f"shape: {list(w.shape)}")
        w = w.astype(logp.dtype)
    keep = t != ignore_index
    bad = keep & ((t < 0) | (t >= n_classes))
    if bad.any():
        raise IndexError(f"nll_loss: target {int(t[bad][0])} is out of bounds for "
                         f"{n_classes} classes")
    if reduction == "none":
        tt = np.where(keep, t, 0)
        onehot = np.expand_dims(tt, dim) == np.arange(n_classes).reshape(
            (n_classes,) + (1,) * (logp.ndim - dim - 1))
        weights = onehot * np.expand_dims(keep * w[tt], dim)
        return C.neg(C.sum(C.mul(logp, wrap(weights.astype(logp.dtype))), dim))
    # sum / mean: only the counted entries are read, so only they receive a gradient
    tk = t[keep]                                         # (a 0-d keep gives 0 or 1 entries)
    if dim == 0:
        index = (tk,)
    else:
        where = np.nonzero(keep)
        index = (where[0], tk) + tuple(where[1:])
    wk = w[tk]
    if tk.size == 0:
        total = C.mul(C.sum(logp), 0.0)
        return total if reduction == "sum" else _nan_with_zero_grad(total)
    total = C.neg(C.sum(C.mul(logp[index], wrap(wk))))
    if reduction == "sum":
        return total
    return C.div(total, wrap(np.asarray(wk.sum(dtype=np.float64), dtype=logp.dtype)))


class MSELossBackward(DifferentiableRule):
    """loss = reduce((x - y)^2);  dx = 2 (x - y) g / n,  dy = -dx"""

    def create_graph(self, g):
        """loss = reduce((x - y)^2);  dx = 2 (x - y) g / n,  dy = -dx"""
        a, b = self.inputs
        diff = _core.sub(a, b)
        if self.reduction == "none":
            d = _core.mul(_core.mul(diff, g), 2.0)
        else:
            # (an empty input has an empty gradient: no division by its size of 0)
            n = max(diff.numel(), 1) if self.reduction == "mean" else 1
            d = _core.mul(diff, _core.mul(g, 2.0 / n))
        return (d if _wants(self, 0) else None, _core.neg(d) if _wants(self, 1) else None)


declare_saved(MSELossBackward, 0, 1)


def mse_loss(input, target, reduction="mean"):
    """loss = mean((input - target)^2)  (or sum, or elementwise with 'none')"""
    a = _float_array(input, "mse_loss input")
    b = _float_array(target, "mse_loss target")
    _check_reduction(reduction)
    try:
        diff = np.asarray(a - b)                        # (an array also when 0-d)
    except ValueError:
        raise ShapeError(f"mse_loss: input shape {a.shape} and target shape {b.shape} cannot "
                         "be broadcast together") from None
    if reduction == "none":
        out = np.asarray(diff * diff)
    elif reduction == "sum":
        out = np.asarray(np.sum(diff * diff), dtype=diff.dtype)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):   # empty: NaN, as torch
            out = np.asarray(np.mean(diff * diff) if diff.size else np.nan, dtype=diff.dtype)
    out = wrap(out)
    inputs = (input, target)
    if needs_graph(inputs):
        node = MSELossBackward()
        node.reduction = reduction
        attach(out, node, inputs)
    return out


# ---- the other losses: compositions of differentiable ops, and binary cross-entropy (one node) --

def _reduce(loss, reduction, op):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return _core.sum(loss)
    if reduction == "mean":
        return _core.mean(loss)
    raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _same_shape(input, target, op):
    if tuple(input.shape) != tuple(target.shape):
        raise ShapeError(f"{op}: Using a target size ({tuple(target.shape)}) that is different "
                         f"to the input size ({tuple(input.shape)}) is not allowed")


class BinaryCrossEntropyBackward(DifferentiableRule):
    """l = -w (t log x + (1-t) log(1-x));  dx = w (x - t) / max(x (1-x), 1e-12) g,
    dt = w (log(1-x) - log x) g   (logs clamped at -100, as torch)"""

    def create_graph(self, g):
        """l = -w (t log x + (1-t) log(1-x));  dx = w (x - t) / max(x (1-x), 1e-12) g,
        dt = w (log(1-x) - log x) g   (logs clamped at -100, as the forward)"""
        x, t = self.inputs
        xa = self.x
        if self.reduction == "mean":
            g = _core.div(g, float(xa.size))
        x = x if x is not None else wrap(xa)
        t = t if t is not None else wrap(self.t)
        w = _const(self.w, g.dtype)
        dx = dt = None
        if _wants(self, 0):
            tiny = xa * (1 - xa) < 1e-12
            denom = _core.where(tiny, 1e-12, _core.mul(x, _core.sub(1.0, x)))
            dx = _core.mul(_core.div(_core.mul(_core.sub(x, t), w), denom), g)
        if _wants(self, 1):
            def clamped_log(v, low):                  # log(v), -100 where it is below -100
                return _core.where(low, -100.0, _core.log(_core.where(low, 1.0, v)))
            log_x = clamped_log(x, self.logx <= -100)
            log_1mx = clamped_log(_core.sub(1.0, x), self.log1mx <= -100)
            dt = _core.mul(_core.mul(_core.sub(log_1mx, log_x), w), g)
        return (dx, dt)


declare_saved(BinaryCrossEntropyBackward, 0, 1)


def binary_cross_entropy(input, target, weight=None, reduction="mean"):
    """-w (t log x + (1-t) log(1-x)) with x in [0, 1]"""
    x, t = _tensor(input, "binary_cross_entropy"), _tensor(target, "binary_cross_entropy", "target")
    _same_shape(x, t, "binary_cross_entropy")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"binary_cross_entropy: reduction must be 'mean', 'sum' or 'none', "
                         f"got {reduction!r}")
    xa = x._data
    if xa.dtype.kind != "f":
        raise TypeError(f"binary_cross_entropy: input must be floating, got {xa.dtype}")
    if xa.size and not ((xa >= 0) & (xa <= 1)).all():
        raise RuntimeError("all elements of input should be between 0 and 1")
    ta = t._data.astype(xa.dtype, copy=False)
    w = np.asarray(1.0 if weight is None else _ops._array(weight), dtype=xa.dtype)
    with np.errstate(divide="ignore"):
        logx = np.maximum(np.log(xa), -100)
        log1mx = np.maximum(np.log1p(-xa), -100)
    loss = -w * (ta * logx + (1 - ta) * log1mx)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.mean() if loss.size else np.asarray(np.nan)
    out = wrap(np.asarray(loss, dtype=xa.dtype))
    inputs = (x, t)
    if needs_graph(inputs):
        node = BinaryCrossEntropyBackward()
        node.x, node.t, node.w = xa, ta, np.broadcast_to(w, xa.shape)
        node.logx, node.log1mx, node.reduction = logx, log1mx, reduction
        attach(out, node, inputs)
    return out


def binary_cross_entropy_with_logits(input, target, weight=None, reduction="mean",
                                     pos_weight=None):
    """(1 - t) x + (1 + (pos_weight - 1) t) softplus(-x), times weight; exact for any x"""
    x, t = _tensor(input, "binary_cross_entropy_with_logits"), target
    _same_shape(x, t, "binary_cross_entropy_with_logits")
    sp = _ops.softplus(_core.neg(x), threshold=math.inf)           # log(1 + e^-x)
    if pos_weight is not None:
        sp = _core.mul(_core.add(_core.mul(_core.sub(pos_weight, 1), t), 1), sp)
    loss = _core.add(_core.mul(_core.sub(1, t), x), sp)
    if weight is not None:
        loss = _core.mul(loss, weight)
    return _reduce(loss, reduction, "binary_cross_entropy_with_logits")


def l1_loss(input, target, reduction="mean"):
    """|x - y|, reduced"""
    _same_shape(input, target, "l1_loss")
    return _reduce(_core.abs(_core.sub(input, target)), reduction, "l1_loss")


def smooth_l1_loss(input, target, reduction="mean", beta=1.0):
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta  (d = x - y)"""
    _same_shape(input, target, "smooth_l1_loss")
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    d = _core.sub(input, target)
    a = _core.abs(d)
    if beta == 0:
        return _reduce(a, reduction, "smooth_l1_loss")
    loss = _core.where(_core.lt(a, beta), _core.mul(_core.mul(d, d), 0.5 / beta),
                       _core.sub(a, 0.5 * beta))
    return _reduce(loss, reduction, "smooth_l1_loss")


def huber_loss(input, target, reduction="mean", delta=1.0):
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta)"""
    _same_shape(input, target, "huber_loss")
    d = _core.sub(input, target)
    a = _core.abs(d)
    loss = _core.where(_core.lt(a, delta), _core.mul(_core.mul(d, d), 0.5),
                       _core.mul(_core.sub(a, 0.5 * delta), delta))
    return _reduce(loss, reduction, "huber_loss")


def kl_div(input, target, reduction="mean", log_target=False):
    """target (log target - input), input holding log-probabilities; 'batchmean' divides
    the sum by the batch size (the true KL divergence)"""
    if log_target:
        loss = _core.mul(_core.exp(target), _core.sub(target, input))
    else:
        loss = _core.sub(_ops.xlogy(target, target), _core.mul(target, input))
    if reduction == "batchmean":
        return _core.div(_core.sum(loss), input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction, "kl_div")


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("fused", globals(), "cross_entropy nll_loss mse_loss", scope="F")
register_ops("fused", globals(), """
    binary_cross_entropy binary_cross_entropy_with_logits huber_loss kl_div l1_loss
    smooth_l1_loss""", scope="F")
