"""mt.nn.functional: the stateless layers of a Transformer, in PyTorch's dialect.

    import microtensor.nn.functional as F
    logits = F.linear(x, W, b)
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))

Each fused op (linear, gelu, silu, layer_norm, rms_norm, cross_entropy, embedding,
dropout, scaled_dot_product_attention) is one graph node: the forward function sits
right above its Backward node, which states the math in its first docstring line.
"""
import math

import numpy as np

import microtensor._core as _core
from microtensor import _blas
from microtensor._core import Tensor, Node, wrap, needs_graph, attach, ShapeError

# Which tensors each rule reads in backward (the version check of in-place changes looks
# at these only, as torch checks the tensors it saved): input positions, and the output.
declare_saved = _core.declare_saved


def _cpu_has_avx2_fma():
    """Does this CPU run the AVX2+FMA build of the kernels? (numpy already asked the CPU.)"""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return False
    return bool(features.get("AVX2")) and bool(features.get("FMA3"))


def _load_kernels():
    """The fused kernels: the AVX2+FMA build when the CPU has it, else the baseline build.
    MICROTENSOR_KERNELS=baseline forces the baseline (to test or compare both)."""
    import os
    if os.environ.get("MICROTENSOR_KERNELS", "auto") != "baseline" and _cpu_has_avx2_fma():
        try:
            from microtensor import _fused_avx2, _fused_attention_avx2
            return _fused_avx2, _fused_attention_avx2
        except ImportError:
            pass
    from microtensor import _fused, _fused_attention
    return _fused, _fused_attention


_fused, _attention = _load_kernels()

__all__ = [
    "linear", "relu", "gelu", "silu", "sigmoid", "tanh", "softmax", "log_softmax",
    "cross_entropy", "nll_loss", "mse_loss", "layer_norm", "rms_norm", "embedding",
    "dropout", "scaled_dot_product_attention",
]


# ---- small helpers -----------------------------------------------------------------

class DtypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype. Both a TypeError (Python's word for it) and a
    RuntimeError (what torch raises for a dtype its kernel does not take), as ShapeError
    is both a ValueError and a RuntimeError."""


def _tensor(x, what):
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a microtensor Tensor, got {type(x).__name__}")
    return x


def _float_array(x, what):
    """The float32/float64 array behind a tensor argument, or TypeError."""
    d = _tensor(x, what)._data
    if d.dtype != np.float32 and d.dtype != np.float64:
        raise DtypeError(f"{what} must be a floating tensor (float32 or float64), got {d.dtype}")
    return d


def _same_dtype(op, **arrays):
    """All given arrays share one float dtype (torch refuses to mix them too)."""
    items = [(k, a) for k, a in arrays.items() if a is not None]
    dt = items[0][1].dtype
    for k, a in items[1:]:
        if a.dtype != dt:
            names = ", ".join(f"{k}: {a.dtype}" for k, a in items)
            raise DtypeError(f"{op}: expected all tensors to have the same dtype, got {names}")


def _contig(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _owned_indices(idx):
    """A private int64 copy of an index array, flat (M,). Backward reads the indices
    again, after any amount of user code: a view of the caller's tensor could by then
    hold other (or out-of-range) values, so the node keeps its own copy (the indices
    are small next to the activations they pick)."""
    return np.array(idx, dtype=np.int64, copy=True, order="C").reshape(-1)


def _grad_as(g, shape, dtype):
    """An upstream gradient as a C-contiguous array of this shape and dtype (the engine
    may hand us a broadcast view or another float dtype)."""
    g = np.asarray(g)
    if g.dtype != dtype or not g.flags.c_contiguous:
        g = np.ascontiguousarray(g, dtype=dtype)
    return g.reshape(shape)


# Below these many elements one thread is faster than waking the others: kernels that
# compute a transcendental per element pay off sooner than those that only move memory.
_PARALLEL_MIN = 1 << 15
_PARALLEL_MIN_MEMORY_BOUND = 1 << 18


def _threads(work, memory_bound=False):
    return _core.get_num_threads() if work >= (
        _PARALLEL_MIN_MEMORY_BOUND if memory_bound else _PARALLEL_MIN) else 1


def _wants_grad(node, i):
    t = node.inputs[i]
    return t is not None and t.requires_grad


def _check_reduction(reduction):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


# broadcasting is undone in one place, the core's unbroadcast()
_unbroadcast = _core.sum_to_shape


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


class SoftmaxBackward(Node):
    """y = softmax(x);  dx = y * (g - sum(g * y))   (kernel: softmax_backward)"""

    def backward(self, g):
        return (_rows_backward(self, g, _fused.softmax_backward),)


declare_saved(SoftmaxBackward, output=True)


class LogSoftmaxBackward(Node):
    """y = log_softmax(x);  dx = g - exp(y) * sum(g)   (kernel: log_softmax_backward)"""

    def backward(self, g):
        return (_rows_backward(self, g, _fused.log_softmax_backward),)


declare_saved(LogSoftmaxBackward, output=True)


def _rows_backward(node, g, kernel):
    y = node.out                                         # (R, N), the forward's rows
    g2 = _grad_as(np.moveaxis(np.asarray(g), node.dim, -1), node.moved_shape, y.dtype)
    dinp = np.empty_like(y)
    if y.size:
        kernel(dinp, g2.reshape(y.shape), y, _threads(y.size))
    return np.moveaxis(dinp.reshape(node.moved_shape), -1, node.dim)


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
    if x.ndim == 0:                                      # as one row of one: 1 (log: 0), as torch
        return _softmax_like(input.reshape(1), 0, None, log).reshape(())
    dim = int(dim) % x.ndim
    moved = _contig(np.moveaxis(x, dim, -1))             # (..., N), a view when dim is last
    rows = moved.reshape(-1, moved.shape[-1]) if moved.size else moved.reshape(0, 0)
    out = np.empty_like(rows)
    if rows.size:
        kernel = _fused.log_softmax_forward if log else _fused.softmax_forward
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


class GeluBackward(Node):
    """y = x * Phi(x);  dx = g * (Phi(x) + x * phi(x))   (tanh form: see gelu_tanh_backward)"""

    def backward(self, g):
        x = self.x
        g = _grad_as(g, x.shape, x.dtype)
        dinp = np.empty_like(x)
        kernel = _fused.gelu_tanh_backward if self.approximate == "tanh" else _fused.gelu_backward
        kernel(dinp.reshape(-1), g.reshape(-1), x.reshape(-1), _threads(x.size))
        return (dinp,)


declare_saved(GeluBackward, 0)


def gelu(input, approximate="none"):
    """y = x * Phi(x) (exact, erf) or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))"""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    x = _contig(_float_array(input, "gelu input"))
    out = np.empty_like(x)
    kernel = _fused.gelu_tanh_forward if approximate == "tanh" else _fused.gelu_forward
    kernel(out.reshape(-1), x.reshape(-1), _threads(x.size))
    out = wrap(out)
    if needs_graph((input,)):
        node = GeluBackward()
        node.x, node.approximate = x, approximate
        attach(out, node, (input,))
    return out


class SiluBackward(Node):
    """y = x * s(x);  dx = g * s * (1 + x * (1 - s))"""

    def backward(self, g):
        x = self.x
        g = _grad_as(g, x.shape, x.dtype)
        dinp = np.empty_like(x)
        _fused.silu_backward(dinp.reshape(-1), g.reshape(-1), x.reshape(-1), _threads(x.size))
        return (dinp,)


declare_saved(SiluBackward, 0)


def silu(input, inplace=False):
    """y = x * sigmoid(x)"""
    x = _contig(_float_array(input, "silu input"))
    out = np.empty_like(x)
    _fused.silu_forward(out.reshape(-1), x.reshape(-1), _threads(x.size))
    out = wrap(out)
    if needs_graph((input,)):
        node = SiluBackward()
        node.x = x
        attach(out, node, (input,))
    return out


# ---- linear ----------------------------------------------------------------------

class LinearBackward(Node):
    """y = x @ W^T + b;  dx = g @ W,  dW = g^T @ x,  db = sum_rows(g)"""

    def backward(self, g):
        x2d, w = self.x2d, self.weight                  # (M, in), (out, in)
        g2d = _grad_as(g, (x2d.shape[0], w.shape[0]), w.dtype)   # (M, out); no copy if contiguous
        dx = dw = db = None
        nt = _core.get_num_threads()
        if _wants_grad(self, 0):
            dx = _blas.gemm(g2d, w, num_threads=nt).reshape(self.x_shape)
        if _wants_grad(self, 1):
            dw = _blas.gemm(g2d.T, x2d, num_threads=nt)  # NOTE: .T is a view, passed as a 'T' flag
        if len(self.inputs) > 2 and _wants_grad(self, 2):
            db = g2d.sum(axis=0)
        return (dx, dw, db)


declare_saved(LinearBackward, 0, 1)


def linear(input, weight, bias=None):
    """y = x @ W^T + b   (x (..., in), W (out, in), b (out,))"""
    x = _float_array(input, "linear input")
    w = _float_array(weight, "linear weight")
    b = None if bias is None else _float_array(bias, "linear bias")
    _same_dtype("linear", input=x, weight=w, bias=b)
    if w.ndim != 2:
        raise ShapeError(f"linear: weight must be 2-D (out_features, in_features), got shape {w.shape}")
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ShapeError(f"linear: input shape {x.shape} and weight shape {w.shape} do not fit "
                         f"(input's last dim must equal in_features = {w.shape[1]})")
    if b is not None and b.shape != (w.shape[0],):
        raise ShapeError(f"linear: bias shape {b.shape} does not fit weight shape {w.shape} "
                         f"(expected ({w.shape[0]},))")
    M = math.prod(x.shape[:-1])
    x2d = x.reshape(M, w.shape[1])                      # (M, in); a view when x is contiguous
    out2d = _blas.gemm(x2d, w.T, num_threads=_core.get_num_threads())   # (M, out); w.T as a flag
    if b is not None:
        out2d += b
    out = wrap(out2d.reshape(x.shape[:-1] + (w.shape[0],)))
    inputs = (input, weight) if bias is None else (input, weight, bias)
    if needs_graph(inputs):
        node = LinearBackward()
        node.x2d, node.weight, node.x_shape = x2d, w, x.shape
        attach(out, node, inputs)
    return out


# ---- normalisation ---------------------------------------------------------------

def _norm_rows(x, normalized_shape, op):
    if isinstance(normalized_shape, (int, np.integer)):
        normalized_shape = (int(normalized_shape),)
    normalized_shape = tuple(int(s) for s in normalized_shape)
    k = len(normalized_shape)
    if k == 0 or x.ndim < k or x.shape[x.ndim - k:] != normalized_shape:
        raise ShapeError(f"{op}: input shape {x.shape} does not end with normalized_shape "
                         f"{normalized_shape}")
    n = int(np.prod(normalized_shape))
    return normalized_shape, n


def _check_affine(p, normalized_shape, op, what):
    if p is not None and p.shape != normalized_shape:
        raise ShapeError(f"{op}: {what} shape {p.shape} does not match normalized_shape "
                         f"{normalized_shape}")


def _partials(R, n, dtype):
    """Per-thread partial sums for dweight / dbias: one row per chunk of input rows."""
    chunks = _threads(R * n, memory_bound=True)
    return np.zeros((chunks, n), dtype=dtype)


class LayerNormBackward(Node):
    """y = (x - mean) * rstd * w + b;
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = g * w,
    dw = sum_rows(g * xhat),  db = sum_rows(g)     (kernel: layernorm_backward)"""

    def backward(self, g):
        x2 = self.x2                                     # (R, n)
        R, n = x2.shape
        g2 = _grad_as(g, x2.shape, x2.dtype)
        dinp = np.empty_like(x2)
        dweight = _partials(R, n, x2.dtype)
        dbias = np.zeros_like(dweight)
        if x2.size:
            _fused.layernorm_backward(dinp, dweight, dbias, g2, x2, self.w1, self.mean,
                                      self.rstd, dweight.shape[0])
        dx = dinp.reshape(self.x_shape) if _wants_grad(self, 0) else None
        dw = dweight.sum(0).reshape(self.normalized_shape) if _wants_grad(self, 1) else None
        db = dbias.sum(0).reshape(self.normalized_shape) if _wants_grad(self, 2) else None
        return (dx, dw, db)


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
        _fused.layernorm_forward(out, mean, rstd, x2, w1, b1, float(eps), _threads(x2.size, memory_bound=True))
    out = wrap(out.reshape(x.shape))
    inputs = (input, weight, bias)
    if needs_graph(inputs):
        node = LayerNormBackward()
        node.x2, node.w1, node.mean, node.rstd = x2, w1, mean, rstd
        node.x_shape, node.normalized_shape, node.eps = x.shape, normalized_shape, eps
        attach(out, node, inputs)
    return out


class RMSNormBackward(Node):
    """y = x * rstd * w,  rstd = 1/sqrt(mean(x^2) + eps);
    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),  dxhat = g * w,  dw = sum_rows(g * xhat)"""

    def backward(self, g):
        x2 = self.x2
        R, n = x2.shape
        g2 = _grad_as(g, x2.shape, x2.dtype)
        dinp = np.empty_like(x2)
        dweight = _partials(R, n, x2.dtype)
        if x2.size:
            _fused.rmsnorm_backward(dinp, dweight, g2, x2, self.w1, self.rstd, dweight.shape[0])
        dx = dinp.reshape(self.x_shape) if _wants_grad(self, 0) else None
        dw = dweight.sum(0).reshape(self.normalized_shape) if _wants_grad(self, 1) else None
        return (dx, dw)


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
        _fused.rmsnorm_forward(out, rstd, x2, w1, float(eps), _threads(x2.size, memory_bound=True))
    out = wrap(out.reshape(x.shape))
    inputs = (input, weight)
    if needs_graph(inputs):
        node = RMSNormBackward()
        node.x2, node.w1, node.rstd = x2, w1, rstd
        node.x_shape, node.normalized_shape, node.eps = x.shape, normalized_shape, eps
        attach(out, node, inputs)
    return out


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
    (kernel: crossentropy_backward, which recomputes softmax from the saved logsumexp)"""

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
            _fused.crossentropy_backward(dlogits, dlosses, rows, self.lse, self.tgt,
                                         self.ignore_index, self.label_smoothing,
                                         _threads(rows.size))
        if self.how == "second":                         # (N*d, C) -> (N, C, d...)
            x_shape = self.x_shape
            dlogits = np.moveaxis(dlogits.reshape((x_shape[0],) + x_shape[2:] + (x_shape[1],)), -1, 1)
        return (dlogits.reshape(self.x_shape), None)


