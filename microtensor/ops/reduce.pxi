# Reductions: sum, mean, var, amax/max, argmax, logsumexp. (softmax and log_softmax are
# fused ops of nn.functional, registered there.)

import builtins as _builtins


cdef object _expand_back(object g, tuple in_shape, tuple dims, bint keepdim):
    """Broadcast a reduced gradient back over the reduced dims of `in_shape`."""
    if not keepdim and dims:
        g = np.expand_dims(g, dims)
    return np.broadcast_to(g, in_shape)


cdef class SumBackward(Node):
    """y = sum(x, dims);  dx = broadcast(g)"""
    cdef readonly tuple shape, dims
    cdef readonly bint keepdim
    cpdef tuple backward(self, g):
        return (_expand_back(g, self.shape, self.dims, self.keepdim),)

    def create_graph(self, g):
        """y = sum(x, dims);  dx = broadcast(g)"""
        return (expand(_keepdim(g, self.shape, self.dims, self.keepdim), self.shape),)


def sum(x, dim=None, keepdim=False, dtype=None, keepdims=None):
    if keepdims is not None:
        keepdim = keepdims
    cdef Tensor t = _t(x)
    cdef tuple dims = _norm_dims(dim, t._data.ndim)
    d = t._data
    if d.dtype == bool_ or d.dtype.kind in "iu":
        d = d.astype(int64)
    out = np.asarray(d.sum(axis=dims, keepdims=keepdim))
    if dtype is not None:
        out = out.astype(as_dtype(dtype))
    cdef Tensor res = Tensor._wrap(out)
    cdef SumBackward node
    if _grad_on() and t._requires_grad:
        node = SumBackward.__new__(SumBackward)
        node.shape, node.dims, node.keepdim = t._data.shape, dims, keepdim
        _attach(res, node, (t,))
    return res


cdef class MeanBackward(Node):
    """y = mean(x, dims);  dx = broadcast(g) / n"""
    cdef readonly tuple shape, dims
    cdef readonly bint keepdim
    cdef readonly Py_ssize_t n
    cpdef tuple backward(self, g):
        return (_expand_back(g / self.n, self.shape, self.dims, self.keepdim),)

    def create_graph(self, g):
        """y = mean(x, dims);  dx = broadcast(g) / n"""
        g = div(_keepdim(g, self.shape, self.dims, self.keepdim), float(self.n))
        return (expand(g, self.shape),)


def mean(x, dim=None, keepdim=False, dtype=None, keepdims=None):
    if keepdims is not None:
        keepdim = keepdims
    cdef Tensor t = _t(x)
    if t._data.dtype.kind != "f" and dtype is None:
        raise TypeError(
            f"mean(): could not infer output dtype. Input dtype must be floating point, "
            f"got {_dtype_name(t._data.dtype)}")
    cdef tuple dims = _norm_dims(dim, t._data.ndim)
    d = t._data if dtype is None else t._data.astype(as_dtype(dtype))
    cdef Py_ssize_t n = 1
    for i in dims:
        n *= t._data.shape[i]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.asarray(d.mean(axis=dims, keepdims=keepdim))
    cdef Tensor res = Tensor._wrap(out)
    cdef MeanBackward node
    if _grad_on() and t._requires_grad:
        node = MeanBackward.__new__(MeanBackward)
        node.shape, node.dims, node.keepdim, node.n = t._data.shape, dims, keepdim, n
        _attach(res, node, (t,))
    return res


cdef class VarBackward(Node):
    """y = sum((x - mean)^2) / (n - correction);  dx = g * 2 (x - mean) / (n - correction)"""
    cdef readonly object centered
    cdef readonly tuple dims
    cdef readonly bint keepdim
    cdef readonly double denom
    cpdef tuple backward(self, g):
        if not self.keepdim and self.dims:
            g = np.expand_dims(g, self.dims)
        return (g * (2.0 / self.denom) * self.centered,)

    cpdef release(self):
        self.centered = None

    def create_graph(self, g):
        """y = sum((x - mean)^2) / (n - correction);  dx = g * 2 (x - mean) / (n - correction)"""
        x = self.inputs[0]
        centered = sub(x, mean(x, self.dims, True))
        g = _keepdim(g, x.shape, self.dims, self.keepdim)
        return (mul(mul(g, 2.0 / self.denom), centered),)


