"""F's activations: relu, sigmoid and tanh (the core's ops under torch's names),
softmax and log_softmax along any dim, gelu (exact or tanh) and silu; the last four
are one fused node each, the Backward node right above its forward function.
The kernels are read from `_kernels.fused` at call time: microtensor/ops/_kernels.py holds
the build chosen at import (and a test may swap it there).
"""
import numpy as np

import math

import scipy.special

import microtensor.core._core as _core
from microtensor.core._core import Node, wrap, needs_graph, attach, register_ops
from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode
from microtensor.ops import _kernels
from microtensor.ops import extra as _ops
from microtensor.ops._common import _dim
from microtensor.ops._functional_common import (
    declare_saved, _float_array, _contig, _grad_as, _threads,
)


# ---- activations -----------------------------------------------------------------

def relu(x, inplace=False):
    """y = max(x, 0)"""
    return _core.relu(x)


def sigmoid(x):
    """y = 1 / (1 + e^-x)"""
    return _core.sigmoid(x)


def tanh(x):
    """y = tanh(x)"""
    return _core.tanh(x)



# ---- what the create-graph rules below share -------------------------------------------

def _saved_rows_output(node):
    """softmax's (or log_softmax's) saved output y as a tensor whose graph leads back to
    x through a node of the same rule: the rules below read y (as PyTorch does), never
    softmax(x) again, since x may have changed in place since the forward pass."""
    if node.out is None:
        raise RuntimeError(f"{node.name()}: its saved output has already been freed")
    y = wrap(np.moveaxis(node.out.reshape(node.moved_shape), -1, node.dim))
    x = node.inputs[0]
    if needs_graph((x,)):
        again = type(node)()
        again.out, again.dim, again.moved_shape = node.out, node.dim, node.moved_shape
        attach(y, again, (x,))
    return y


_GELU_C = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class NormalCdfBackward(DifferentiableRule):
    """y = Phi(x), the standard normal CDF;  dx = g * phi(x) = g * e^(-x^2/2) / sqrt(2 pi)"""

    def create_graph(self, g):
        return (_core.mul(g, _normal_pdf(self.inputs[0])),)


def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, differentiable to any order (in gelu's composite)."""
    out = wrap(np.asarray(scipy.special.ndtr(x._data), dtype=x._data.dtype))
    if needs_graph((x,)):
        attach(out, NormalCdfBackward(), (x,))
    return out


def _normal_pdf(x):
    return _core.mul(_core.exp(_core.mul(_core.mul(x, x), -0.5)), _INV_SQRT_2PI)


class SoftmaxBackward(Node):
    """y = softmax(x);  dx = y * (g - sum(g * y))   (kernel: softmax_backward)"""

    def backward(self, g):
        return (_rows_backward(self, g, _kernels.fused.softmax_backward),)

    def create_graph(self, g):
        """y = softmax(x);  dx = y * (g - sum(g * y))"""
        y = _saved_rows_output(self)
        return (_core.mul(y, _core.sub(g, _core.sum(_core.mul(g, y), self.dim, True))),)


declare_saved(SoftmaxBackward, output=True)


class LogSoftmaxBackward(Node):
    """y = log_softmax(x);  dx = g - exp(y) * sum(g)   (kernel: log_softmax_backward)"""

    def backward(self, g):
        return (_rows_backward(self, g, _kernels.fused.log_softmax_backward),)

    def create_graph(self, g):
        """y = log_softmax(x);  dx = g - exp(y) * sum(g)"""
        p = _core.exp(_saved_rows_output(self))
        return (_core.sub(g, _core.mul(p, _core.sum(g, self.dim, True))),)


declare_saved(LogSoftmaxBackward, output=True)


def _rows_backward(node, g, kernel):
    y = node.out                                         # (R, N), the forward's rows
    g2 = _grad_as(np.moveaxis(np.asarray(g), node.dim, -1), node.moved_shape, y.dtype)
    dinp = np.empty_like(y)
    if y.size:
        kernel(dinp, g2.reshape(y.shape), y, _threads(y.size))
    return np.moveaxis(dinp.reshape(node.moved_shape), -1, node.dim)


def _one_with_zero_slope(t):
    """1 with derivative 0 at any finite t, NaN at NaN or inf (softmax of one element, as
    torch: y (g - g y) = 0): e (2 - e) with e = exp(t - t) = 1 and de/dt = e."""
    e = _core.exp(_core.sub(t, t.detach()))
    return _core.mul(e, _core.sub(2.0, e))


def _softmax_like(input, dim, dtype, log):
    if dim is None:
        raise TypeError("softmax() needs dim (which dimension to normalise over)")
    if dtype is not None:
        input = input.to(dtype)
    x = _float_array(input, "log_softmax input" if log else "softmax input")
    nd = max(x.ndim, 1)                                  # a 0-d tensor takes dim 0 or -1
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not -nd <= dim < nd:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-nd}, {nd - 1}], but got {dim})")
    if x.ndim == 0:                                      # one element: 1 (log: 0), as torch
        one = _one_with_zero_slope(input)
        return _core.log(one) if log else one
    dim = int(dim) % x.ndim
    moved = _contig(np.moveaxis(x, dim, -1))             # (..., N), a view when dim is last
    rows = moved.reshape(-1, moved.shape[-1]) if moved.size else moved.reshape(0, 0)
    out = np.empty_like(rows)
    if rows.size:
        kernel = _kernels.fused.log_softmax_forward if log else _kernels.fused.softmax_forward
        kernel(out, rows, _threads(rows.size))
    # NOTE: contiguous, as torch's result (so that .view works on it); a copy only when
    # dim is not the last one
    res = wrap(np.ascontiguousarray(np.moveaxis(out.reshape(moved.shape), -1, dim)))
    if needs_graph((input,)):
        node = LogSoftmaxBackward() if log else SoftmaxBackward()
        node.out, node.dim, node.moved_shape = out, dim, moved.shape
        attach(res, node, (input,))
    return res


