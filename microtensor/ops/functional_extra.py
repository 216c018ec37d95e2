"""More of torch.nn.functional: padding, one-hot, the other losses, the other activations,
normalize, batch_norm. Imported into `microtensor.nn.functional` (so `F.pad` etc.).

All are compositions of differentiable primitives (the core's and microtensor.ops_*),
except constant padding and binary cross-entropy, which are one node each with the
backward under the forward.
"""
import math

import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, Node, wrap, needs_graph, attach, ShapeError
from microtensor.autograd.graph_rules import _wants, _const, DifferentiableRule
from microtensor.ops import extra as _ops
from microtensor.ops._common import _tensor, _dim, declare_saved
from microtensor.ops.linalg import vector_norm
from microtensor.ops.activations import softmax as _softmax

__all__ = [
    "pad", "one_hot", "binary_cross_entropy", "binary_cross_entropy_with_logits", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "normalize", "softplus", "leaky_relu", "elu",
    "selu", "celu", "relu6", "hardtanh", "hardsigmoid", "hardswish", "mish", "logsigmoid",
    "softsign", "softmin", "tanhshrink", "glu", "cosine_similarity", "pairwise_distance",
    "batch_norm", "gumbel_softmax",
]


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


# ---- padding -------------------------------------------------------------------------

class ConstantPadBackward(DifferentiableRule):
    """y = value everywhere, y[inner] = x;  dx = g[inner]"""

    def create_graph(self, g):
        """y = value everywhere, y[inner] = x;  dx = g[inner]"""
        return (_core.getitem(g, self.inner),)


declare_saved(ConstantPadBackward)


def _pad_pairs(pad, ndim, op="pad"):
    """torch's pad tuple (last dim first: left, right, then the dim before...) as one
    (before, after) pair per dim of the input."""
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > ndim:
        raise ValueError(f"{op}: padding length must be even and at most twice the number of "
                         f"dims ({ndim}), got {len(pad)}")
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


def pad(input, pad, mode="constant", value=None):
    """Pad the last len(pad)//2 dims. Negative padding crops. Modes: constant, reflect,
    replicate, circular (the last three on at most the last 3 dims)."""
    x = _tensor(input, "pad")
    pairs = _pad_pairs(pad, x.ndim)
    # crop first (a slice), then pad with the positive amounts
    crop = tuple(slice(max(-b, 0), n - max(-a, 0)) for (b, a), n in zip(pairs, x.shape))
    for (b, a), n in zip(pairs, x.shape):
        if n + min(b, 0) + min(a, 0) < 0:
            raise RuntimeError(f"pad: padding {pad} would give a negative size for shape "
                               f"{tuple(x.shape)}")
    if any(b < 0 or a < 0 for b, a in pairs):
        x = _core.getitem(x, crop)
    pairs = [(max(b, 0), max(a, 0)) for b, a in pairs]
    if mode == "constant":
        fill = 0 if value is None else value
        out_shape = tuple(n + b + a for (b, a), n in zip(pairs, x.shape))
        y = np.full(out_shape, fill, dtype=x._data.dtype)
        inner = tuple(slice(b, b + n) for (b, _), n in zip(pairs, x.shape))
        y[inner] = x._data
        out = wrap(y)
        if needs_graph((x,)):
            node = ConstantPadBackward()
            node.inner = inner
            attach(out, node, (x,))
        return out
    if value not in (None, 0):
        raise ValueError(f"pad: padding mode {mode!r} doesn't take in value argument")
    for d, (b, a) in enumerate(pairs):
        if b == 0 and a == 0:
            continue
        n = x.shape[d]
        i = np.arange(-b, n + a)
        if mode == "replicate":
            index = np.clip(i, 0, n - 1)
        elif mode == "reflect":
            if b >= n or a >= n:
                raise RuntimeError(f"pad: padding size should be less than the corresponding "
                                   f"input dimension, but got padding ({b}, {a}) at dimension "
                                   f"{d} of size {n}")
            period = 2 * (n - 1)
            index = np.abs((i + period) % period if period else i * 0)
            index = np.where(index >= n, period - index, index)
        elif mode == "circular":
            if b > n or a > n:
                raise RuntimeError(f"pad: padding ({b}, {a}) is larger than dimension {d} "
                                   f"of size {n}")
            index = i % n
        else:
            raise NotImplementedError(f"pad: mode {mode!r} is not implemented")
        x = _core.getitem(x, (slice(None),) * d + (index,))
    return x


# ---- one-hot ---------------------------------------------------------------------------

def one_hot(tensor, num_classes=-1):
    """int64 (..., num_classes) with a 1 at each index (num_classes=-1: max + 1)."""
    t = _tensor(tensor, "one_hot")
    a = t._data
    if a.dtype.kind not in "iu":
        raise RuntimeError(f"one_hot is only applicable to index tensor of type int64, got "
                           f"{a.dtype}")
    if a.size and a.min() < 0:
        raise RuntimeError("one_hot: Class values must be non-negative.")
    if num_classes == -1:
        if a.size == 0:
            raise RuntimeError("one_hot: Can not infer total number of classes from empty "
                               "tensor.")
        num_classes = int(a.max()) + 1
    if a.size and a.max() >= num_classes:
        raise RuntimeError(f"one_hot: Class values must be smaller than num_classes "
                           f"({num_classes}), got {int(a.max())}")
    out = np.zeros(a.shape + (int(num_classes),), dtype=np.int64)
    np.put_along_axis(out, a[..., None].astype(np.int64), 1, axis=-1)
    return wrap(out)