declare_saved(CrossEntropyBackward, 0)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0):
    """loss = -log softmax(x)[target], averaged over the targets that are not ignore_index

    Layouts as torch: logits (N, C) with target (N,), (C,) with (), (N, C, d...) with
    (N, d...); also (..., C) with (...) (e.g. (B, T, V) logits with (B, T) targets)."""
    x = _float_array(input, "cross_entropy input")
    if weight is not None:
        raise NotImplementedError("cross_entropy: class weights are not supported")
    _check_reduction(reduction)
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    t = target._data if isinstance(target, Tensor) else np.asarray(target)
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target must be an integer (int64) tensor of class "
                        f"indices, got dtype {t.dtype}")
    rows, tgt, out_shape, how = _ce_rows(x, t, "cross_entropy")
    rows = _contig(rows)                                 # (M, C)
    tgt = _owned_indices(tgt)                            # (M,), checked below, kept for backward
    M, C = rows.shape
    keep = tgt != ignore_index
    bad = keep & ((tgt < 0) | (tgt >= C))
    if bad.any():
        v = int(tgt[np.argmax(bad)])
        raise IndexError(f"cross_entropy: target {v} is out of bounds for {C} classes "
                         f"(valid: 0 to {C - 1}, or ignore_index={ignore_index})")
    losses = np.empty(M, x.dtype)
    lse = np.empty(M, x.dtype)
    if rows.size:
        _fused.crossentropy_forward(losses, lse, rows, tgt, int(ignore_index),
                                    float(label_smoothing), _threads(rows.size))
    else:
        losses[:] = 0
    count = int(keep.sum())
    if reduction == "none":
        out = losses.reshape(out_shape)
    elif reduction == "sum":
        out = np.asarray(losses.sum(dtype=np.float64), dtype=x.dtype)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):   # all ignored: nan, as torch
            out = np.asarray(losses.sum(dtype=np.float64) / count, dtype=x.dtype)
    out = wrap(out)
    if needs_graph((input,)):
        node = CrossEntropyBackward()
        node.rows, node.tgt, node.lse = rows, tgt, lse
        node.reduction, node.count, node.how = reduction, count, how
        node.x_shape, node.out_shape = x.shape, out_shape
        node.ignore_index, node.label_smoothing = int(ignore_index), float(label_smoothing)
        attach(out, node, (input, None))
    return out


