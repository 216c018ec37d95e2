"""Gradients of gradients: the backward pass that `create_graph=True` runs.

A first-order backward rule (`Node.backward`) works on numpy arrays: fast, but what it
returns has no history. With `create_graph=True` the engine calls `create_graph_rule`
below instead, and every node's gradient is computed by *differentiable tensor ops*, so
the gradients it returns have a `grad_fn` and can be differentiated again, to any order.

One registry holds one rule per node type:

    RULES[NodeClass or "module.ClassName"] = rule(node, grad_output) -> one gradient per input

A rule reads `node.inputs` (the live input tensors) wherever the gradient depends on an
input's value, so that the second derivative flows back into that input. The arrays a
node saved in forward are fine for constants only: masks, indices, shapes, exponents.
(A rule that multiplies by a saved array instead of the live tensor gives the right
first derivative and a silently wrong second one; tests/test_higher_order.py shows that
gradgradcheck catches exactly that.)

Most rules are the node's own backward formula with numpy swapped for tensor ops. Three
fused ops (layer_norm, rms_norm, scaled_dot_product_attention) have long backward
formulas; their rules run the op's forward again as primitives and differentiate that
(`_through_primitives`), which is slower but short and obviously right. A Function
written with numpy (mt.autograd.Function) is once differentiable: its gradient is
correct, and differentiating it again raises an error naming the Function.
"""
import math

import numpy as np
import scipy.special

import microtensor._core as C
from microtensor._core import Tensor, Node, wrap, attach, needs_graph
from microtensor import _fused_attention

RULES = {}


