"""Create-graph rules of the ops in the other op modules: ops_extra's pointwise
functions (`_POINTWISE`), cumsum and cumprod, ops_index's scatter, ops_linalg's
vector_norm, and functional_extra's constant padding and binary cross-entropy.
"""
import math

import numpy as np

import microtensor._core as C
from microtensor._core import wrap
from microtensor.autograd.graph_rules import (
    register, _wants, _keepdim, _const, _through_primitives,
)
from microtensor.autograd._rules_shape import index_add


# ---- ops in the other op modules (ops_extra, ops_index, ops_linalg, functional_extra) ---

def _extra():
    import microtensor.ops_extra as E
    return E


# op name of ops_extra's PointwiseBackward -> dx(x, g) from differentiable ops
_POINTWISE = {
    "sin": lambda E, x, g: C.mul(g, E.cos(x)),
    "cos": lambda E, x, g: C.neg(C.mul(g, E.sin(x))),
    "tan": lambda E, x, g: C.mul(g, C.add(C.mul(E.tan(x), E.tan(x)), 1.0)),
    "asin": lambda E, x, g: C.div(g, C.sqrt(C.sub(1.0, C.mul(x, x)))),
    "acos": lambda E, x, g: C.neg(C.div(g, C.sqrt(C.sub(1.0, C.mul(x, x))))),
    "atan": lambda E, x, g: C.div(g, C.add(C.mul(x, x), 1.0)),
    "sinh": lambda E, x, g: C.mul(g, E.cosh(x)),
    "cosh": lambda E, x, g: C.mul(g, E.sinh(x)),
    "asinh": lambda E, x, g: C.div(g, C.sqrt(C.add(C.mul(x, x), 1.0))),
    "acosh": lambda E, x, g: C.div(g, C.sqrt(C.sub(C.mul(x, x), 1.0))),
    "atanh": lambda E, x, g: C.div(g, C.sub(1.0, C.mul(x, x))),
    "log1p": lambda E, x, g: C.div(g, C.add(x, 1.0)),
    "expm1": lambda E, x, g: C.mul(g, C.exp(x)),
    "exp2": lambda E, x, g: C.mul(g, C.mul(E.exp2(x), math.log(2.0))),
    "log2": lambda E, x, g: C.div(g, C.mul(x, math.log(2.0))),
    "log10": lambda E, x, g: C.div(g, C.mul(x, math.log(10.0))),
    "rsqrt": lambda E, x, g: C.mul(g, C.mul(C.pow(x, -1.5), -0.5)),
    "reciprocal": lambda E, x, g: C.neg(C.div(g, C.mul(x, x))),
    "square": lambda E, x, g: C.mul(g, C.mul(x, 2.0)),
    "erf": lambda E, x, g: C.mul(g, C.mul(C.exp(C.neg(C.mul(x, x))), 2 / math.sqrt(math.pi))),
    "erfc": lambda E, x, g: C.mul(g, C.mul(C.exp(C.neg(C.mul(x, x))), -2 / math.sqrt(math.pi))),
    "erfinv": lambda E, x, g: C.mul(g, C.mul(C.exp(C.mul(E.erfinv(x), E.erfinv(x))),
                                             math.sqrt(math.pi) / 2)),
    "logit": lambda E, x, g: C.div(g, C.mul(x, C.sub(1.0, x))),
    "frac": lambda E, x, g: g,
}
for _name in ("sign", "floor", "ceil", "trunc", "round"):      # piecewise constant
    _POINTWISE[_name] = lambda E, x, g: C.mul(g, 0.0)


def _closure(fn):
    """The variables a closure captured, by name (softplus's beta and threshold)."""
    cells = fn.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells)}


@register("microtensor.ops_extra.PointwiseBackward")
def _pointwise(node, g):
    """y = f(x);  dx = g * f'(x), with f' written from differentiable ops per op"""
    x = node.inputs[0]
    if node.op == "softplus":      # dx = g sigmoid(beta x), g above the threshold
        params = _closure(node.rule)
        beta, threshold = params["beta"], params["threshold"]
        above = node.x * beta > threshold
        return (C.where(above, g, C.mul(g, C.sigmoid(C.mul(x, beta)))),)
    rule = _POINTWISE.get(node.op)
    if rule is None:
        raise RuntimeError(f"{node.name()} (ops_extra op {node.op!r}) has no create_graph rule in "
                           "microtensor.autograd.higher_order._POINTWISE")
    return (rule(_extra(), x, g),)