def nll_loss(input, target, ignore_index=-100, reduction="mean"):
    """loss = -input[target]  (input holds log-probabilities)"""
    logp = _tensor(input, "nll_loss input")
    _check_reduction(reduction)
    t = target._data if isinstance(target, Tensor) else np.asarray(target)
    if t.dtype.kind not in "iu":
        raise DtypeError(f"nll_loss: target must be an integer (int64) tensor of class "
                        f"indices, got dtype {t.dtype}")
    t = np.array(t, dtype=np.int64, copy=True)          # private: checked once, then used
    if logp.ndim != 2 or t.shape != (logp.shape[0],):
        raise ShapeError(f"nll_loss: input shape {logp.shape} and target shape {t.shape} do "
                         "not fit (expected (N, C) and (N,))")
    C = logp.shape[1]
    keep = t != ignore_index
    bad = keep & ((t < 0) | (t >= C))
    if bad.any():
        raise IndexError(f"nll_loss: target {int(t[np.argmax(bad)])} is out of bounds for {C} classes")
    safe = np.where(keep, t, 0).astype(np.int64)
    picked = logp[np.arange(len(t)), safe] * wrap(keep.astype(logp.dtype))
    if reduction == "none":
        return -picked
    if reduction == "sum":
        return -picked.sum()
    return -picked.sum() / float(keep.sum())