def softmax(input, dim=None, dtype=None):
    """y = exp(x) / sum(exp(x)) along dim (computed stably)"""
    return _softmax_like(input, dim, dtype, False)


def log_softmax(input, dim=None, dtype=None):
    """y = x - logsumexp(x) along dim"""
    return _softmax_like(input, dim, dtype, True)


class GeluBackward(FusedNode):
    """y = x * Phi(x);  dx = g * (Phi(x) + x * phi(x))   (tanh form: see gelu_tanh_backward)"""

    def backward(self, g):
        x = self.x
        g = _grad_as(g, x.shape, x.dtype)
        dinp = np.empty_like(x)
        kernel = _kernels.fused.gelu_tanh_backward if self.approximate == "tanh" else _kernels.fused.gelu_backward
        kernel(dinp.reshape(-1), g.reshape(-1), x.reshape(-1), _threads(x.size))
        return (dinp,)

    def composite(self, x):
        """exact: y = x Phi(x);  tanh: y = x (1 + tanh(c (x + 0.044715 x^3))) / 2"""
        if self.approximate == "tanh":
            u = _core.mul(_core.add(x, _core.mul(_core.mul(_core.mul(x, x), x), 0.044715)), _GELU_C)
            return _core.mul(_core.mul(x, _core.add(_core.tanh(u), 1.0)), 0.5)
        return _core.mul(x, normal_cdf(x))


declare_saved(GeluBackward, 0)


def gelu(input, approximate="none"):
    """y = x * Phi(x) (exact, erf) or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))"""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    x = _contig(_float_array(input, "gelu input"))
    out = np.empty_like(x)
    kernel = _kernels.fused.gelu_tanh_forward if approximate == "tanh" else _kernels.fused.gelu_forward
    kernel(out.reshape(-1), x.reshape(-1), _threads(x.size))
    out = wrap(out)
    if needs_graph((input,)):
        node = GeluBackward()
        node.x, node.approximate = x, approximate
        attach(out, node, (input,))
    return out


class SiluBackward(FusedNode):
    """y = x * s(x);  dx = g * s * (1 + x * (1 - s))"""

    def backward(self, g):
        x = self.x
        g = _grad_as(g, x.shape, x.dtype)
        dinp = np.empty_like(x)
        _kernels.fused.silu_backward(dinp.reshape(-1), g.reshape(-1), x.reshape(-1), _threads(x.size))
        return (dinp,)

    def composite(self, x):
        """y = x s(x)"""
        return _core.mul(x, _core.sigmoid(x))


declare_saved(SiluBackward, 0)


def silu(input, inplace=False):
    """y = x * sigmoid(x)"""
    x = _contig(_float_array(input, "silu input"))
    out = np.empty_like(x)
    _kernels.fused.silu_forward(out.reshape(-1), x.reshape(-1), _threads(x.size))
    out = wrap(out)
    if needs_graph((input,)):
        node = SiluBackward()
        node.x = x
        attach(out, node, (input,))
    return out


# ---- the other activations: compositions of differentiable ops -------------------------

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
    return softmax(_core.neg(input), dim)


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
    y_soft = softmax(_core.div(_core.add(logits, wrap(noise.astype(logits._data.dtype))),
                                    tau), dim)
    if not hard:
        return y_soft
    d = _dim(dim, y_soft.ndim, "gumbel_softmax")
    index = np.expand_dims(np.argmax(y_soft._data, axis=d), d)
    y_hard = np.zeros(y_soft.shape, dtype=y_soft._data.dtype)
    np.put_along_axis(y_hard, index, 1.0, axis=d)
    return _core.add(_core.sub(wrap(y_hard), y_soft.detach()), y_soft)


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("pointwise", globals(), "relu sigmoid tanh gelu silu", scope="F")
# mt.softmax and t.softmax(dim) are these same ops (the core has no softmax of its own)
_core.register_op("softmax", softmax, kind="fused")
_core.register_op("log_softmax", log_softmax, kind="fused")
register_ops("pointwise", globals(), """
    celu elu hardsigmoid hardswish hardtanh leaky_relu logsigmoid mish relu6 selu softplus
    softsign tanhshrink""", scope="F")
register_ops("fused", globals(), "softmin glu", scope="F")
register_ops("random", globals(), "gumbel_softmax", scope="F")
