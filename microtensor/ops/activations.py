"""F's activations: relu, sigmoid and tanh (the core's ops under torch's names),
softmax and log_softmax along any dim, gelu (exact or tanh) and silu; the last four
are one fused node each, the Backward node right above its forward function.
The kernels are read from `_kernels.fused` at call time: microtensor/nn/_kernels.py holds
the build chosen at import (and a test may swap it there).
"""
import numpy as np

import math

import scipy.special

import microtensor.core._core as _core
from microtensor.core._core import Node, wrap, needs_graph, attach, register_ops
from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode
from microtensor.ops import _kernels
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


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("pointwise", globals(), "relu sigmoid tanh gelu silu", scope="F")
# mt.softmax and t.softmax(dim) are these same ops (the core has no softmax of its own)
_core.register_op("softmax", softmax, kind="fused")
_core.register_op("log_softmax", log_softmax, kind="fused")