class MSELossBackward(Node):
    """loss = reduce((x - y)^2);  dx = 2 (x - y) g / n,  dy = -dx"""

    def backward(self, g):
        diff = self.diff
        # NOTE: np.asarray throughout: numpy turns 0-d results into scalars
        if self.reduction == "none":
            d = np.asarray(2 * diff * g)
        else:
            # (an empty input has an empty gradient: no division by its size of 0)
            scale = 2 * float(g) / (max(diff.size, 1) if self.reduction == "mean" else 1)
            d = np.asarray(diff * scale)
        d = d.astype(diff.dtype, copy=False)
        da = _unbroadcast(d, self.a_shape) if _wants_grad(self, 0) else None
        db = np.asarray(0 - _unbroadcast(d, self.b_shape)) if _wants_grad(self, 1) else None
        return (da, db)


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
        node.diff, node.reduction, node.a_shape, node.b_shape = diff, reduction, a.shape, b.shape
        attach(out, node, inputs)
    return out


# ---- embedding -------------------------------------------------------------------

class EmbeddingBackward(Node):
    """y = W[idx];  dW[idx[i]] += g[i]   (repeated ids accumulate; kernel: embedding_backward)"""

    def backward(self, g):
        V, D = self.weight_shape
        dweight = np.zeros((V, D), dtype=self.dtype)
        g2 = np.ascontiguousarray(g, dtype=self.dtype).reshape(self.ids.shape[0], D)
        if g2.size:
            _fused.embedding_backward(dweight, g2, self.ids, _threads(g2.size, memory_bound=True))
        if self.padding_idx is not None:
            dweight[self.padding_idx] = 0
        return (None, dweight)




