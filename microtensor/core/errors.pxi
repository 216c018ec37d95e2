# Error types and the small validators every op shares.

class ShapeError(ValueError, RuntimeError):
    """Shapes that do not fit. Both a ValueError (as numpy code expects) and a
    RuntimeError (as PyTorch code expects), like numpy's AxisError inherits two."""


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value that torch answers with RuntimeError: both, as ShapeError."""


class DtypeMismatchError(TypeError, RuntimeError):
    """Operands of different dtypes where torch expects one (matmul): a TypeError and,
    as torch raises it, a RuntimeError."""


cdef inline int _norm_dim(object dim, int ndim) except? -1:
    """A dim in [-ndim, ndim) as a non-negative int, or IndexError."""
    cdef int d
    if isinstance(dim, Tensor):
        dim = int(dim)
    if not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be an integer, got {type(dim).__name__}")
    d = dim
    cdef int n = ndim if ndim > 0 else 1
    if d < -n or d >= n:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {d})")
    return d + n if d < 0 else d


cdef tuple _norm_dims(object dim, int ndim):
    """None -> all dims; an int or a sequence of ints -> a sorted tuple of dims."""
    if dim is None:
        return tuple(range(ndim))
    if ndim == 0:
        # a 0-d tensor accepts dim 0 or -1 (as torch) and reduces over nothing
        for d in (dim if isinstance(dim, (tuple, list)) else (dim,)):
            _norm_dim(d, 0)
        return ()
    if isinstance(dim, (tuple, list)):
        dims = tuple(sorted(set(_norm_dim(d, ndim) for d in dim)))
        if len(dims) != len(dim):
            raise ValueError(f"dim {tuple(dim)} names a dimension twice")
        return dims
    return (_norm_dim(dim, ndim),)


cdef inline Tensor _t(object x):
    """A tensor argument, with a clear TypeError for anything else."""
    if isinstance(x, Tensor):
        return <Tensor>x
    raise TypeError(f"expected a microtensor Tensor, got {type(x).__name__}")


cdef inline object _contig(object a):
    """A C-contiguous array (no copy when it already is); unlike
    np.ascontiguousarray, a 0-d array stays 0-d."""
    if a.flags.c_contiguous:
        return a
    return np.array(a, order="C", copy=True)