# ---- losses ----------------------------------------------------------------------------

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


# ---- activations -----------------------------------------------------------------------

def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + e^(beta x)) / beta; linear above threshold"""
    return _ops.softplus(input, beta, threshold)


def leaky_relu(input, negative_slope=0.01, inplace=False):
    """x where x > 0, else negative_slope x"""
    return _core.where(_core.gt(input, 0), input, _core.mul(input, negative_slope))


def _expm1_negative_part(x, scale=1.0):
    # NOTE: the unselected branch of where() still gets a zero gradient multiplied by its
    # derivative, so exp must not overflow there: evaluate it on min(x, 0)
    return _ops.expm1(_core.mul(_core.clamp(x, max=0.0), scale))


def elu(input, alpha=1.0, inplace=False):
    """x where x > 0, else alpha (e^x - 1)"""
    return _core.where(_core.gt(input, 0), input, _core.mul(_expm1_negative_part(input), alpha))


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def selu(input, inplace=False):
    """scale * elu(x, alpha) with the self-normalizing constants"""
    return _core.mul(elu(input, _SELU_ALPHA), _SELU_SCALE)


def celu(input, alpha=1.0, inplace=False):
    """x where x > 0, else alpha (e^(x/alpha) - 1)"""
    return _core.where(_core.gt(input, 0), input,
                       _core.mul(_expm1_negative_part(input, 1.0 / alpha), alpha))


def _clamp_open(input, lo, hi):
    """clamp(x, lo, hi) with the gradient of torch's hardtanh: g strictly between the
    bounds, 0 at and beyond them (clamp's own gradient passes at the bounds); NaN keeps g."""
    outside = _core.logical_or(_core.le(input, lo), _core.ge(input, hi))
    return _core.where(outside, _core.clamp(input.detach(), lo, hi), input)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """clamp(x, min_val, max_val); gradient 0 at the bounds, as torch"""
    return _clamp_open(input, min_val, max_val)


def relu6(input, inplace=False):
    """hardtanh(x, 0, 6): gradient 0 at 0 and at 6, as torch"""
    return _clamp_open(input, 0.0, 6.0)


def hardsigmoid(input, inplace=False):
    """clamp(x / 6 + 1/2, 0, 1); gradient 0 at x = -3 and 3, as torch (so hardswish's is
    0 at -3 and g at 3)"""
    return _clamp_open(_core.add(_core.div(input, 6.0), 0.5), 0.0, 1.0)


def hardswish(input, inplace=False):
    """x * hardsigmoid(x)"""
    return _core.mul(input, hardsigmoid(input))


def mish(input, inplace=False):
    """x * tanh(softplus(x))"""
    return _core.mul(input, _core.tanh(_ops.softplus(input)))


def logsigmoid(input):
    """log(1 / (1 + e^-x)) = -softplus(-x), exact for any x"""
    return _core.neg(_ops.softplus(_core.neg(input), threshold=math.inf))


def softsign(input):
    """x / (1 + |x|)"""
    return _core.div(input, _core.add(_core.abs(input), 1.0))


def softmin(input, dim=None, dtype=None):
    """softmax(-x)"""
    return _softmax(_core.neg(input), dim)


def tanhshrink(input):
    """x - tanh(x)"""
    return _core.sub(input, _core.tanh(input))


def glu(input, dim=-1):
    """a * sigmoid(b), with (a, b) the two halves of input along dim"""
    d = _dim(dim, input.ndim, "glu")
    if input.shape[d] % 2:
        raise RuntimeError(f"glu: Halving dimension must be even, but dimension {d} is size "
                           f"{input.shape[d]}")
    a, b = _core.chunk(input, 2, d)
    return _core.mul(a, _core.sigmoid(b))


def gumbel_softmax(logits, tau=1.0, hard=False, eps=1e-10, dim=-1):
    """softmax((logits + g) / tau) with Gumbel noise g = -log(E), E ~ Exp(1); with hard,
    the one-hot argmax in forward and the soft gradient in backward (straight through)"""
    noise = -np.log(_core.default_generator().exponential(1.0, tuple(logits.shape)))
    y_soft = _softmax(_core.div(_core.add(logits, wrap(noise.astype(logits._data.dtype))),
                                     tau), dim)
    if not hard:
        return y_soft
    d = _dim(dim, y_soft.ndim, "gumbel_softmax")
    index = np.expand_dims(np.argmax(y_soft._data, axis=d), d)
    y_hard = np.zeros(y_soft.shape, dtype=y_soft._data.dtype)
    np.put_along_axis(y_hard, index, 1.0, axis=d)
    return _core.add(_core.sub(wrap(y_hard), y_soft.detach()), y_soft)


# ---- distances and normalisation -------------------------------------------------------

def normalize(input, p=2.0, dim=1, eps=1e-12):
    """x / max(||x||_p, eps) along dim"""
    norm = vector_norm(input, p, dim, keepdim=True)
    return _core.div(input, _core.clamp(norm, min=eps))


class _NormClampedAtEps(DifferentiableRule):
    """y = max(n, eps);  dn = g   (the value clamped, the gradient passed as if it were not)"""

    def create_graph(self, g):
        """dn = g: torch clamps its norms in place under no_grad, so its graph never sees the
        clamp, and a norm below eps still passes its gradient on"""
        return (g,)


declare_saved(_NormClampedAtEps)            # reads nothing


def _norm_clamped_at_eps(norm, eps):
    out = wrap(np.maximum(norm._data, np.asarray(eps, dtype=norm._data.dtype)))
    if needs_graph((norm,)):
        attach(out, _NormClampedAtEps(), (norm,))
    return out


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """sum(x1 / max(||x1||, eps) * x2 / max(||x2||, eps)) along dim, x1 and x2 broadcast
    first (torch 2.13's formula: each norm clamped on its own, so tiny vectors still give
    +-1 and huge ones never overflow a product of norms; |result| <= 1 up to rounding)"""
    x1, x2 = _tensor(x1, "cosine_similarity", "x1"), _tensor(x2, "cosine_similarity", "x2")
    try:
        shape = np.broadcast_shapes(x1.shape, x2.shape)
    except ValueError:
        raise ShapeError(f"cosine_similarity: x1 of shape {tuple(x1.shape)} and x2 of shape "
                         f"{tuple(x2.shape)} cannot be broadcast together") from None
    # broadcast before the norms, as torch: a norm along a broadcast dim counts each copy
    x1 = x1 if tuple(x1.shape) == shape else _core.expand(x1, *shape)
    x2 = x2 if tuple(x2.shape) == shape else _core.expand(x2, *shape)
    n1 = _norm_clamped_at_eps(vector_norm(x1, 2, dim, keepdim=True), eps)
    n2 = _norm_clamped_at_eps(vector_norm(x2, 2, dim, keepdim=True), eps)
    return _core.sum(_core.mul(_core.div(x1, n1), _core.div(x2, n2)), dim=dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """||x1 - x2 + eps||_p over the last dim"""
    return vector_norm(_core.add(_core.sub(x1, x2), eps), p, -1, keepdim)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the batch (and length) dims of
    (N, C) or (N, C, L); in training the batch statistics are used and the running ones
    updated in place (unbiased variance, as torch)."""
    x = _tensor(input, "batch_norm")
    if x.ndim not in (2, 3):
        raise ValueError(f"batch_norm: expected 2D or 3D input (got {x.ndim}D input)")
    dims = (0,) if x.ndim == 2 else (0, 2)
    shape = (1, x.shape[1]) if x.ndim == 2 else (1, x.shape[1], 1)
    if training:
        n = x.shape[0] * (x.shape[2] if x.ndim == 3 else 1)
        if n <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {tuple(x.shape)}")
        mean = _core.mean(x, dim=dims, keepdim=True)
        var = _core.var(x, dim=dims, keepdim=True, correction=0)
        # NOTE: out of place, then copy_: the in-place mul_ would turn the Python float into
        # a float32 array and round a float64 running average
        with _core.no_grad():
            if running_mean is not None:
                running_mean.copy_(running_mean * (1 - momentum)
                                   + mean.detach().reshape(-1) * momentum)
            if running_var is not None:
                unbiased = var.detach().reshape(-1) * (n / (n - 1))
                running_var.copy_(running_var * (1 - momentum) + unbiased * momentum)
    else:
        if running_mean is None or running_var is None:
            raise RuntimeError("batch_norm: running_mean and running_var are needed when not "
                               "training")
        mean = _core.reshape(running_mean, *shape)
        var = _core.reshape(running_var, *shape)
    y = _core.div(_core.sub(x, mean), _core.sqrt(_core.add(var, eps)))
    if weight is not None:
        y = _core.mul(y, _core.reshape(weight, *shape))
    if bias is not None:
        y = _core.add(y, _core.reshape(bias, *shape))
    return y


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

_core.register_ops("pointwise", globals(), """
    celu elu hardsigmoid hardswish hardtanh leaky_relu logsigmoid mish relu6 selu softplus
    softsign tanhshrink""", scope="F")
_core.register_ops("fused", globals(), """
    batch_norm binary_cross_entropy binary_cross_entropy_with_logits cosine_similarity
    huber_loss kl_div l1_loss normalize pairwise_distance smooth_l1_loss softmin glu""",
    scope="F")
_core.register_ops("random", globals(), "gumbel_softmax", scope="F")
_core.register_ops("index", globals(), "one_hot", scope="F")
_core.register_ops("shape", globals(), "pad", scope="F")
