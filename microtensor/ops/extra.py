"""More of PyTorch's tensor functions: elementwise math, scans, reductions, comparisons,
creation helpers.

Each elementwise op is one row of `_UNARY`: its forward and the derivative used by
backward, side by side, with the math in a comment. Everything else is composed from
the core's differentiable primitives where that is cheap, or is a small Node with its
backward under its forward (cumsum, cumprod).

Every name here is an `mt.` function; those that torch also has as Tensor methods are
registered as methods by the registry rows at the bottom (`register_ops`).
"""
import math
import types

import numpy as np
import scipy.special

import microtensor.core._core as _core
from microtensor.core._core import Tensor, Node, wrap, needs_graph, attach, register_ops
from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode

_LN2 = math.log(2.0)
_LN10 = math.log(10.0)
_SQRT_PI = math.sqrt(math.pi)


# helpers shared by the op families of ops/ (imported from here by the others, too)
from microtensor.ops._common import _tensor, _dim, _dims, _float, _array, declare_saved  # noqa: E402,F401


# ---- elementwise math: one row per op --------------------------------------------------
# Each derivative is written once, over a namespace M of elementwise functions: on numpy
# arrays (M = _ON_ARRAYS) it is the first-order backward, as fast as numpy; on tensors
# (M = _ON_TENSORS, the ops of this module and the core) it is the create-graph rule,
# differentiable again. x is the input, y the output, g the upstream gradient.

def _zero(M, x, y, g):
    return M.zero(g)


# name -> (forward(x) on arrays, dx(M, x, y, g))
_UNARY = {
    "sin": (np.sin, lambda M, x, y, g: g * M.cos(x)),                    # dx = g cos x
    "cos": (np.cos, lambda M, x, y, g: -g * M.sin(x)),                   # dx = -g sin x
    "tan": (np.tan, lambda M, x, y, g: g * (1 + y * y)),                 # dx = g (1 + y^2)
    "asin": (np.arcsin, lambda M, x, y, g: g / M.sqrt(1 - x * x)),       # dx = g / sqrt(1-x^2)
    "acos": (np.arccos, lambda M, x, y, g: -g / M.sqrt(1 - x * x)),      # dx = -g / sqrt(1-x^2)
    "atan": (np.arctan, lambda M, x, y, g: g / (1 + x * x)),             # dx = g / (1+x^2)
    "sinh": (np.sinh, lambda M, x, y, g: g * M.cosh(x)),                 # dx = g cosh x
    "cosh": (np.cosh, lambda M, x, y, g: g * M.sinh(x)),                 # dx = g sinh x
    "asinh": (np.arcsinh, lambda M, x, y, g: g / M.sqrt(x * x + 1)),     # dx = g / sqrt(x^2+1)
    "atanh": (np.arctanh, lambda M, x, y, g: g / (1 - x * x)),           # dx = g / (1-x^2)
    "log1p": (np.log1p, lambda M, x, y, g: g / (1 + x)),                 # dx = g / (1+x)
    "expm1": (np.expm1, lambda M, x, y, g: g * (y + 1)),                 # dx = g e^x
    "exp2": (np.exp2, lambda M, x, y, g: g * y * _LN2),                  # dx = g 2^x ln 2
    "log2": (np.log2, lambda M, x, y, g: g / (x * _LN2)),                # dx = g / (x ln 2)
    "log10": (np.log10, lambda M, x, y, g: g / (x * _LN10)),             # dx = g / (x ln 10)
    "rsqrt": (lambda x: 1 / np.sqrt(x), lambda M, x, y, g: -0.5 * g * y * y * y),  # dx = -g y^3/2
    "reciprocal": (np.reciprocal, lambda M, x, y, g: -g * y * y),        # dx = -g y^2
    "square": (np.square, lambda M, x, y, g: 2 * g * x),                 # dx = 2 g x
    "erf": (scipy.special.erf,                                           # dx = g 2/sqrt(pi) e^-x^2
            lambda M, x, y, g: g * (2 / _SQRT_PI) * M.exp(-x * x)),
    "erfc": (scipy.special.erfc,                                         # dx = -g 2/sqrt(pi) e^-x^2
             lambda M, x, y, g: -g * (2 / _SQRT_PI) * M.exp(-x * x)),
    "erfinv": (scipy.special.erfinv,                                     # dx = g sqrt(pi)/2 e^y^2
               lambda M, x, y, g: g * (_SQRT_PI / 2) * M.exp(y * y)),
    "logit": (scipy.special.logit, lambda M, x, y, g: g / (x * (1 - x))),  # dx = g / (x (1-x))
    "frac": (lambda x: x - np.trunc(x), lambda M, x, y, g: g),           # dx = g
    # piecewise constant: the gradient is zero (as torch's)
    "sign": (np.sign, _zero), "floor": (np.floor, _zero), "ceil": (np.ceil, _zero),
    "trunc": (np.trunc, _zero), "round": (np.round, _zero),
}
# these keep an integer dtype, as torch's do (the others compute in float)
_KEEP_INT = {"sign", "floor", "ceil", "trunc", "round", "square"}