declare_saved(EmbeddingBackward)           # its indices are a private copy
def embedding(input, weight, padding_idx=None):
    """y = W[idx]   (idx int64 of any shape, W (num_embeddings, embedding_dim))"""
    w = _float_array(weight, "embedding weight")
    idx = input._data if isinstance(input, Tensor) else np.asarray(input)
    if idx.dtype.kind not in "iu":
        raise DtypeError(f"embedding: indices must be an integer (int64) tensor, got dtype {idx.dtype}")
    if w.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {w.shape}")
    V, D = w.shape
    ids = _owned_indices(idx)                           # (M,), checked below, kept for backward
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        raise IndexError(f"embedding: index {int(ids[np.argmax(bad)])} is out of range for "
                         f"num_embeddings={V} (valid: 0 to {V - 1})")
    if padding_idx is not None:
        padding_idx = int(padding_idx)
        if padding_idx < 0:
            padding_idx += V
        if not 0 <= padding_idx < V:
            raise IndexError(f"embedding: padding_idx {padding_idx} is out of range for num_embeddings={V}")
    out = np.empty((ids.shape[0], D), dtype=w.dtype)     # (M, D)
    if out.size:
        _fused.embedding_forward(out, ids, _contig(w), _threads(out.size, memory_bound=True))
    out = wrap(out.reshape(idx.shape + (D,)))
    if needs_graph((weight,)):
        node = EmbeddingBackward()
        node.ids, node.weight_shape, node.dtype, node.padding_idx = ids, w.shape, w.dtype, padding_idx
        attach(out, node, (None, weight))
    return out


# ---- dropout ---------------------------------------------------------------------

class DropoutBackward(Node):
    """y = x * m / (1 - p);  dx = g * m / (1 - p)   (m: the kept positions)"""

    def backward(self, g):
        return (np.asarray(g * self.mask),)