def _key(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def register(*keys):
    """@register(NodeClass, "module.OtherNode", ...) adds a rule for those node types.
    A string key names a class in a module this one need not import."""
    def add(rule):
        for k in keys:
            RULES[k] = rule
        return rule
    return add


def rule_for(node_type):
    """The create-graph rule of a node type, or None."""
    return RULES.get(node_type) or RULES.get(_key(node_type))


def create_graph_rule(node, grad_output):
    """The engine's entry point: one differentiable gradient (or None) per node input."""
    rule = rule_for(type(node))
    if rule is None:
        return _once_differentiable(node, grad_output, f"{node.name()} has no create_graph rule "
                                    f"(add one to microtensor.autograd.higher_order.RULES)")
    grads = tuple(rule(node, grad_output))
    out = []
    for i, inp in enumerate(node.inputs):
        g = grads[i] if i < len(grads) else None
        if g is None or inp is None or not inp.requires_grad:
            out.append(None)
            continue
        if not isinstance(g, Tensor):
            g = wrap(np.asarray(g, dtype=inp._data.dtype))
        elif g._data.dtype != inp._data.dtype:
            g = C._cast(g, inp._data.dtype)
        out.append(g)
    return tuple(out)


# ---- helpers -----------------------------------------------------------------------

def _wants(node, i):
    t = node.inputs[i] if i < len(node.inputs) else None
    return t is not None and t.requires_grad


def _live(node, i, saved):
    """Input i as the live tensor when it is one (so gradients reach it), else the
    constant the node saved (a numpy array or a Python scalar)."""
    t = node.inputs[i] if i < len(node.inputs) else None
    return t if t is not None else saved


def _shape_of(x):
    return tuple(x.shape) if isinstance(x, (np.ndarray, Tensor)) else ()


def _sum_to(g, shape):
    """unbroadcast for tensors: sum g down to `shape` (differentiable: a sum)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    extra = g.ndim - len(shape)
    if extra > 0:
        g = C.sum(g, tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = C.sum(g, axes, True)
    return g


def _keepdim(g, in_shape, dims, keepdim):
    """A reduced gradient with its reduced dims put back as size 1."""
    if keepdim or not dims:
        return g
    shape = tuple(1 if i in dims else s for i, s in enumerate(in_shape))
    return C.reshape(g, shape)


def _const(a, dtype):
    """A constant array in the gradient's dtype (a float64 array would promote)."""
    return np.asarray(a, dtype=dtype)


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


def _unary_exp(x, g):
    return C.mul(g, C.exp(x))                                      # dx = g * e^x


def _unary_log(x, g):
    return C.div(g, x)                                             # dx = g / x


def _unary_sqrt(x, g):
    return C.div(g, C.mul(C.sqrt(x), 2.0))                         # dx = g / (2 sqrt x)


def _unary_tanh(x, g):
    y = C.tanh(x)
    return C.mul(g, C.sub(1.0, C.mul(y, y)))                       # dx = g (1 - y^2)


def _unary_sigmoid(x, g):
    s = C.sigmoid(x)
    return C.mul(g, C.mul(s, C.sub(1.0, s)))                       # dx = g s (1 - s)


def _unary_relu(x, g):
    return C.where(x._data > 0, g, 0.0)                            # dx = g (x > 0)


def _unary_abs(x, g):
    return C.mul(g, _const(np.sign(x._data), g.dtype))             # dx = g sign(x)


_UNARY = {"exp_backward": _unary_exp, "log_backward": _unary_log,
          "sqrt_backward": _unary_sqrt, "tanh_backward": _unary_tanh,
          "sigmoid_backward": _unary_sigmoid, "relu_backward": _unary_relu,
          "abs_backward": _unary_abs}


@register(C.UnaryBackward)
def _unary(node, g):
    """exp, log, sqrt, tanh, sigmoid, relu, abs: one core node type, told apart by kernel"""
    rule = _UNARY.get(node.kernel.__name__)
    if rule is None:
        raise RuntimeError(f"{node.name()} (kernel {node.kernel.__name__}) has no create_graph "
                           "rule in microtensor.autograd.higher_order._UNARY")
    return (rule(node.inputs[0], g),)


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


# ---- reductions (ops_reduce.pxi) ------------------------------------------------------

@register(C.SumBackward)
def _sum(node, g):
    """y = sum(x, dims);  dx = broadcast(g)"""
    return (C.expand(_keepdim(g, node.shape, node.dims, node.keepdim), node.shape),)


@register(C.MeanBackward)
def _mean(node, g):
    """y = mean(x, dims);  dx = broadcast(g) / n"""
    g = C.div(_keepdim(g, node.shape, node.dims, node.keepdim), float(node.n))
    return (C.expand(g, node.shape),)


@register(C.VarBackward)
def _var(node, g):
    """y = sum((x - mean)^2) / (n - correction);  dx = g * 2 (x - mean) / (n - correction)"""
    x = node.inputs[0]
    centered = C.sub(x, C.mean(x, node.dims, True))
    g = _keepdim(g, x.shape, node.dims, node.keepdim)
    return (C.mul(C.mul(g, 2.0 / node.denom), centered),)


@register(C.AmaxBackward)
def _amax(node, g):
    """y = max over dims;  dx = g / (number of ties) at every maximal element"""
    out = node.out
    if not node.keepdim and node.dims:
        out = np.expand_dims(out, node.dims)
    g = _keepdim(g, node.x.shape, node.dims, node.keepdim)
    hit = C._max_hits(node.x, out, node.evenly)
    count = hit.sum(axis=node.dims, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (C.mul(C.div(g, _const(count, g.dtype)), _const(hit, g.dtype)),)


@register(C.MaxDimBackward)
def _max_dim(node, g):
    """values = x.max(dim);  dx = g at the index of each maximum, 0 elsewhere"""
    idx = node.indices
    if not node.keepdim:
        g = C.unsqueeze(g, node.dim)
        idx = np.expand_dims(idx, node.dim)
    positions = np.arange(node.shape[node.dim]).reshape(
        [-1 if i == node.dim else 1 for i in range(len(node.shape))])
    return (C.where(positions == idx, g, 0.0),)


# ---- shapes (ops_shape.pxi) -----------------------------------------------------------

@register(C.ReshapeBackward)
def _reshape(node, g):
    """y = x.reshape(shape);  dx = g.reshape(x.shape)"""
    return (C.reshape(g, node.shape),)


@register(C.PermuteBackward)
def _permute(node, g):
    """y = x.permute(dims);  dx = g.permute(inverse(dims))"""
    return (C.permute(g, tuple(int(d) for d in node.inverse)),)


@register(C.ExpandBackward)
def _expand(node, g):
    """y = x.expand(sizes);  dx = unbroadcast(g)"""
    return (_sum_to(g, node.shape),)


@register(C.CatBackward)
def _cat(node, g):
    """y = cat(xs, dim);  dx_i = the slice of g that x_i filled"""
    return tuple(C.getitem(g, (slice(None),) * node.dim + (slice(start, stop),))
                 if _wants(node, i) else None
                 for i, (start, stop) in enumerate(node.bounds))


@register(C.TrilBackward)
def _tril(node, g):
    """y = tril(x, k) (or triu);  dx = tril(g, k)"""
    return ((C.triu if node.upper else C.tril)(g, node.k),)


class IndexAddBackward(Node):
    """y = zeros(shape); y[key] += x  (the gradient of indexing, as an op);  dx = g[key]

    Indexing's backward scatters; the backward of that scatter gathers again, so the
    two rules close the loop for every order."""

    def backward(self, g):
        return (np.asarray(g)[self.key],)


def index_add(x, key, shape, basic):
    """zeros(shape) with x added at [key] (repeated indices accumulate), differentiably."""
    out = np.zeros(shape, dtype=x._data.dtype)
    if basic:
        out[key] = x._data
    else:
        np.add.at(out, key, x._data)
    out = wrap(out)
    if needs_graph((x,)):
        node = IndexAddBackward()
        node.key = key
        attach(out, node, (x,))
    return out


@register(IndexAddBackward)
def _index_add(node, g):
    return (C.getitem(g, node.key),)


@register(C.IndexBackward)
def _index(node, g):
    """y = x[key];  dx = zeros, then dx[key] += g"""
    return (index_add(g, node.key, node.shape, node.basic),)


@register(C.MatmulBackward)
def _matmul(node, g):
    """y = a @ b;  da = g @ b^T,  db = a^T @ g   (1-D operands and batch dims as numpy)"""
    a, b = _live(node, 0, node.a), _live(node, 1, node.b)
    a = a if isinstance(a, Tensor) else wrap(a)
    b = b if isinstance(b, Tensor) else wrap(b)
    a1, b1 = a.ndim == 1, b.ndim == 1
    if a1 and b1:                        # a dot product: g is 0-d
        return (C.mul(g, b) if _wants(node, 0) else None,
                C.mul(g, a) if _wants(node, 1) else None)
    a2 = C.unsqueeze(a, 0) if a1 else a
    b2 = C.unsqueeze(b, -1) if b1 else b
    if a1:
        g = C.unsqueeze(g, -2)
    if b1:
        g = C.unsqueeze(g, -1)
    da = db = None
    if _wants(node, 0):
        da = C.matmul(g, C.transpose(b2, -1, -2))
        if a1:
            da = C.squeeze(da, -2)
        da = _sum_to(da, a.shape)
    if _wants(node, 1):
        db = C.matmul(C.transpose(a2, -1, -2), g)
        if b1:
            db = C.squeeze(db, -1)
        db = _sum_to(db, b.shape)
    return (da, db)


# ---- fused ops (nn/functional.py) -----------------------------------------------------
# Keyed by name: nn sits above this module, which never imports it.
_F = "microtensor.nn.functional."

@register(_F + "SoftmaxBackward")
def _softmax(node, g):
    """y = softmax(x);  dx = y * (g - sum(g * y))"""
    y = C.softmax(node.inputs[0], node.dim)
    return (C.mul(y, C.sub(g, C.sum(C.mul(g, y), node.dim, True))),)


@register(_F + "LogSoftmaxBackward")
def _log_softmax(node, g):
    """y = log_softmax(x);  dx = g - softmax(x) * sum(g)"""
    p = C.softmax(node.inputs[0], node.dim)
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
    drows = C.mul(C.sub(C.softmax(rows, -1), target), dloss)
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
        p = C.softmax(scores, -1)
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


# ---- the rule written from primitives -------------------------------------------------

def _through_primitives(forward, inputs, grad_output):
    """Gradients of forward(*inputs) for grad_output, as differentiable tensors.

    forward runs on detached aliases of the inputs (leaves, so the local backward below
    walks only this op's small graph, never the model upstream of it); the gradients it
    returns are then re-rooted onto the live inputs: every node of their graph that read
    an alias reads the live tensor instead (same data, same version counter)."""
    aliases = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    g = grad_output
    g_alias = g.detach().requires_grad_() if g.requires_grad else g
    with C.enable_grad():
        out = forward(*aliases)
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    grads = C.run_backward([out], [g_alias], True, [aliases[i] for i in wanted], False, True)
    swap = {id(a): t for a, t in zip(aliases, inputs) if a is not None}
    swap[id(g_alias)] = g
    _reroot([r for r in grads if r is not None], swap)
    result = [None] * len(inputs)
    for i, r in zip(wanted, grads):
        result[i] = r
    return tuple(result)


def _reroot(tensors, swap):
    """Replace, in the graph behind `tensors`, every input tensor t with swap[id(t)]."""
    stack = [t._node for t in tensors if t._node is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        old = node.inputs
        for t in old:                 # descend before swapping: never into the live graph
            if t is not None and t._node is not None and id(t) not in swap:
                stack.append(t._node)
        if any(t is not None and id(t) in swap for t in old):
            node.inputs = tuple(None if t is None else swap.get(id(t), t) for t in old)


# ---- once-differentiable nodes ---------------------------------------------------------

class NotDifferentiableTwiceBackward(Node):
    """Stands behind a gradient that was computed by numpy code: differentiating it
    again raises (it would otherwise be silently treated as a constant)."""

    def backward(self, g):
        raise RuntimeError(self.message)


@register(NotDifferentiableTwiceBackward)
def _not_twice(node, g):
    raise RuntimeError(node.message)


def _once_differentiable(node, g, message):
    """First-order gradients from the node's numpy rule, marked so that a second
    differentiation raises `message` instead of returning a wrong (zero) answer."""
    grads = node.backward(g._data)
    sources = tuple(t for t in (g,) + tuple(node.inputs) if t is not None and t.requires_grad)
    out = []
    for inp, gi in zip(node.inputs, grads):
        if gi is None or inp is None:
            out.append(None)
            continue
        if hasattr(gi, "dense"):
            gi = gi.dense()
        t = wrap(np.asarray(gi, dtype=inp._data.dtype))
        if sources and C.is_grad_enabled():
            mark = NotDifferentiableTwiceBackward()
            mark.message = message
            attach(t, mark, sources)
        out.append(t)
    return tuple(out)


@register("microtensor.autograd._FunctionNode")
def _function(node, g):
    """mt.autograd.Function: its backward works on numpy arrays, so once differentiable."""
    return _once_differentiable(
        node, g, f"{node.name()}: the backward of autograd.Function '{node.fn.__name__}' works "
                 "on numpy arrays, so its gradient cannot be differentiated again "
                 "(create_graph=True); write the op from differentiable tensor ops instead")


C.register_create_graph_rule(create_graph_rule)