# the derivatives' namespace on arrays (first order); the one on tensors, _ON_TENSORS, is
# made below, once this module's ops exist
_ON_ARRAYS = types.SimpleNamespace(
    sin=np.sin, cos=np.cos, sinh=np.sinh, cosh=np.cosh, sqrt=np.sqrt, exp=np.exp,
    where=np.where, sigmoid=scipy.special.expit, zero=np.zeros_like)


class PointwiseBackward(Node):
    """y = f(x);  dx = g * f'(x)   (f and f' from the op's row of _UNARY)"""

    def backward(self, g):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            dx = self.rule(_ON_ARRAYS, self.x, self.y, g)
        return (np.asarray(dx, dtype=self.x.dtype),)

    def name(self):
        return self.op.capitalize() + "Backward"

    def create_graph(self, g):
        """The same row's dx, on tensors: differentiable again (y is computed again from
        the live input, so that it is differentiable too)"""
        x = self.inputs[0]
        y = self.forward_again(x) if self.forward_again is not None else None
        return (self.rule(_ON_TENSORS, x, y, g),)


declare_saved(PointwiseBackward, 0, output=True)


def _pointwise(op, x, forward=None, rule=None, forward_again=None):
    """op's forward on x's array and, for a float x that needs a graph, its node. forward
    and rule default to the op's row of _UNARY; forward_again(x) is y from tensor ops, for
    the create-graph rule (default: the op's function of this module)."""
    t = _tensor(x, op)
    fwd, dx = _UNARY[op] if forward is None else (forward, rule)
    a = t._data
    if not (op in _KEEP_INT and a.dtype.kind in "iu"):
        a = _float(a)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = np.asarray(fwd(a), dtype=a.dtype if a.dtype.kind == "f" else None)
    out = wrap(y)
    if needs_graph((t,)) and a.dtype.kind == "f":
        node = PointwiseBackward()
        node.op, node.rule, node.x, node.y = op, dx, a, y
        node.forward_again = forward_again if forward is not None else globals()[op]
        attach(out, node, (t,))
    return out


def _make_unary(op):
    def fn(input):
        return _pointwise(op, input)
    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"torch.{op}: elementwise, differentiable (see _UNARY['{op}'])."
    return fn


sin, cos, tan, asin, acos, atan, sinh, cosh, asinh, atanh = (
    _make_unary(n) for n in ("sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
                             "asinh", "atanh"))
log1p, expm1, exp2, log2, log10, rsqrt, reciprocal, square = (
    _make_unary(n) for n in ("log1p", "expm1", "exp2", "log2", "log10", "rsqrt", "reciprocal",
                             "square"))