declare_saved(DropoutBackward)               # only its own mask
def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability p and scale the rest by 1/(1-p) (training only)."""
    x = _tensor(input, "dropout input")
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) \
            or not (0.0 <= p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return x
    d = _contig(_float_array(x, "dropout input"))
    if p == 1:
        mask = np.zeros(d.shape, dtype=d.dtype)
        out = np.zeros_like(d)
    else:
        uniform = _core.default_generator().random(d.size, dtype=np.float32)
        mask = np.empty_like(d)
        out = np.empty_like(d)
        _fused.dropout_forward(out.reshape(-1), mask.reshape(-1), d.reshape(-1), uniform,
                               float(p), _threads(d.size, memory_bound=True))
    out = wrap(out)
    if needs_graph((input,)):
        node = DropoutBackward()
        node.mask = mask
        attach(out, node, (input,))
    return out


# ---- attention -------------------------------------------------------------------

# Query rows per block (one (block, Tk) buffer of scores per thread). Small blocks trim
# more of the causal triangle; larger ones make fewer, more efficient gemms. Measured at
# T = 64 and 256: 64 rows is best with is_causal, 128 without.
_ATTENTION_BLOCK_CAUSAL = 64
_ATTENTION_BLOCK = 128


def _attention_mask(attn_mask, Tq, Tk, dtype):
    """attn_mask as an additive float array (0 = attend, -inf = masked), at least 2-D."""
    m = attn_mask._data if isinstance(attn_mask, Tensor) else np.asarray(attn_mask)
    if m.dtype == np.bool_:
        m = np.where(m, dtype.type(0), dtype.type(-np.inf))
    elif m.dtype.kind == "f":
        m = m.astype(dtype, copy=False)
    else:
        raise DtypeError(f"scaled_dot_product_attention: attn_mask must be bool (True = attend) "
                        f"or float (added to the scores), got dtype {m.dtype}")
    if m.ndim < 2:
        m = m.reshape((1,) * (2 - m.ndim) + m.shape)
    if m.shape[-2] not in (1, Tq) or m.shape[-1] not in (1, Tk):
        raise ShapeError(f"scaled_dot_product_attention: attn_mask shape {m.shape} cannot be "
                         f"broadcast to the scores' shape (..., {Tq}, {Tk})")
    return m


def _mask_slabs(m, batch, Tq, Tk):
    """An additive mask broadcastable to batch + (Tq, Tk) as contiguous slabs (NM, Tq, Tk)
    plus the slab index of each flattened batch entry (BH,), without expanding the mask
    over batch dims it is broadcast along (a (B, 1, 1, Tk) padding mask stays B slabs)."""
    mb = m.shape[:-2]
    if len(mb) > len(batch) or np.broadcast_shapes(mb, batch) != tuple(batch):
        raise ShapeError(f"scaled_dot_product_attention: attn_mask shape {m.shape} cannot be "
                         f"broadcast to the scores' shape {tuple(batch) + (Tq, Tk)}")
    slabs = np.ascontiguousarray(np.broadcast_to(m, mb + (Tq, Tk))).reshape(-1, Tq, Tk)
    mb = (1,) * (len(batch) - len(mb)) + mb
    index = np.broadcast_to(np.arange(slabs.shape[0], dtype=np.int64).reshape(mb), batch)
    return slabs, np.ascontiguousarray(index).reshape(-1)


class AttentionBackward(Node):
    """o = P @ v,  P = softmax(scale * q @ k^T + mask);
    dv = P^T @ g,  dP = g @ v^T,  dS = P * (dP - rowsum(dP * P)),
    dq = scale * dS @ k,  dk = scale * dS^T @ q,  dmask = dS   (kernel: attention_backward)"""

    def backward(self, g):
        q, k, v = self.q, self.k, self.v                 # (BH, Tq, hs), (BH, Tk, hs), (BH, Tk, hv)
        dout = _grad_as(g, (q.shape[0], q.shape[1], v.shape[2]), q.dtype)   # (BH, Tq, hv)
        dq = np.zeros_like(q)
        dk = np.zeros_like(k)
        dv = np.zeros_like(v)
        want_dmask = len(self.inputs) > 3 and _wants_grad(self, 3)
        # NOTE: the mask's gradient is the whole (BH, Tq, Tk) matrix of dS; it exists only
        # when a float mask requires grad (a learned bias), never on the usual path
        dmask = np.zeros((q.shape[0], q.shape[1], k.shape[1]), q.dtype) if want_dmask else None
        if dout.size and k.shape[1]:
            scale, dq_k, dk_k = self.scale, dq, dk
            if q.shape[2] == 0:                          # empty dot products (see forward):
                q = np.zeros(q.shape[:2] + (1,), q.dtype)   # one zero column, scale 0,
                k = np.zeros(k.shape[:2] + (1,), k.dtype)   # dq and dk stay empty
                scale, dq_k, dk_k = 0.0, np.zeros_like(q), np.zeros_like(k)
            _attention.attention_backward(dq_k, dk_k, dv, dout, q, k, v, self.lse, self.slabs,
                                          self.index, self.has_mask, self.is_causal, scale,
                                          self.dropout_p, self.seed, self.block,
                                          min(_threads(q.shape[0] * q.shape[1] * k.shape[1] * q.shape[2]),
                                              q.shape[0]), dmask)
        grads = []
        for d, shape in zip((dq, dk, dv), self.shapes):
            grads.append(_unbroadcast(d.reshape(self.batch + d.shape[1:]), shape))
        if len(self.inputs) > 3:
            if want_dmask:                               # (BH, Tq, Tk) -> the mask's own shape
                m2 = self.mask_shape_2d
                d = _unbroadcast(dmask.reshape(self.batch + dmask.shape[1:]), m2)
                grads.append(d.reshape(self.mask_shape).astype(self.mask_dtype, copy=False))
            else:
                grads.append(None)
        return tuple(grads)


declare_saved(AttentionBackward, 0, 1, 2, 3)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """o = softmax(q @ k^T * scale + mask) @ v   (q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv))

    attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
    (..., Tq, Tk). is_causal: query i sees keys 0..i (top-left aligned, as torch).
    scale defaults to 1/sqrt(hs). A row with every key masked outputs zeros."""
    q = _float_array(query, "scaled_dot_product_attention query")
    k = _float_array(key, "scaled_dot_product_attention key")
    v = _float_array(value, "scaled_dot_product_attention value")
    _same_dtype("scaled_dot_product_attention", query=q, key=k, value=v)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ShapeError(f"scaled_dot_product_attention: query, key and value need at least 2 "
                         f"dims (..., T, head_dim), got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {q.shape}, key {k.shape} and value "
                         f"{v.shape} do not fit (q and k must share head_dim, k and v the "
                         "sequence length)")
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ShapeError(f"scaled_dot_product_attention: batch dims of query {q.shape}, key "
                         f"{k.shape} and value {v.shape} cannot be broadcast together") from None
    if isinstance(dropout_p, bool) or not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if is_causal and attn_mask is not None:
        # torch raises RuntimeError here too
        raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask should not be "
                           "set when is_causal=True (pass one or the other, not both)")
    Tq, hs = q.shape[-2], q.shape[-1]
    Tk, hv = k.shape[-2], v.shape[-1]
    scale = (1.0 / math.sqrt(hs) if hs else math.inf) if scale is None else float(scale)
    if attn_mask is not None:
        m2 = _attention_mask(attn_mask, Tq, Tk, q.dtype)
        slabs, index = _mask_slabs(m2, batch, Tq, Tk)
    else:
        slabs, index = np.zeros((1, 1, 1), q.dtype), np.zeros(1, np.int64)
    BH = int(np.prod(batch))

    def flat(a, T, d):                                   # (..., T, d) -> (BH, T, d), contiguous
        return _contig(np.broadcast_to(a, batch + (T, d))).reshape(BH, T, d)

    q3, k3, v3 = flat(q, Tq, hs), flat(k, Tk, hs), flat(v, Tk, hv)
    out3 = np.empty((BH, Tq, hv), q.dtype)
    lse = np.empty((BH, Tq), q.dtype)
    seed = int(_core.default_generator().integers(0, 2 ** 63)) if dropout_p > 0 else 0
    block = _ATTENTION_BLOCK_CAUSAL if is_causal else _ATTENTION_BLOCK
    if out3.size == 0 or Tk == 0:
        out3[...] = 0                                    # nothing to attend to
        lse[...] = np.inf
    elif hs == 0:
        # an empty dot product: every score is 0 (plus the mask), as torch computes it;
        # the kernel runs on one zero column with scale 0 (no 0 * inf from 1/sqrt(0))
        _attention.attention_forward(out3, lse, np.zeros((BH, Tq, 1), q.dtype),
                                     np.zeros((BH, Tk, 1), q.dtype), v3, slabs, index,
                                     attn_mask is not None, bool(is_causal), 0.0,
                                     float(dropout_p), seed, block, 1)
    else:
        _attention.attention_forward(out3, lse, q3, k3, v3, slabs, index, attn_mask is not None,
                                     bool(is_causal), scale, float(dropout_p), seed,
                                     block, min(_threads(BH * Tq * Tk * hs), BH))
    out = wrap(out3.reshape(batch + (Tq, hv)))
    # a float mask tensor is an input: it may take a gradient, and its slabs may be views
    # of it that backward reads (a bool mask is turned into a private array)
    mask_input = isinstance(attn_mask, Tensor) and attn_mask.dtype != np.bool_
    inputs = (query, key, value, attn_mask) if mask_input else (query, key, value)
    if needs_graph(inputs):
        node = AttentionBackward()
        node.q, node.k, node.v, node.lse = q3, k3, v3, lse
        node.slabs, node.index, node.has_mask = slabs, index, attn_mask is not None
        node.is_causal, node.scale, node.dropout_p, node.seed = bool(is_causal), scale, float(dropout_p), seed
        node.batch, node.shapes, node.block = tuple(batch), (q.shape, k.shape, v.shape), block
        if mask_input:
            node.mask_shape, node.mask_shape_2d, node.mask_dtype = attn_mask.shape, m2.shape, attn_mask.dtype
        attach(out, node, inputs)
    return out


# t.softmax(dim) and mt.softmax run these same rules
_core.register_softmax(softmax, log_softmax)

# pad, one_hot, the other losses and activations, normalize, batch_norm
from microtensor.nn.functional_extra import *  # noqa: E402,F401,F403
from microtensor.nn.rope import rotary_embedding  # noqa: E402,F401
