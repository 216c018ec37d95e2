"""Create-graph rules of the fused ops of nn.functional (softmax, gelu, silu, linear,
layer_norm, rms_norm, cross_entropy, mse_loss, embedding, dropout, attention) and of
nn/rope.py, keyed by name because nn sits above the autograd package; also
normal_cdf, the differentiable standard normal CDF that gelu's rule uses.
"""
import math

import numpy as np
import scipy.special

import microtensor._core as C
from microtensor._core import Node, wrap, attach, needs_graph
from microtensor import _fused_attention
from microtensor.autograd.graph_rules import (
    register, _wants, _sum_to, _const, _through_primitives,
)
from microtensor.autograd._rules_shape import index_add


def _mt_softmax(x, dim):
    """mt.softmax, found through the op registry: its rule lives with its kernel in
    nn.functional, which this engine-level module does not import."""
    return C.op_function("softmax")(x, dim)


# ---- fused ops (nn/functional.py) -----------------------------------------------------
# Keyed by name: nn sits above this module, which never imports it.
_F = "microtensor.nn.functional."

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


@register(_F + "SoftmaxBackward")
def _softmax(node, g):
    """y = softmax(x);  dx = y * (g - sum(g * y))"""
    y = _saved_rows_output(node)
    return (C.mul(y, C.sub(g, C.sum(C.mul(g, y), node.dim, True))),)


@register(_F + "LogSoftmaxBackward")
def _log_softmax(node, g):
    """y = log_softmax(x);  dx = g - exp(y) * sum(g)"""
    p = C.exp(_saved_rows_output(node))
    return (C.sub(g, C.mul(p, C.sum(g, node.dim, True))),)


_GELU_C = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class NormalCdfBackward(Node):
    """y = Phi(x), the standard normal CDF;  dx = g * phi(x) = g * e^(-x^2/2) / sqrt(2 pi)"""

    def backward(self, g):
        x = self.x
        return ((g * (np.exp(-0.5 * x * x) * _INV_SQRT_2PI)).astype(x.dtype, copy=False),)