erf, erfc, erfinv, logit, frac, sign, floor, ceil, trunc = (
    _make_unary(n) for n in ("erf", "erfc", "erfinv", "logit", "frac", "sign", "floor", "ceil",
                             "trunc"))
arcsin, arccos, arctan, sgn, fix = asin, acos, atan, sign, trunc

# the derivatives' namespace on tensors (the create-graph rules)
_ON_TENSORS = types.SimpleNamespace(
    sin=sin, cos=cos, sinh=sinh, cosh=cosh, sqrt=_core.sqrt, exp=_core.exp, where=_core.where,
    sigmoid=_core.sigmoid, zero=lambda g: _core.mul(g, 0.0))


def round(input, decimals=0):
    """torch.round: half to even (as torch); `decimals` rounds to a power of ten."""
    if decimals == 0:
        return _pointwise("round", input)
    scale = 10.0 ** decimals
    return _pointwise("round", input, lambda a: np.round(a * scale) / scale, _zero)


def softplus(input, beta=1.0, threshold=20.0):
    """y = log(1 + e^(beta x)) / beta, and x where beta x > threshold;
    dx = g sigmoid(beta x) (g above the threshold)"""
    if beta == 0:
        raise ValueError("softplus: beta must be nonzero")

    def forward(a):
        z = a * beta
        return np.where(z > threshold, a, np.logaddexp(0, z) / beta).astype(a.dtype)

    def rule(M, x, y, g):
        z = x * beta
        return M.where(z > threshold, g, g * M.sigmoid(z))

    return _pointwise("softplus", input, forward, rule)


class Atan2Backward(DifferentiableRule):
    """y = atan2(a, b);  da = g b / (a^2 + b^2),  db = -g a / (a^2 + b^2)"""

    def create_graph(self, g):
        """the same, from differentiable ops on the live inputs (differentiable again)"""
        a, b = self.inputs
        r = _core.div(g, _core.add(_core.mul(a, a), _core.mul(b, b)))
        da = _core.mul(r, b) if a.requires_grad else None
        db = _core.neg(_core.mul(r, a)) if b.requires_grad else None
        return (da, db)


declare_saved(Atan2Backward, 0, 1)


def atan2(input, other):
    """The angle of the point (other, input), in (-pi, pi]"""
    ta, tb = _tensor(input, "atan2"), _tensor(other, "atan2", "other")
    a, b = _float(ta._data), _float(tb._data)
    if a.dtype != b.dtype:
        a, b = a.astype(np.float64), b.astype(np.float64)
    try:
        y = np.arctan2(a, b)
    except ValueError:
        raise _core.ShapeError(f"atan2: shapes {a.shape} and {b.shape} cannot be broadcast "
                               "together") from None
    out = wrap(np.asarray(y))
    if needs_graph((ta, tb)):
        attach(out, Atan2Backward(), (ta, tb))
    return out


arctan2 = atan2


def fmod(input, other):
    """C's remainder: input - trunc(input / other) * other (the sign of input)"""
    return _core.sub(input, _core.mul(trunc(_core.div(input, other)), other))


