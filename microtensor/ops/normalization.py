"""F's normalisation ops, layer_norm and rms_norm over the trailing
`normalized_shape` dims: one fused node each (forward and backward kernels over rows),
the Backward node right above its forward function.
The kernels are read from `_kernels.fused` at call time: microtensor/ops/_kernels.py holds
the build chosen at import (and a test may swap it there).
"""
import math

import numpy as np

from microtensor.core._core import wrap, needs_graph, attach, ShapeError, register_ops
import microtensor.core._core as _core
from microtensor.autograd.graph_rules import _const, FusedNode
from microtensor.ops import _kernels
from microtensor.ops._common import _tensor
from microtensor.ops._functional_common import (
    declare_saved, _float_array, _same_dtype, _contig, _grad_as, _threads, _wants_grad,
)


# ---- normalisation ---------------------------------------------------------------

def _norm_rows(x, normalized_shape, op):
    if isinstance(normalized_shape, (int, np.integer)):
        normalized_shape = (int(normalized_shape),)
    normalized_shape = tuple(int(s) for s in normalized_shape)
    k = len(normalized_shape)
    if k == 0 or x.ndim < k or x.shape[x.ndim - k:] != normalized_shape:
        raise ShapeError(f"{op}: input shape {x.shape} does not end with normalized_shape "
                         f"{normalized_shape}")
    n = math.prod(normalized_shape)
    return normalized_shape, n


def _check_affine(p, normalized_shape, op, what):
    if p is not None and p.shape != normalized_shape:
        raise ShapeError(f"{op}: {what} shape {p.shape} does not match normalized_shape "
                         f"{normalized_shape}")


def _partials(R, n, dtype):
    """Per-thread partial sums for dweight / dbias: one row per chunk of input rows."""
    chunks = _threads(R * n, memory_bound=True)
    return np.zeros((chunks, n), dtype=dtype)


def _summed(partials):
    """partials.sum(0), bit for bit (one row: the row + 0, as numpy's sum gives -0.0 + 0)."""
    return partials[0] + 0 if partials.shape[0] == 1 else partials.sum(0)


def _row_eps(node, x2, centered):
    """The eps the forward used. The nodes keep rstd, not eps: eps = 1/rstd^2 - var, per
    row, in float64 (this makes the rule's rstd the forward's rstd to rounding)."""
    eps = getattr(node, "eps", None)
    if eps is not None:
        return float(eps)
    rows = x2.astype(np.float64)
    if centered:
        rows = rows - rows.mean(axis=1, keepdims=True)
    var = (rows * rows).mean(axis=1)
    eps = 1.0 / np.square(node.rstd.astype(np.float64)) - var
    return _const(eps.reshape(node.x_shape[:len(node.x_shape) - len(node.normalized_shape)]
                              + (1,) * len(node.normalized_shape)), x2.dtype)


def _norm_dims(node):
    nd, k = len(node.x_shape), len(node.normalized_shape)
    return tuple(range(nd - k, nd))


class LayerNormBackward(FusedNode):
    """y = (x - mean) * rstd * w + b;
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = g * w,
    dw = sum_rows(g * xhat),  db = sum_rows(g)     (kernel: layernorm_backward)"""

    def backward(self, g):
        x2 = self.x2                                     # (R, n)
        R, n = x2.shape
        g2 = _grad_as(g, x2.shape, x2.dtype)
        dinp = np.empty_like(x2)
        dweight = _partials(R, n, x2.dtype)
        dbias = np.zeros(dweight.shape, dweight.dtype)
        if x2.size:
            _kernels.fused.layernorm_backward(dinp, dweight, dbias, g2, x2, self.w1, self.mean,
                                      self.rstd, dweight.shape[0])
        dx = dinp.reshape(self.x_shape) if _wants_grad(self, 0) else None
        dw = _summed(dweight).reshape(self.normalized_shape) if _wants_grad(self, 1) else None
        db = _summed(dbias).reshape(self.normalized_shape) if _wants_grad(self, 2) else None
        return (dx, dw, db)

    def composite(self, x, w=None, b=None):
        """y = (x - mean) / sqrt(var + eps) * w + b"""
        dims, eps = _norm_dims(self), _row_eps(self, self.x2, True)
        centered = _core.sub(x, _core.mean(x, dims, True))
        var = _core.mean(_core.mul(centered, centered), dims, True)
        y = _core.mul(centered, _core.pow(_core.add(var, eps), -0.5))
        if w is not None:
            y = _core.mul(y, w)
        if b is not None:
            y = _core.add(y, b)
        return y


