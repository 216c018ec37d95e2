"""Create-graph rules of the core's elementwise ops (ops_pointwise.pxi): arithmetic,
pow, the unary functions (exp, log, sqrt, tanh, sigmoid, relu, abs: `_FROM_OUTPUT`
and `_FROM_INPUT`), clamp,
where, casts and maximum.
"""
import numpy as np

import microtensor._core as C
from microtensor._core import Tensor
from microtensor.autograd.graph_rules import (
    register, _wants, _live, _shape_of, _sum_to, _const,
)


# ---- elementwise arithmetic (ops_pointwise.pxi) -------------------------------------

@register(C.AddBackward)
def _add(node, g):
    """y = a + b;  da = g,  db = g"""
    return (_sum_to(g, node.ashape) if _wants(node, 0) else None,
            _sum_to(g, node.bshape) if _wants(node, 1) else None)


@register(C.SubBackward)
def _sub(node, g):
    """y = a - b;  da = g,  db = -g"""
    return (_sum_to(g, node.ashape) if _wants(node, 0) else None,
            _sum_to(C.neg(g), node.bshape) if _wants(node, 1) else None)


@register(C.MulBackward)
def _mul(node, g):
    """y = a * b;  da = g * b,  db = g * a"""
    a, b = _live(node, 0, node.a), _live(node, 1, node.b)
    return (_sum_to(C.mul(g, b), _shape_of(node.a)) if _wants(node, 0) else None,
            _sum_to(C.mul(g, a), _shape_of(node.b)) if _wants(node, 1) else None)


@register(C.DivBackward)
def _div(node, g):
    """y = a / b;  da = g / b,  db = -(g / b) * a / b"""
    a, b = _live(node, 0, node.a), _live(node, 1, node.b)
    ga = C.div(g, b)
    return (_sum_to(ga, _shape_of(node.a)) if _wants(node, 0) else None,
            _sum_to(C.neg(C.div(C.mul(ga, a), b)), _shape_of(node.b)) if _wants(node, 1) else None)


@register(C.PowBackward)
def _pow(node, g):
    """y = a ** b;  da = g * b * a^(b-1),  db = g * a^b * log(a)"""
    a, b = _live(node, 0, node.a), _live(node, 1, node.b)
    dtype = g.dtype
    da = db = None
    if _wants(node, 0):
        if isinstance(node.b, (int, float)):
            # NOTE: x**0 has gradient 0 everywhere, also at x = 0 (not 0 * inf)
            da = C.mul(g, C.mul(C.pow(a, node.b - 1), node.b)) if node.b != 0 else C.mul(g, 0.0)
        else:
            local = C.where(node.b == 0, 0.0, C.mul(b, C.pow(a, C.sub(b, 1.0))))
            da = _sum_to(C.mul(g, local), _shape_of(node.a))
    if _wants(node, 1):
        # d/de x**e at x = 0 (e >= 0) is 0, as in torch; log(1) stands in for log(0) there,
        # so the masked branch stays finite in every later derivative too
        zero = (np.asarray(node.a) == 0) & (np.asarray(node.b) >= 0)
        if isinstance(a, Tensor):
            log_a = C.log(C.where(zero, 1.0, a))
        else:                       # a constant base: its log is a constant
            with np.errstate(divide="ignore", invalid="ignore"):
                log_a = _const(np.log(np.where(zero, 1.0, node.a)), dtype)
        local = C.where(zero, 0.0, C.mul(C.pow(a, b), log_a))
        db = _sum_to(C.mul(g, local), _shape_of(node.b))
    return (da, db)


@register(C.NegBackward)
def _neg(node, g):
    """y = -x;  dx = -g"""
    return (C.neg(g),)


# exp, sqrt, tanh and sigmoid save their output y: their rules read y (the saved values,
# as a tensor whose graph leads back to x), never x, which may have changed in place since
def _unary_exp(y, g):
    return C.mul(g, y)                                             # dx = g * y,  y = e^x


def _unary_sqrt(y, g):
    return C.div(g, C.mul(y, 2.0))                                 # dx = g / (2 y)


def _unary_tanh(y, g):
    return C.mul(g, C.sub(1.0, C.mul(y, y)))                       # dx = g (1 - y^2)


def _unary_sigmoid(y, g):
    return C.mul(g, C.mul(y, C.sub(1.0, y)))                       # dx = g y (1 - y)


# log, relu and abs save their input x
def _unary_log(x, g):
    return C.div(g, x)                                             # dx = g / x


def _unary_relu(x, g):
    return C.where(x._data > 0, g, 0.0)                            # dx = g (x > 0)


def _unary_abs(x, g):
    return C.mul(g, _const(np.sign(x._data), g.dtype))             # dx = g sign(x)


_FROM_OUTPUT = {"exp_backward": _unary_exp, "sqrt_backward": _unary_sqrt,
                "tanh_backward": _unary_tanh, "sigmoid_backward": _unary_sigmoid}
_FROM_INPUT = {"log_backward": _unary_log, "relu_backward": _unary_relu,
               "abs_backward": _unary_abs}


@register(C.UnaryBackward)
def _unary(node, g):
    """exp, log, sqrt, tanh, sigmoid, relu, abs: one core node type, told apart by kernel"""
    name = node.kernel.__name__
    if name in _FROM_OUTPUT:
        return (_FROM_OUTPUT[name](C.unary_saved_output(node), g),)
    if name in _FROM_INPUT:
        return (_FROM_INPUT[name](node.inputs[0], g),)
    raise RuntimeError(f"{node.name()} (kernel {name}) has no create_graph rule in "
                       "microtensor.autograd._rules_pointwise")


@register(C.ClampBackward)
def _clamp(node, g):
    """y = clamp(x, lo, hi);  dx = g where lo <= x <= hi"""
    x = node.x
    return (C.where((x >= node.lo) & (x <= node.hi), g, 0.0),)


@register(C.WhereBackward)
def _where(node, g):
    """y = cond ? a : b;  da = g * cond,  db = g * !cond"""
    return (_sum_to(C.where(node.cond, g, 0.0), node.ashape) if _wants(node, 0) else None,
            _sum_to(C.where(node.cond, 0.0, g), node.bshape) if _wants(node, 1) else None)


@register(C.CastBackward)
def _cast(node, g):
    """y = x.to(dtype);  dx = g.to(x.dtype)"""
    return (C._cast(g, node.dtype),)


@register(C.MaximumBackward)
def _maximum(node, g):
    """y = max(a, b);  da = g * wa,  db = g * wb   (1 to the winner, 1/2 each at ties)"""
    return (_sum_to(C.mul(g, node.weight), node.ashape) if _wants(node, 0) else None,
            _sum_to(C.mul(g, node.weight_b), node.bshape) if _wants(node, 1) else None)