def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, differentiable to any order (gelu's rule)."""
    out = wrap(np.asarray(scipy.special.ndtr(x._data), dtype=x._data.dtype))
    if needs_graph((x,)):
        node = NormalCdfBackward()
        node.x = x._data
        attach(out, node, (x,))
    return out


def _normal_pdf(x):
    return C.mul(C.exp(C.mul(C.mul(x, x), -0.5)), _INV_SQRT_2PI)


@register(NormalCdfBackward)
def _normal_cdf(node, g):
    return (C.mul(g, _normal_pdf(node.inputs[0])),)


@register(_F + "GeluBackward")
def _gelu(node, g):
    """exact: y = x Phi(x),  dx = g (Phi(x) + x phi(x));
    tanh: y = x (1 + t) / 2,  t = tanh(u),  u = c (x + 0.044715 x^3),
          dx = g ((1 + t) / 2 + x (1 - t^2) c (1 + 3 * 0.044715 x^2) / 2)"""
    x = node.inputs[0]
    if node.approximate == "tanh":
        x2 = C.mul(x, x)
        t = C.tanh(C.mul(C.mul(x, C.add(C.mul(x2, 0.044715), 1.0)), _GELU_C))
        du = C.mul(C.add(C.mul(x2, 3 * 0.044715), 1.0), _GELU_C)
        local = C.mul(C.add(C.add(t, 1.0), C.mul(C.mul(x, C.sub(1.0, C.mul(t, t))), du)), 0.5)
    else:
        local = C.add(normal_cdf(x), C.mul(x, _normal_pdf(x)))
    return (C.mul(g, local),)


@register(_F + "SiluBackward")
def _silu(node, g):
    """y = x s(x);  dx = g s (1 + x (1 - s))"""
    x = node.inputs[0]
    s = C.sigmoid(x)
    return (C.mul(g, C.mul(s, C.add(C.mul(x, C.sub(1.0, s)), 1.0))),)


@register(_F + "LinearBackward")
def _linear(node, g):
    """y = x @ W^T + b;  dx = g @ W,  dW = g^T @ x,  db = sum_rows(g)"""
    x, w = node.inputs[0], node.inputs[1]
    g2 = C.reshape(g, (-1, w.shape[0]))                   # (M, out)
    dx = dw = db = None
    if _wants(node, 0):
        dx = C.reshape(C.matmul(g2, w), x.shape)
    if _wants(node, 1):
        dw = C.matmul(C.transpose(g2, 0, 1), C.reshape(x, (-1, w.shape[1])))
    if _wants(node, 2):
        db = C.sum(g2, 0)
    return (dx, dw, db)


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


@register(_F + "LayerNormBackward")
def _layer_norm(node, g):
    """(from primitives) y = (x - mean) / sqrt(var + eps) * w + b"""
    dims, eps = _norm_dims(node), _row_eps(node, node.x2, True)

    def forward(x, w, b):
        centered = C.sub(x, C.mean(x, dims, True))
        var = C.mean(C.mul(centered, centered), dims, True)
        y = C.mul(centered, C.pow(C.add(var, eps), -0.5))
        if w is not None:
            y = C.mul(y, w)
        if b is not None:
            y = C.add(y, b)
        return y
    return _through_primitives(forward, node.inputs, g)


@register(_F + "RMSNormBackward")
def _rms_norm(node, g):
    """(from primitives) y = x / sqrt(mean(x^2) + eps) * w"""
    dims, eps = _norm_dims(node), _row_eps(node, node.x2, False)

    def forward(x, w):
        y = C.mul(x, C.pow(C.add(C.mean(C.mul(x, x), dims, True), eps), -0.5))
        return y if w is None else C.mul(y, w)
    return _through_primitives(forward, node.inputs, g)


@register(_F + "CrossEntropyBackward")
def _cross_entropy(node, g):
    """loss_i = logsumexp(x_i) - x_i[t_i];  dx_i = g_i (softmax(x_i) - q_i),
    q_i = (1 - eps) onehot(t_i) + eps / C;  0 on ignored rows, / count for 'mean'"""
    x = node.inputs[0]
    M, n_class = node.rows.shape
    if node.how == "second":                               # (N, C, d...) -> (N, d..., C)
        nd = len(node.x_shape)
        rows = C.reshape(C.permute(x, (0,) + tuple(range(2, nd)) + (1,)), (M, n_class))
    else:
        rows = C.reshape(x, (M, n_class))
    dtype = g.dtype
    keep = node.tgt != node.ignore_index
    target = np.zeros((M, n_class), dtype=dtype)
    target[np.arange(M)[keep], node.tgt[keep]] = 1 - node.label_smoothing
    target[keep] += node.label_smoothing / n_class
    if node.reduction == "none":
        dloss = C.mul(C.reshape(g, (M, 1)), _const(keep[:, None], dtype))
    else:
        scale = 1.0 / max(node.count, 1) if node.reduction == "mean" else 1.0
        dloss = C.mul(g, _const(keep[:, None] * scale, dtype))          # (M, 1)
    drows = C.mul(C.sub(_mt_softmax(rows, -1), target), dloss)
    if node.how == "second":
        x_shape = node.x_shape
        moved = C.reshape(drows, (x_shape[0],) + tuple(x_shape[2:]) + (x_shape[1],))
        nd = len(x_shape)
        return (C.permute(moved, (0, nd - 1) + tuple(range(1, nd - 1))), None)
    return (C.reshape(drows, node.x_shape), None)


@register(_F + "MSELossBackward")
def _mse_loss(node, g):
    """loss = reduce((x - y)^2);  dx = 2 (x - y) g / n,  dy = -dx"""
    a, b = node.inputs
    diff = C.sub(a, b)
    if node.reduction == "none":
        d = C.mul(C.mul(diff, g), 2.0)
    else:
        n = diff.numel() if node.reduction == "mean" else 1
        d = C.mul(diff, C.mul(g, 2.0 / n))
    return (_sum_to(d, node.a_shape) if _wants(node, 0) else None,
            C.neg(_sum_to(d, node.b_shape)) if _wants(node, 1) else None)


@register(_F + "EmbeddingBackward")
def _embedding(node, g):
    """y = W[idx];  dW[idx[i]] += g[i]   (padding_idx row: 0)"""
    V, D = node.weight_shape
    dweight = index_add(C.reshape(g, (-1, D)), node.ids, (V, D), False)
    if node.padding_idx is not None:
        keep = np.ones((V, 1), dtype=bool)
        keep[node.padding_idx] = False
        dweight = C.where(keep, dweight, 0.0)
    return (None, dweight)


@register(_F + "DropoutBackward")
def _dropout(node, g):
    """y = x * m / (1 - p);  dx = g * m / (1 - p)"""
    return (C.mul(g, node.mask),)


@register(_F + "AttentionBackward")
def _attention(node, g):
    """(from primitives) o = dropout(softmax(scale * q @ k^T + mask)) @ v"""
    batch, Tq, Tk = node.batch, node.q.shape[1], node.k.shape[1]
    dtype = node.q.dtype
    mask = None
    if node.has_mask and not (len(node.inputs) > 3 and node.inputs[3] is not None):
        mask = node.slabs[node.index].reshape(batch + (Tq, Tk))           # additive, constant
    keep = None
    if node.dropout_p > 0:
        keep = np.empty((node.q.shape[0], Tq, Tk), dtype=dtype)
        # the same counter-based draws in every build of the kernels
        _fused_attention.attention_dropout_mask(keep, node.seed, node.dropout_p)
        keep = keep.reshape(batch + (Tq, Tk))
    causal = np.tril(np.ones((Tq, Tk), dtype=bool)) if node.is_causal else None

    def forward(q, k, v, live_mask=None):
        scores = C.mul(C.matmul(q, C.transpose(k, -1, -2)), node.scale)   # (..., Tq, Tk)
        if live_mask is not None:
            scores = C.add(scores, live_mask)
        elif mask is not None:
            scores = C.add(scores, mask)
        if causal is not None:
            scores = C.where(causal, scores, -np.inf)
        # a row with every key masked outputs zeros (the kernel's rule): give softmax a
        # finite row there and zero its output, so no NaN reaches any derivative
        dead = np.all(np.isneginf(scores._data), axis=-1, keepdims=True)
        if dead.any():
            scores = C.where(dead, 0.0, scores)
        p = _mt_softmax(scores, -1)
        if dead.any():
            p = C.where(dead, 0.0, p)
        if keep is not None:
            p = C.mul(p, keep)
        return C.matmul(p, v)
    return _through_primitives(forward, node.inputs, g)


# ---- fused ops elsewhere (microtensor/nn/rope.py) -------------------------------------

@register("microtensor.nn.rope.RopeBackward")
def _rope(node, g):
    """y = x cos + R x sin;  dx = g cos + R^T (g sin),  R^T [u1, u2] = [u2, -u1]"""
    half = g.shape[-1] // 2
    gs = C.mul(g, node.sin)
    rotated = C.cat([gs[..., half:], C.neg(gs[..., :half])], -1)
    return (C.add(C.mul(g, node.cos), rotated),)