def var(x, dim=None, keepdim=False, correction=1, unbiased=None):
    cdef Tensor t = _t(x)
    if unbiased is not None:
        correction = 1 if unbiased else 0
    if t._data.dtype.kind != "f":
        raise TypeError(f"var(): input dtype must be floating point, got {_dtype_name(t._data.dtype)}")
    cdef tuple dims = _norm_dims(dim, t._data.ndim)
    cdef Py_ssize_t n = 1
    for i in dims:
        n *= t._data.shape[i]
    d = t._data
    centered = d - d.mean(axis=dims, keepdims=True)
    denom = n - correction
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.asarray(np.square(centered).sum(axis=dims, keepdims=keepdim) / (denom if denom > 0 else np.nan)).astype(d.dtype, copy=False)
    cdef Tensor res = Tensor._wrap(out)
    cdef VarBackward node
    if _grad_on() and t._requires_grad:
        node = VarBackward.__new__(VarBackward)
        node.centered, node.dims, node.keepdim = centered, dims, keepdim
        node.denom = denom if denom > 0 else np.nan
        _attach(res, node, (t,))
    return res


def std(x, dim=None, keepdim=False, correction=1, unbiased=None, keepdims=None):
    """sqrt(var);  its gradient is 0 where std is 0 (a constant row), as torch's, not
    the 0 / 0 of sqrt's rule there."""
    v = var(x, dim, keepdim if keepdims is None else keepdims, correction, unbiased)
    zero = np.asarray(v._data == 0)
    if not zero.any():
        return sqrt(v)
    return where(zero, 0.0, sqrt(where(zero, 1.0, v)))


cpdef object _max_hits(object x, object out, bint evenly):
    """Where x reaches its maximum `out`; for max() a NaN maximum is reached at the NaNs."""
    hit = (x == out)
    if evenly:
        nan_out = np.isnan(out)
        if nan_out.any():
            hit = np.where(nan_out, np.isnan(x), hit)
    return hit