declare_saved(LayerNormBackward, 0, 1)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b   over the last len(normalized_shape) dims"""
    x = _float_array(input, "layer_norm input")
    w = None if weight is None else _float_array(weight, "layer_norm weight")
    b = None if bias is None else _float_array(bias, "layer_norm bias")
    _same_dtype("layer_norm", input=x, weight=w, bias=b)
    normalized_shape, n = _norm_rows(x, normalized_shape, "layer_norm")
    _check_affine(w, normalized_shape, "layer_norm", "weight")
    _check_affine(b, normalized_shape, "layer_norm", "bias")
    R = math.prod(x.shape[:x.ndim - len(normalized_shape)])
    x2 = _contig(x).reshape(R, n)                        # (R, n)
    w1 = np.ones(n, x.dtype) if w is None else _contig(w).reshape(-1)
    b1 = np.zeros(n, x.dtype) if b is None else _contig(b).reshape(-1)
    out = np.empty_like(x2)
    mean = np.empty(R, x.dtype)
    rstd = np.empty(R, x.dtype)
    if x2.size:
        _kernels.fused.layernorm_forward(out, mean, rstd, x2, w1, b1, float(eps), _threads(x2.size, memory_bound=True))
    out = wrap(out.reshape(x.shape))
    inputs = (input, weight, bias)
    if needs_graph(inputs):
        node = LayerNormBackward()
        node.x2, node.w1, node.mean, node.rstd = x2, w1, mean, rstd
        node.x_shape, node.normalized_shape, node.eps = x.shape, normalized_shape, eps
        attach(out, node, inputs)
    return out


class RMSNormBackward(FusedNode):
    """y = x * rstd * w,  rstd = 1/sqrt(mean(x^2) + eps);
    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),  dxhat = g * w,  dw = sum_rows(g * xhat)"""

    def backward(self, g):
        x2 = self.x2
        R, n = x2.shape
        g2 = _grad_as(g, x2.shape, x2.dtype)
        dinp = np.empty_like(x2)
        dweight = _partials(R, n, x2.dtype)
        if x2.size:
            _kernels.fused.rmsnorm_backward(dinp, dweight, g2, x2, self.w1, self.rstd, dweight.shape[0])
        dx = dinp.reshape(self.x_shape) if _wants_grad(self, 0) else None
        dw = _summed(dweight).reshape(self.normalized_shape) if _wants_grad(self, 1) else None
        return (dx, dw)

    def composite(self, x, w=None):
        """y = x / sqrt(mean(x^2) + eps) * w"""
        dims, eps = _norm_dims(self), _row_eps(self, self.x2, False)
        y = _core.mul(x, _core.pow(_core.add(_core.mean(_core.mul(x, x), dims, True), eps), -0.5))
        return y if w is None else _core.mul(y, w)


declare_saved(RMSNormBackward, 0, 1)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """y = x / sqrt(mean(x^2) + eps) * w   (eps=None: the dtype's machine epsilon, as torch)"""
    x = _float_array(input, "rms_norm input")
    w = None if weight is None else _float_array(weight, "rms_norm weight")
    _same_dtype("rms_norm", input=x, weight=w)
    normalized_shape, n = _norm_rows(x, normalized_shape, "rms_norm")
    _check_affine(w, normalized_shape, "rms_norm", "weight")
    if eps is None:
        eps = float(np.finfo(x.dtype).eps)
    x2 = _contig(x).reshape(math.prod(x.shape[:x.ndim - len(normalized_shape)]), n)   # (R, n)
    w1 = np.ones(n, x.dtype) if w is None else _contig(w).reshape(-1)
    out = np.empty_like(x2)
    rstd = np.empty(x2.shape[0], x.dtype)
    if x2.size:
        _kernels.fused.rmsnorm_forward(out, rstd, x2, w1, float(eps), _threads(x2.size, memory_bound=True))
    out = wrap(out.reshape(x.shape))
    inputs = (input, weight)
    if needs_graph(inputs):
        node = RMSNormBackward()
        node.x2, node.w1, node.rstd = x2, w1, rstd
        node.x_shape, node.normalized_shape, node.eps = x.shape, normalized_shape, eps
        attach(out, node, inputs)
    return out


# ---- batch norm: a composition of differentiable ops -----------------------------------

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

register_ops("fused", globals(), "layer_norm rms_norm", scope="F")
register_ops("fused", globals(), "batch_norm", scope="F")