def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    """NaN, +inf and -inf replaced (by 0 and the dtype's largest / lowest finite values
    unless given); the gradient passes where the value was finite."""
    t = _tensor(input, "nan_to_num")
    if t._data.dtype.kind != "f":
        return t
    info = np.finfo(t._data.dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    out = _core.where(_core.isnan(t), float(nan), t)
    out = _core.where(_core.eq(t, math.inf), float(posinf), out)
    return _core.where(_core.eq(t, -math.inf), float(neginf), out)


def clamp_min(input, min):
    return _core.clamp(input, min=min)


def clamp_max(input, max):
    return _core.clamp(input, max=max)


def float_power(input, exponent):
    """input ** exponent computed in float64 (as torch's)."""
    a = input.double() if isinstance(input, Tensor) else input
    b = exponent.double() if isinstance(exponent, Tensor) else exponent
    return _core.pow(a, b)


def xlogy(input, other):
    """y = x log(o), 0 where x == 0 (as torch's). The gradients are torch's too:
    dy/dx = log(o), also at x == 0 (the product is smooth in x there) except where
    o <= 0 as well (0); dy/do = x / o."""
    x, o = input, other
    flat = _core.logical_and(_core.eq(x, 0), _core.le(o, 0))   # log(o) not used: 0
    log_o = _core.where(flat, 0.0, _core.log(_core.where(flat, 1.0, o)))
    y = _core.mul(x, log_o)
    at_inf = _core.logical_or(_core.eq(o, math.inf), _core.eq(o, -math.inf))
    return _core.where(_core.logical_and(_core.eq(x, 0), at_inf), 0.0, y)


def lerp(input, end, weight):
    """input + weight * (end - input)"""
    return _core.add(input, _core.mul(weight, _core.sub(end, input)))


def addmm(input, mat1, mat2, beta=1, alpha=1):
    """beta input + alpha (mat1 @ mat2)"""
    prod = _core.matmul(mat1, mat2)
    if alpha != 1:
        prod = _core.mul(prod, alpha)
    return _core.add(_core.mul(input, beta) if beta != 1 else input, prod)


# ---- scans ---------------------------------------------------------------------------

class CumsumBackward(DifferentiableRule):
    """y = cumsum(x, d);  dx = reverse-cumsum(g, d)"""

    def create_graph(self, g):
        """y = cumsum(x, d);  dx = reverse-cumsum(g, d)"""
        flip = (slice(None),) * self.dim + (slice(None, None, -1),)
        g = _core.reshape(g, self.shape1)
        dx = _core.getitem(cumsum(_core.getitem(g, flip), self.dim), flip)
        return (_core.reshape(dx, self.shape),)


declare_saved(CumsumBackward)


def _scan_input(t, dim, dtype, op):
    """The array to scan (0-d as 1-d), its dim, and the dtype rule torch uses."""
    d = _dim(dim, t._data.ndim, op)
    a = t._data if t._data.ndim else t._data.reshape(1)
    if dtype is not None:
        a = a.astype(_core.as_dtype(dtype))
    elif a.dtype.kind in "biu":
        a = a.astype(np.int64)
    return a, d


def cumsum(input, dim, dtype=None):
    t = _tensor(input, "cumsum")
    a, d = _scan_input(t, dim, dtype, "cumsum")
    y = np.cumsum(a, axis=d)
    out = wrap(y.reshape(t._data.shape))
    if needs_graph((t,)) and y.dtype.kind == "f":
        node = CumsumBackward()
        node.dim, node.shape, node.shape1 = d, t._data.shape, a.shape
        attach(out, node, (t,))
    return out


class CumprodBackward(FusedNode):
    """y_i = prod_{k<=i} x_k;  dx_i = (prod_{k<i} x_k) * S_i with S_i = g_i + x_{i+1} S_{i+1}

    Exact with zeros in x (no division by x): S is the reverse scan of
    sum_{j>=i} g_j prod_{i<k<=j} x_k."""

    def backward(self, g):
        x = np.moveaxis(self.x, self.dim, 0)
        g = np.moveaxis(np.asarray(g, dtype=x.dtype).reshape(self.x.shape), self.dim, 0)
        n = x.shape[0]
        before = np.ones_like(x)                       # prod_{k<i} x_k
        if n > 1:
            before[1:] = np.cumprod(x[:-1], axis=0)
        s = np.empty_like(x)
        s[n - 1] = g[n - 1]
        for i in range(n - 2, -1, -1):
            s[i] = g[i] + x[i + 1] * s[i + 1]
        dx = np.moveaxis(before * s, 0, self.dim)
        return (dx.reshape(self.shape).astype(self.x.dtype, copy=False),)

    def composite(self, x):
        """y_i = y_(i-1) * x_i along dim"""
        shape1, dim = self.x.shape, self.dim
        x = _core.reshape(x, shape1)
        running, out = None, []
        for i in range(shape1[dim]):
            xi = _core.getitem(x, (slice(None),) * dim + (slice(i, i + 1),))
            running = xi if running is None else _core.mul(running, xi)
            out.append(running)
        return _core.reshape(_core.cat(out, dim), self.shape)


declare_saved(CumprodBackward, live=(0,))  # its own copy of x; the create-graph rule reads x


def cumprod(input, dim, dtype=None):
    t = _tensor(input, "cumprod")
    a, d = _scan_input(t, dim, dtype, "cumprod")
    y = np.cumprod(a, axis=d)
    out = wrap(y.reshape(t._data.shape))
    if needs_graph((t,)) and y.dtype.kind == "f":
        node = CumprodBackward()
        node.x, node.dim, node.shape = np.array(a, dtype=y.dtype), d, t._data.shape
        attach(out, node, (t,))
    return out


def prod(input, dim=None, keepdim=False, dtype=None):
    """The last element of cumprod along `dim` (so it has cumprod's exact gradient)."""
    t = _tensor(input, "prod")
    if dim is None:
        out = cumprod(t.reshape(-1), 0, dtype)[-1]
        return out.reshape(*([1] * t.ndim)) if keepdim else out
    d = _dim(dim, t._data.ndim, "prod")
    if t._data.ndim == 0:
        return cumprod(t, 0, dtype)
    out = _core.getitem(cumprod(t, d, dtype), (slice(None),) * d + (slice(-1, None),))
    if t._data.shape[d] == 0:
        shape = list(t._data.shape)
        shape[d] = 1
        out = _core.ones(*shape, dtype=out._data.dtype)
    return out if keepdim else _core.squeeze(out, d)


def _cum_extreme(input, dim, op, better):
    """(values, indices) of the running max / min along dim; values are a gather, so they
    carry the gradient to the element that holds the extreme (the last one among ties)."""
    t = _tensor(input, op)
    d = _dim(dim, t._data.ndim, op)
    if t._data.ndim == 0:
        return _core.MaxResult(t, wrap(np.zeros((), np.int64)))
    a = np.moveaxis(t._data, d, 0)
    idx = np.zeros(a.shape, dtype=np.int64)
    best = a[0].copy() if a.shape[0] else a[:0]
    floating = a.dtype.kind == "f"
    for i in range(1, a.shape[0]):
        # NaN wins and stays, as in torch (a later NaN takes over the index)
        take = np.isnan(a[i]) | (~np.isnan(best) & better(a[i], best)) if floating \
            else better(a[i], best)
        idx[i] = np.where(take, i, idx[i - 1])
        best = np.where(take, a[i], best)
    idx = np.ascontiguousarray(np.moveaxis(idx, 0, d))     # new memory: C order, as torch
    from microtensor.ops.index import gather
    return _core.MaxResult(gather(t, d, idx), wrap(idx))


def cummax(input, dim):
    return _cum_extreme(input, dim, "cummax", np.greater_equal)


def cummin(input, dim):
    return _cum_extreme(input, dim, "cummin", np.less_equal)


def median(input, dim=None, keepdim=False):
    """The lower median: of all elements (a 0-d tensor), or (values, indices) along dim."""
    from microtensor.ops.index import kthvalue
    t = _tensor(input, "median")
    if dim is None:
        flat = _core.reshape(t, -1)
        if flat.shape[0] == 0:
            return wrap(np.asarray(np.nan, dtype=_float(t._data).dtype))
        picked = kthvalue(flat, (flat.shape[0] + 1) // 2, 0).values
        ties = np.asarray(flat._data == picked._data)
        if ties.sum() < 2:
            return picked
        # as torch: the gradient spread evenly over every element equal to the median
        # (the value stays the median exactly: each tie minus it is 0)
        v = picked.detach()
        share = wrap((ties / ties.sum()).astype(flat._data.dtype))
        return _core.add(v, _core.sum(_core.mul(_core.sub(flat, v), share)))
    d = _dim(dim, t._data.ndim, "median")
    n = t._data.shape[d] if t._data.ndim else 1
    return kthvalue(t, (n + 1) // 2, d, keepdim)


def unique_consecutive(input, return_inverse=False, return_counts=False, dim=None):
    """Collapse runs of equal consecutive elements (of the flattened tensor)."""
    _core.capture_read(input, "mt.unique_consecutive (a shape read from the values)")
    t = _tensor(input, "unique_consecutive")
    if dim is not None:
        raise NotImplementedError("unique_consecutive(dim=...) is not implemented")
    a = t._data.reshape(-1)
    starts = np.ones(len(a), dtype=bool)
    starts[1:] = a[1:] != a[:-1]
    out = [wrap(a[starts].copy())]
    if return_inverse:
        out.append(wrap((np.cumsum(starts) - 1).reshape(t._data.shape).astype(np.int64)))
    if return_counts:
        out.append(wrap(np.diff(np.append(np.flatnonzero(starts), len(a))).astype(np.int64)))
    return out[0] if len(out) == 1 else tuple(out)


def _logaddexp(a, b):
    """log(e^a + e^b) = max(a, b) + log1p(e^-|a - b|), differentiable to any order (at a
    tie each side gets half, as torch); -inf where both are -inf."""
    both = np.asarray(np.isneginf(a._data) & np.isneginf(b._data))
    if both.any():
        a, b = _core.where(both, 0.0, a), _core.where(both, 0.0, b)
    out = _core.add(_core.maximum(a, b),
                    _core.op_function("log1p")(_core.exp(_core.neg(_core.abs(_core.sub(a, b))))))
    return _core.where(both, -math.inf, out) if both.any() else out


def logcumsumexp(input, dim):
    """y_i = log(sum_{j <= i} exp(x_j)) along dim: a scan of logaddexp in log2(n) steps
    (Hillis and Steele: at step s every y_i takes in y_{i - s}). Each step shifts by its
    own pair's max, so an early small x_j is not lost to a later huge one (a single
    shift by the global max turned exp(-1000 - 0) into 0 and y_0 into -inf)."""
    t = _tensor(input, "logcumsumexp")
    if t._data.ndim == 0:
        return _core.add(t, 0.0)
    d = _dim(dim, t._data.ndim, "logcumsumexp")
    y = t if t._data.dtype.kind == "f" else _core.mul(t, 1.0)
    n, s = t._data.shape[d], 1
    while s < n:
        head = _core.op_function("narrow")(y, d, 0, s)
        tail = _logaddexp(_core.op_function("narrow")(y, d, s, n - s), _core.op_function("narrow")(y, d, 0, n - s))
        y = _core.cat([head, tail], d)
        s *= 2
    return y if y is not t else _core.add(t, 0.0)


def std_mean(input, dim=None, keepdim=False, correction=1):
    return _core.std(input, dim, keepdim, correction), _core.mean(input, dim, keepdim)


def var_mean(input, dim=None, keepdim=False, correction=1):
    return _core.var(input, dim, keepdim, correction), _core.mean(input, dim, keepdim)


# ---- the registry rows: mt.<name>, and t.<name>(...) calling fn(t, ...) ----------------

register_ops("pointwise", globals(), """
    sin cos tan asin acos atan sinh cosh asinh atanh arcsin arccos arctan log1p expm1 exp2
    log2 log10 reciprocal erf erfc erfinv logit frac sign sgn floor ceil trunc fix round
    clamp_min clamp_max float_power xlogy lerp rsqrt square atan2 arctan2 fmod nan_to_num""")
register_ops("matmul", globals(), "addmm")
register_ops("reduction", globals(), "cumsum cumprod prod logcumsumexp cummax cummin median")
register_ops("index", globals(), "unique_consecutive")
register_ops("reduction", globals(), "std_mean var_mean", method=False)
# softplus is F.softplus (torch has no Tensor method of that name)
