# Matmul: numpy's semantics (batched, broadcasting, 1-D operands). Float products of 2-D
# and 3-D operands go through microtensor.kernels._blas (one thread pool, transposes passed as
# flags, not copied); tiny products (numpy's call costs less) and other shapes to numpy.

from microtensor.kernels import _blas


cdef Py_ssize_t _SMALL_MATMUL = 1 << 14   # multiply-adds


cdef object _rows(object x):
    """x (..., K) as a 2-D (rows, K) array. NOTE: not reshape(-1, K): with a size-0 axis
    (K = 0, or no rows) -1 is ambiguous and numpy refuses."""
    cdef Py_ssize_t rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return x.reshape(rows, x.shape[-1])


cdef object _mm(object x, object y):
    """x @ y with numpy's semantics; float32/float64 products of 2-D and 3-D operands
    go to microtensor.kernels._blas (one thread pool, transposes as flags), the rest to numpy."""
    if x.dtype != y.dtype or (x.dtype != float32 and x.dtype != float64):
        return np.matmul(x, y)
    cdef int nt = _num_threads
    if x.ndim == 2 and y.ndim == 2:
        if x.shape[0] * x.shape[1] * y.shape[1] < _SMALL_MATMUL:
            return np.matmul(x, y)  # tiny: numpy's call costs less, and runs on one thread
        return _blas.gemm(x, y, num_threads=nt)
    if x.ndim >= 3 and y.ndim == 2:
        # (..., T, C) @ (C, N): one 2-D product over all rows instead of many small ones
        out = _blas.gemm(_rows(x), y, num_threads=nt)
        return out.reshape(x.shape[:-1] + (y.shape[1],))
    if x.ndim == 3 and y.ndim == 3 and x.shape[0] == y.shape[0]:
        return _blas.batched_gemm(x, y, num_threads=nt)
    return np.matmul(x, y)

cdef class MatmulBackward(Node):
    """y = a @ b;  da = g @ b^T,  db = a^T @ g   (over broadcast batch dims: the engine
    sums them back to each operand's shape)"""
    cdef readonly object a, b
    cpdef tuple backward(self, g):
        a, b = self.a, self.b
        a1, b1 = a.ndim == 1, b.ndim == 1
        if a1 and b1:                  # a dot product: g is 0-d
            return (g * b if self.inputs[0] is not None else None,
                    g * a if self.inputs[1] is not None else None)
        a2 = a[None, :] if a1 else a
        b2 = b[:, None] if b1 else b
        if a1:
            g = np.expand_dims(g, -2)
        if b1:
            g = np.expand_dims(g, -1)
        da = db = None
        if self.inputs[0] is not None:
            da = _mm(g, np.swapaxes(b2, -1, -2))
            if a1:
                da = da.reshape(da.shape[:-2] + (da.shape[-1],))
        if self.inputs[1] is not None:
            if b2.ndim == 2 and a2.ndim > 2:
                # sum over the batch of a_i^T g_i = one 2-D product of the flattened rows
                db = _mm(_rows(a2).T, _rows(g))
            else:
                db = _mm(np.swapaxes(a2, -1, -2), g)
            if b1:
                db = db[..., 0]
        return (da, db)

    cpdef release(self):
        self.a = self.b = None

    def create_graph(self, g):
        """y = a @ b;  da = g @ b^T,  db = a^T @ g   (1-D operands and batch dims as numpy)"""
        a, b = _live(self, 0, self.a), _live(self, 1, self.b)
        a = a if isinstance(a, Tensor) else wrap(a)
        b = b if isinstance(b, Tensor) else wrap(b)
        a1, b1 = a.ndim == 1, b.ndim == 1
        if a1 and b1:                        # a dot product: g is 0-d
            return (mul(g, b) if _wants(self, 0) else None,
                    mul(g, a) if _wants(self, 1) else None)
        a2 = unsqueeze(a, 0) if a1 else a
        b2 = unsqueeze(b, -1) if b1 else b
        if a1:
            g = unsqueeze(g, -2)
        if b1:
            g = unsqueeze(g, -1)
        da = db = None
        if _wants(self, 0):
            da = matmul(g, transpose(b2, -1, -2))
            if a1:
                da = squeeze(da, -2)
        if _wants(self, 1):
            db = matmul(transpose(a2, -1, -2), g)
            if b1:
                db = squeeze(db, -1)
        return (da, db)


def matmul(a, b):
    x, y = _operand(a), _operand(b)
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray) or x.ndim == 0 or y.ndim == 0:
        raise ShapeError("matmul: both arguments need at least 1 dimension "
                         f"(got shapes {tuple(_shape_of(x))} and {tuple(_shape_of(y))})")
    if x.dtype != y.dtype and x.dtype.kind == "f" and y.dtype.kind == "f":
        raise DtypeMismatchError(f"matmul: expected both operands to have the same dtype, got "
                                 f"{_dtype_name(x.dtype)} and {_dtype_name(y.dtype)}")
    kx = x.shape[-1]
    ky = y.shape[0] if y.ndim == 1 else y.shape[-2]
    if kx != ky:
        raise ShapeError(f"matmul: shapes {x.shape} and {y.shape} cannot be multiplied "
                         f"({kx} != {ky} in the inner dimension)")
    try:
        out = _mm(x, y)
    except ValueError:
        raise ShapeError(f"matmul: batch dims of {x.shape} and {y.shape} cannot be broadcast") from None
    cdef Tensor res = Tensor._wrap(_promote(out, x, y))
    cdef tuple inputs = (a if isinstance(a, Tensor) else None, b if isinstance(b, Tensor) else None)
    cdef MatmulBackward node
    if _needs_graph(inputs):
        node = MatmulBackward.__new__(MatmulBackward)
        node.a, node.b = x, y
        _attach(res, node, inputs)
    return res


# which tensors the rule reads in backward (version checks)
declare_saved(MatmulBackward, 0, 1)


# the registry row of this file (core/registry.pxi)
register_op("matmul", matmul, operator="@", kind="matmul")