@register("microtensor.ops_extra.CumsumBackward")
def _cumsum(node, g):
    """y = cumsum(x, d);  dx = reverse-cumsum(g, d)"""
    flip = (slice(None),) * node.dim + (slice(None, None, -1),)
    g = C.reshape(g, node.shape1)
    dx = C.getitem(_extra().cumsum(C.getitem(g, flip), node.dim), flip)
    return (C.reshape(dx, node.shape),)


@register("microtensor.ops_extra.CumprodBackward")
def _cumprod(node, g):
    """(from primitives) y_i = y_(i-1) * x_i along dim"""
    shape1, dim = node.x.shape, node.dim

    def forward(x):
        x = C.reshape(x, shape1)
        running, out = None, []
        for i in range(shape1[dim]):
            xi = C.getitem(x, (slice(None),) * dim + (slice(i, i + 1),))
            running = xi if running is None else C.mul(running, xi)
            out.append(running)
        return C.reshape(C.cat(out, dim), node.shape)
    return _through_primitives(forward, node.inputs, g)


@register("microtensor.ops_index.ScatterBackward")
def _scatter(node, g):
    """y = x;  y[key] = src[src_key] (or +=);  dx = g (0 where overwritten),  dsrc = g[key]"""
    dx = dsrc = None
    if _wants(node, 0):
        dx = g
        if not node.add:
            overwritten = np.zeros(tuple(g.shape), dtype=bool)
            overwritten[node.key] = True
            dx = C.where(overwritten, 0.0, g)
    if _wants(node, 1):
        dsrc = index_add(C.getitem(g, node.key), node.src_key, node.src_shape, False)
    return (dx, dsrc)


@register("microtensor.ops_linalg.VectorNormBackward")
def _vector_norm(node, g):
    """y = (sum |x|^p)^(1/p);  dx = g sign(x) |x|^(p-1) / y^(p-1)   (0 where y = 0)"""
    x, p, dims = node.inputs[0], node.p, node.dims
    g = _keepdim(g, x.shape, dims, node.keepdim)
    sign = _const(np.sign(node.x), g.dtype)
    if p == 1:
        return (C.mul(g, sign),)
    y0 = node.y if node.keepdim or not dims else np.expand_dims(node.y, dims)
    zero = y0 == 0
    if p == 2:
        y = C.sqrt(C.sum(C.mul(x, x), dims, True))
        local = C.div(x, C.where(zero, 1.0, y))
    else:
        ax = C.abs(x)
        y = C.pow(C.sum(C.pow(ax, p), dims, True), 1.0 / p)
        local = C.div(C.mul(sign, C.pow(ax, p - 1)), C.pow(C.where(zero, 1.0, y), p - 1))
    return (C.where(zero, 0.0, C.mul(g, local)),)


@register("microtensor.nn.functional_extra.ConstantPadBackward")
def _constant_pad(node, g):
    """y = value everywhere, y[inner] = x;  dx = g[inner]"""
    return (C.getitem(g, node.inner),)


@register("microtensor.nn.functional_extra.BinaryCrossEntropyBackward")
def _binary_cross_entropy(node, g):
    """l = -w (t log x + (1-t) log(1-x));  dx = w (x - t) / max(x (1-x), 1e-12) g,
    dt = w (log(1-x) - log x) g   (logs clamped at -100, as the forward)"""
    x, t = node.inputs
    xa = node.x
    if node.reduction == "mean":
        g = C.div(g, float(xa.size))
    x = x if x is not None else wrap(xa)
    t = t if t is not None else wrap(node.t)
    w = _const(node.w, g.dtype)
    dx = dt = None
    if _wants(node, 0):
        tiny = xa * (1 - xa) < 1e-12
        denom = C.where(tiny, 1e-12, C.mul(x, C.sub(1.0, x)))
        dx = C.mul(C.div(C.mul(C.sub(x, t), w), denom), g)
    if _wants(node, 1):
        def clamped_log(v, low):                  # log(v), -100 where it is below -100
            return C.where(low, -100.0, C.log(C.where(low, 1.0, v)))
        log_x = clamped_log(x, node.logx <= -100)
        log_1mx = clamped_log(C.sub(1.0, x), node.log1mx <= -100)
        dt = C.mul(C.mul(C.sub(log_1mx, log_x), w), g)
    return (dx, dt)