cdef class AmaxBackward(Node):
    """y = max over dims;  dx = g / (number of ties) at every maximal element"""
    cdef readonly object x, out
    cdef readonly tuple dims
    cdef readonly bint keepdim
    cdef readonly bint evenly      # max() of everything: a NaN maximum sends g to the NaNs
    cpdef tuple backward(self, g):
        out = self.out
        if not self.keepdim and self.dims:
            g = np.expand_dims(g, self.dims)
            out = np.expand_dims(out, self.dims)
        hit = _max_hits(self.x, out, self.evenly)
        count = hit.sum(axis=self.dims, keepdims=True)
        # NOTE: (g / count) * hit, not where(hit, ...): a NaN upstream (or a NaN maximum,
        # count 0) stays NaN everywhere, as torch's amax gives
        with np.errstate(divide="ignore", invalid="ignore"):
            return (((g / count) * hit).astype(self.x.dtype, copy=False),)


    cpdef release(self):
        self.x = self.out = None

    def create_graph(self, g):
        """y = max over dims;  dx = g / (number of ties) at every maximal element"""
        out = self.out
        if not self.keepdim and self.dims:
            out = np.expand_dims(out, self.dims)
        g = _keepdim(g, self.x.shape, self.dims, self.keepdim)
        hit = _max_hits(self.x, out, self.evenly)
        count = hit.sum(axis=self.dims, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (mul(div(g, _const(count, g.dtype)), _const(hit, g.dtype)),)


def amax(x, dim=None, keepdim=False, keepdims=None):
    return _amax(x, dim, keepdim if keepdims is None else keepdims, False)


cdef Tensor _amax(object x, object dim, bint keepdim, bint evenly):
    cdef Tensor t = _t(x)
    cdef tuple dims = _norm_dims(dim, t._data.ndim)
    if t._data.size == 0 and dim is None:
        raise ArgumentError(f"max(): expected a dim to reduce over for an empty tensor "
                            f"(shape {t._data.shape})")
    for i in dims:
        if t._data.shape[i] == 0:
            raise IndexError(f"max(): cannot reduce over dimension {i} of size 0 "
                             f"(shape {t._data.shape})")
    out = np.asarray(t._data.max(axis=dims, keepdims=keepdim))
    cdef Tensor res = Tensor._wrap(out)
    cdef AmaxBackward node
    if _grad_on() and t._requires_grad:
        node = AmaxBackward.__new__(AmaxBackward)
        node.x, node.out, node.dims, node.keepdim = t._data, out, dims, keepdim
        node.evenly = evenly
        _attach(res, node, (t,))
    return res


def amin(x, dim=None, keepdim=False, keepdims=None):
    return neg(amax(neg(x), dim, keepdim if keepdims is None else keepdims))


cdef class MaxDimBackward(Node):
    """values = x.max(dim);  dx = g scattered to the index of each maximum"""
    cdef readonly object indices
    cdef readonly tuple shape
    cdef readonly int dim
    cdef readonly bint keepdim
    cpdef tuple backward(self, g):
        idx = self.indices
        if not self.keepdim:
            g = np.expand_dims(g, self.dim)
            idx = np.expand_dims(idx, self.dim)
        dinp = np.zeros(self.shape, dtype=g.dtype)
        np.put_along_axis(dinp, idx, g, axis=self.dim)
        return (dinp,)

    cpdef release(self):
        self.indices = None

    def create_graph(self, g):
        """values = x.max(dim);  dx = g at the index of each maximum, 0 elsewhere"""
        idx = self.indices
        if not self.keepdim:
            g = unsqueeze(g, self.dim)
            idx = np.expand_dims(idx, self.dim)
        positions = np.arange(self.shape[self.dim]).reshape(
            [-1 if i == self.dim else 1 for i in range(len(self.shape))])
        return (where(positions == idx, g, 0.0),)


cdef tuple _max_along(object d, int dim, bint keepdim):
    """values, indices of the maximum along one dim (Cython kernel over rows)."""
    moved = _contig(np.moveaxis(d, dim, -1))
    lead = moved.shape[:-1]
    rows = moved.reshape(-1, moved.shape[-1])
    if d.dtype.kind == "f":
        values = np.empty(rows.shape[0], dtype=d.dtype)
        indices = np.empty(rows.shape[0], dtype=int64)
        if d.dtype == float32 or d.dtype == float64:
            max_lastdim(rows, values, indices)
        else:
            indices = rows.argmax(axis=1)
            values = rows.max(axis=1)
    else:
        indices = rows.argmax(axis=1).astype(int64)
        values = rows.max(axis=1)
    values = values.reshape(lead)
    indices = indices.reshape(lead)
    if keepdim:
        values = np.expand_dims(values, dim)
        indices = np.expand_dims(indices, dim)
    return values, indices


def max(x, dim=None, keepdim=False, keepdims=None):
    """max(x) -> the largest element; max(x, dim) -> (values, indices); max(a, b) of two
    tensors -> the elementwise maximum (as torch)."""
    if keepdims is not None:
        keepdim = keepdims
    if dim is None:
        if isinstance(keepdim, Tensor):
            raise TypeError("max(a, b) of two tensors: use mt.maximum(a, b)")
        return _amax(x, None, False, True)
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    cdef Tensor t = _t(x)
    cdef int d = _norm_dim(dim, t._data.ndim)
    if t._data.ndim == 0:
        return MaxResult(t, Tensor._wrap(np.zeros((), dtype=int64)))
    if t._data.shape[d] == 0:
        raise IndexError(f"max(): cannot take the maximum over dimension {dim} of size 0")
    values, indices = _max_along(t._data, d, keepdim)
    cdef Tensor res = Tensor._wrap(values)
    cdef MaxDimBackward node
    if _grad_on() and t._requires_grad:
        node = MaxDimBackward.__new__(MaxDimBackward)
        node.indices, node.shape, node.dim, node.keepdim = indices, t._data.shape, d, keepdim
        _attach(res, node, (t,))
    return MaxResult(res, Tensor._wrap(indices))


def min(x, dim=None, keepdim=False, keepdims=None):
    """min(x) -> the smallest element; min(x, dim) -> (values, indices); min(a, b) of two
    tensors -> the elementwise minimum (as torch)."""
    if keepdims is not None:
        keepdim = keepdims
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    if dim is None:
        if isinstance(keepdim, Tensor):
            raise TypeError("min(a, b) of two tensors: use mt.minimum(a, b)")
        return neg(_amax(neg(x), None, False, True))
    values, indices = max(neg(x), dim, keepdim)
    return MaxResult(neg(values), indices)


class MaxResult(tuple):
    """(values, indices), also readable as .values and .indices (as torch's)."""
    def __new__(cls, values, indices):
        return tuple.__new__(cls, (values, indices))

    @property
    def values(self):
        return self[0]

    @property
    def indices(self):
        return self[1]


cdef class MaximumBackward(Node):
    """y = max(a, b);  da = g * wa,  db = g * wb:  1 to the winner, 1/2 each at a tie,
    1 to both where a NaN makes the comparison false (as torch)"""
    cdef readonly object weight, weight_b
    cpdef tuple backward(self, g):
        da = db = None
        if self.inputs[0] is not None:
            da = g * self.weight
        if self.inputs[1] is not None:
            db = g * self.weight_b
        return (da, db)

    cpdef release(self):
        self.weight = self.weight_b = None

    def create_graph(self, g):
        """y = max(a, b);  da = g * wa,  db = g * wb   (1 to the winner, 1/2 each at ties)"""
        return (mul(g, self.weight) if _wants(self, 0) else None,
                mul(g, self.weight_b) if _wants(self, 1) else None)


cdef object _extremum(object a, object b, bint is_max):
    x, y = _operand(a), _operand(b)
    try:
        out = np.maximum(x, y) if is_max else np.minimum(x, y)   # NaN propagates, as in torch
    except ValueError:
        raise _broadcast_error("maximum" if is_max else "minimum", x, y) from None
    out = np.asarray(_promote(out, x, y))
    cdef MaximumBackward node = MaximumBackward.__new__(MaximumBackward)
    if out.dtype.kind == "f":
        a_loses = np.less(x, y) if is_max else np.greater(x, y)
        b_loses = np.greater(x, y) if is_max else np.less(x, y)
        tie = np.equal(x, y)
        node.weight = np.where(tie, 0.5, np.where(a_loses, 0.0, 1.0)).astype(out.dtype)
        node.weight_b = np.where(tie, 0.5, np.where(b_loses, 0.0, 1.0)).astype(out.dtype)
    return _binary_result(out, a, b, node)


def maximum(a, b):
    """Elementwise max(a, b); a NaN in either gives NaN."""
    return _extremum(a, b, True)


def minimum(a, b):
    """Elementwise min(a, b); a NaN in either gives NaN."""
    return _extremum(a, b, False)


def argmax(x, dim=None, keepdim=False, keepdims=None):
    cdef Tensor t = _t(x)
    if keepdims is not None:
        keepdim = keepdims
    if t._data.size == 0 and (dim is None or t._data.ndim == 0
                              or t._data.shape[_norm_dim(dim, t._data.ndim)] == 0):
        raise IndexError(f"argmax(): cannot take the argmax over an empty dimension "
                         f"(shape {t._data.shape}, dim {dim})")
    if dim is None:
        return Tensor._wrap(np.asarray(np.argmax(t._data), dtype=int64))
    cdef int d = _norm_dim(dim, t._data.ndim)
    if t._data.ndim == 0:
        return Tensor._wrap(np.zeros((), dtype=int64))
    return Tensor._wrap(_max_along(t._data, d, keepdim)[1])


def argmin(x, dim=None, keepdim=False, keepdims=None):
    return argmax(neg(x), dim, keepdim if keepdims is None else keepdims)


def logsumexp(x, dim, keepdim=False, keepdims=None):
    """y = log(sum(exp(x))) along dim, shifted by the max for stability."""
    if keepdims is not None:
        keepdim = keepdims
    cdef Tensor t = _t(x)
    cdef tuple dims = _norm_dims(dim, t._data.ndim)
    for i in dims:
        if t._data.shape[i] == 0:   # the sum of no exponentials: log 0 = -inf, as torch;
            # through sum, so that the result is in the graph (its gradient: an empty one)
            return add(sum(x, dim, keepdim), -np.inf)
    m = np.array(amax(x, dim, True)._data, copy=True)
    m[~np.isfinite(m)] = 0      # all -inf gives -inf, a +inf gives inf (as torch), not NaN
    out = add(log(sum(exp(sub(x, m)), dim, True)), m)
    return out if keepdim else squeeze(out, dim)


# which tensors each rule reads in backward (version checks)
declare_saved(SumBackward)
declare_saved(MeanBackward)
declare_saved(VarBackward, live=(0,))      # backward keeps x - mean; its create-graph rule reads x
declare_saved(AmaxBackward, 0, output=True)
declare_saved(MaxDimBackward)
declare_saved(MaximumBackward)


# the registry rows of this file: mt.<name> and t.<name>() (core/registry.pxi)
register_op("sum", sum, kind="reduction")
register_op("mean", mean, kind="reduction")
register_op("var", var, kind="reduction")
register_op("std", std, kind="reduction")
register_op("amax", amax, kind="reduction")
register_op("amin", amin, kind="reduction")
register_op("max", max, kind="reduction")
register_op("min", min, kind="reduction")
register_op("maximum", maximum, kind="pointwise")
register_op("minimum", minimum, kind="pointwise")
register_op("argmax", argmax, kind="reduction")
register_op("argmin", argmin, kind="reduction")
register_op("logsumexp", logsumexp, kind="reduction")
