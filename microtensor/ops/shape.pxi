# Shape ops: views and copies that move elements around. Backward moves the gradient
# back the same way. Which are views and which copies is torch's choice, op by op (each
# registry row says which); a view's strides are torch's too, size-1 dims included, and
# no tensor here ever has a negative stride (a negative step copies).

from numpy.lib.stride_tricks import as_strided as _as_strided


cdef object _restride(object a, tuple strides):
    """`a` with these byte strides, which differ from a's only on size-1 dims (where a
    stride moves nothing): the strides torch reports there, not numpy's."""
    if a.strides == strides:
        return a
    return _as_strided(a, a.shape, strides)

cdef tuple _shape_from_args(tuple args):
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    return tuple(int(a) for a in args)


cdef tuple _infer_shape(tuple shape, Py_ssize_t numel, tuple old):
    """Resolve one -1 in a reshape target and check the element count."""
    cdef int unknown = -1
    cdef Py_ssize_t known = 1
    for i, s in enumerate(shape):
        if s == -1:
            if unknown >= 0:
                raise ShapeError(f"reshape: only one dimension can be -1, got {shape}")
            unknown = i
        elif s < 0:
            raise ValueError(f"reshape: invalid size {s} in shape {shape}")
        else:
            known *= s
    if unknown >= 0:
        if known == 0 or numel % known != 0:
            raise ShapeError(f"shape '{list(shape)}' is invalid for input of size {numel} (shape {old})")
        shape = shape[:unknown] + (numel // known,) + shape[unknown + 1:]
    elif known != numel:
        raise ShapeError(f"shape '{list(shape)}' is invalid for input of size {numel} (shape {old})")
    return shape


cdef class ReshapeBackward(Node):
    """y = x.reshape(shape);  dx = g.reshape(x.shape)"""
    cdef readonly tuple shape
    cpdef tuple backward(self, g):
        return (g.reshape(self.shape),)

    def create_graph(self, g):
        """y = x.reshape(shape);  dx = g.reshape(x.shape)"""
        return (reshape(g, self.shape),)


def reshape(x, *shape):
    cdef Tensor t = _t(x)
    cdef tuple target = _infer_shape(_shape_from_args(shape), t._data.size, t._data.shape)
    if target == t._data.shape:
        return t if not t._requires_grad or not _grad_on() else _view_identity(t)
    cdef Tensor res = Tensor._wrap(t._data.reshape(target))
    if np.may_share_memory(res._data, t._data):
        _share_version(res, t)
    cdef ReshapeBackward node
    if _grad_on() and t._requires_grad:
        node = ReshapeBackward.__new__(ReshapeBackward)
        node.shape = t._data.shape
        _attach(res, node, (t,))
    return res


cdef Tensor _view_identity(Tensor t):
    cdef Tensor res = Tensor._wrap(t._data)
    _share_version(res, t)
    cdef ReshapeBackward node = ReshapeBackward.__new__(ReshapeBackward)
    node.shape = t._data.shape
    _attach(res, node, (t,))
    return res


def view(x, *shape):
    """Like reshape, but never copies: a shape the strides cannot express is an error
    (as torch's view), since a silent copy would break in-place updates through it."""
    cdef Tensor t = _t(x)
    cdef tuple target = _infer_shape(_shape_from_args(shape), t._data.size, t._data.shape)
    if target != t._data.shape and t._data.size > 1:
        probe = t._data.view()
        try:
            probe.shape = target          # numpy refuses exactly when a copy would be needed
        except AttributeError:
            raise RuntimeError(
                f"view size is not compatible with input tensor's size and stride (shape "
                f"{t._data.shape}, strides {t._data.strides}); use .reshape(...) instead") from None
    return reshape(t, target)


def flatten(x, start_dim=0, end_dim=-1):
    cdef Tensor t = _t(x)
    nd = t._data.ndim
    if nd == 0:
        return reshape(t, 1)
    s = _norm_dim(start_dim, nd)
    e = _norm_dim(end_dim, nd)
    if s > e:
        raise ArgumentError(f"flatten: start_dim ({start_dim}) comes after end_dim ({end_dim})")
    shp = t._data.shape
    merged = 1
    for k in shp[s:e + 1]:
        merged *= k
    return reshape(t, shp[:s] + (merged,) + shp[e + 1:])


def unflatten(x, dim, sizes):
    """x's dim split into `sizes` (one entry may be -1), a view: torch.unflatten."""
    cdef Tensor t = _t(x)
    shp = t._data.shape
    if not isinstance(sizes, (tuple, list)) or \
            not _builtins.all(isinstance(k, (int, np.integer)) and not isinstance(k, bool)
                              for k in sizes):
        raise TypeError(f"unflatten: sizes must be a tuple of ints, got {sizes!r}")
    if len(sizes) == 0:
        raise ArgumentError("unflatten: sizes must be non-empty")
    if len(shp) == 0:
        _norm_dim(dim, 1)                    # out of [-1, 0]: torch's IndexError
        raise ArgumentError(f"unflatten: dimension specified as {dim} but tensor has no "
                            f"dimensions")
    d = _norm_dim(dim, len(shp))
    sizes = tuple(int(k) for k in sizes)
    if sizes.count(-1) > 1:
        raise ArgumentError(f"unflatten: only one dimension can be inferred, got sizes {list(sizes)}")
    if _builtins.any(k < -1 for k in sizes):
        raise ArgumentError(f"unflatten: invalid size in {list(sizes)}")
    known = 1
    for k in sizes:
        if k != -1:
            known *= k
    if -1 in sizes:
        if known == 0 or shp[d] % known:
            raise ArgumentError(f"unflatten: sizes {list(sizes)} cannot make dim {d} of size "
                                f"{shp[d]} in the input tensor")
        sizes = tuple(shp[d] // known if k == -1 else k for k in sizes)
    elif known != shp[d]:
        raise ArgumentError(f"unflatten: provided sizes {list(sizes)} don't multiply up to the "
                            f"size of dim {d} ({shp[d]}) in the input tensor")
    target = shp[:d] + sizes + shp[d + 1:]
    cdef Tensor res = view(t, target)
    strides = _view_strides(t._data, target)
    numpys = res._data.strides
    if t._data.size and _builtins.any(k > 1 and a != b for k, a, b in zip(target, strides, numpys)):
        strides = numpys                     # (never: only size-1 dims may differ)
    res._data = _restride(res._data, strides)
    return res


cdef tuple _view_strides(object a, tuple shape):
    """The byte strides torch gives a view of `a` as `shape` (its computeStride): numpy's
    on every dim that moves, and torch's choice on the size-1 dims, which go with the
    chunk of contiguous dims they border from the back. An empty result takes the
    contiguous strides of its shape, each size counted as at least 1."""
    cdef Py_ssize_t n = len(shape), view_d = n - 1, tensor_d
    out = [0] * n
    if a.size == 0 or a.ndim == 0:
        step = a.itemsize
        for view_d in range(n - 1, -1, -1):
            out[view_d] = step
            step *= shape[view_d] if shape[view_d] > 1 else 1
        return tuple(out)
    old, old_strides = a.shape, a.strides
    base = old_strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(a.ndim - 1, -1, -1):
        tensor_numel *= old[tensor_d]
        if tensor_d == 0 or (old[tensor_d - 1] != 1 and
                             old_strides[tensor_d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                out[view_d] = view_numel * base
                view_numel *= shape[view_d]
                view_d -= 1
            if tensor_d > 0:
                base, tensor_numel, view_numel = old_strides[tensor_d - 1], 1, 1
    return tuple(out)


def unsqueeze(x, dim):
    cdef Tensor t = _t(x)
    cdef int d = _norm_dim(dim, t._data.ndim + 1)
    a = t._data
    shp = a.shape
    cdef Tensor res = reshape(t, shp[:d] + (1,) + shp[d:])
    # torch's stride for the new dim: the size times the step of the dim it lands before
    # (the itemsize at the end); numpy's reshape may say otherwise on a strided input
    step = shp[d] * a.strides[d] if d < a.ndim else a.itemsize
    res._data = _restride(res._data, a.strides[:d] + (step,) + a.strides[d:])
    return res


def squeeze(x, dim=None):
    cdef Tensor t = _t(x)
    shp = t._data.shape
    if dim is None:
        return reshape(t, tuple(s for s in shp if s != 1))
    if t._data.ndim == 0:
        _norm_dims(dim, 1)          # a 0-d tensor accepts dim 0 or -1 (IndexError otherwise)
        return t
    dims = _norm_dims(dim, t._data.ndim)
    return reshape(t, tuple(s for i, s in enumerate(shp) if not (i in dims and s == 1)))


cdef class PermuteBackward(Node):
    """y = x.permute(dims);  dx = g.permute(inverse(dims))"""
    cdef readonly tuple inverse
    cpdef tuple backward(self, g):
        return (g.transpose(self.inverse),)

    def create_graph(self, g):
        """y = x.permute(dims);  dx = g.permute(inverse(dims))"""
        return (permute(g, self.inverse),)


def permute(x, *dims):
    cdef Tensor t = _t(x)
    cdef tuple ds = _shape_from_args(dims)
    nd = t._data.ndim
    if len(ds) != nd:
        raise ShapeError(f"permute: number of dims {len(ds)} doesn't match the tensor's "
                         f"{nd} dims (shape {t._data.shape}); got dims {ds}")
    ds = tuple(_norm_dim(d, nd) for d in ds)
    if len(set(ds)) != nd:
        raise ShapeError(f"permute: dims {ds} repeat a dimension")
    cdef Tensor res = Tensor._wrap(t._data.transpose(ds))
    _share_version(res, t)
    cdef PermuteBackward node
    cdef list inverse
    cdef Py_ssize_t i
    if _grad_on() and t._requires_grad:
        node = PermuteBackward.__new__(PermuteBackward)
        inverse = [0] * nd                  # inverse[ds[i]] = i (argsort of a permutation)
        for i in range(nd):
            inverse[<Py_ssize_t>ds[i]] = i
        node.inverse = tuple(inverse)
        _attach(res, node, (t,))
    return res


def transpose(x, dim0, dim1):
    cdef Tensor t = _t(x)
    nd = t._data.ndim
    if nd == 0:
        _norm_dim(dim0, 0)          # a 0-d tensor takes dims 0 and -1 only (IndexError)
        _norm_dim(dim1, 0)
        return t
    a, b = _norm_dim(dim0, nd), _norm_dim(dim1, nd)
    order = list(range(nd))
    order[a], order[b] = order[b], order[a]
    return permute(t, tuple(order))


cdef class ExpandBackward(Node):
    """y = x.expand(sizes);  dx = g, summed over the expanded dims (the engine's sum to
    x's shape, as for every broadcast)"""
    cpdef tuple backward(self, g):
        return (g,)

    def create_graph(self, g):
        """y = x.expand(sizes);  dx = g, summed to x's shape by the engine"""
        return (g,)


cdef tuple _expand_strides(object a, tuple shape):
    """The byte strides torch gives a's expansion to `shape`: 0 on every dim that grows,
    the input's own step on the others, and on a new leading dim of size 1 the size times
    the step of the dim after it (a 0-d input: all 0)."""
    cdef Py_ssize_t n = len(shape), lead = n - a.ndim, i
    if a.ndim == 0:
        return (0,) * n
    strides = [0] * n
    for i in range(n - 1, -1, -1):
        if i >= lead:
            strides[i] = 0 if a.shape[i - lead] != shape[i] else a.strides[i - lead]
        else:
            strides[i] = 0 if shape[i] != 1 else shape[i + 1] * strides[i + 1]
    return tuple(strides)


def expand(x, *sizes):
    cdef Tensor t = _t(x)
    cdef tuple target = _shape_from_args(sizes)
    shp = t._data.shape
    if len(target) < len(shp):
        raise ShapeError(f"expand: the number of sizes ({len(target)}) must be at least the "
                         f"number of dims ({len(shp)}) of shape {shp}")
    lead = len(target) - len(shp)
    resolved = list(target)
    for i, s in enumerate(target):
        if s == -1:
            if i < lead:
                raise ShapeError(f"expand: -1 is not allowed for a new leading dim, got {target}")
            resolved[i] = shp[i - lead]
        elif i >= lead and shp[i - lead] != 1 and shp[i - lead] != s:
            raise ShapeError(f"expand: the expanded size {s} must match the existing size "
                             f"{shp[i - lead]} at dim {i} (shape {shp} -> {target})")
    strides = _expand_strides(t._data, tuple(resolved))
    # read-only where elements repeat (a write there is ambiguous: torch refuses it too)
    overlapping = _builtins.any(s == 0 and n > 1 for s, n in zip(strides, resolved))
    cdef Tensor res = Tensor._wrap(_as_strided(t._data, tuple(resolved), strides,
                                               writeable=not overlapping))
    _share_version(res, t)
    if _grad_on() and t._requires_grad:
        _attach(res, ExpandBackward.__new__(ExpandBackward), (t,))
    return res


def expand_as(x, other):
    return expand(x, other.shape)


def contiguous(x):
    cdef Tensor t = _t(x)
    if t._data.flags.c_contiguous:
        return t
    cdef Tensor res = Tensor._wrap(_contig(t._data))
    cdef ReshapeBackward node
    if _grad_on() and t._requires_grad:
        node = ReshapeBackward.__new__(ReshapeBackward)
        node.shape = t._data.shape
        _attach(res, node, (t,))
    return res


def split(x, split_size_or_sections, dim=0):
    cdef Tensor t = _t(x)
    if t._data.ndim == 0:
        raise ArgumentError("split expects at least a 1-dimensional tensor")
    cdef int d = _norm_dim(dim, t._data.ndim)
    n = t._data.shape[d]
    if isinstance(split_size_or_sections, (int, np.integer)):
        step = int(split_size_or_sections)
        if step <= 0:
            raise ValueError(f"split: split_size must be positive, got {step}")
        sizes = [step] * (n // step) + ([n % step] if n % step else [])
        if n == 0:
            sizes = [0]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if _builtins.any(s < 0 for s in sizes):
            raise ValueError(f"split: split sizes must be non-negative, got {sizes}")
        if _builtins.sum(sizes) != n:
            raise ShapeError(f"split: sizes {sizes} sum to {_builtins.sum(sizes)}, but dim {dim} "
                             f"has size {n}")
    out = []
    start = 0
    for s in sizes:
        key = (slice(None),) * d + (slice(start, start + s),)
        out.append(getitem(t, key))
        start += s
    return tuple(out)


def chunk(x, chunks, dim=0):
    cdef Tensor t = _t(x)
    if t._data.ndim == 0:
        raise ArgumentError("chunk expects at least a 1-dimensional tensor")
    if chunks <= 0:
        raise ValueError(f"chunk: chunks must be positive, got {chunks}")
    cdef int d = _norm_dim(dim, t._data.ndim)
    n = t._data.shape[d]
    size = -(-n // chunks) if n else 1
    return split(t, _builtins.max(size, 1), d)


cdef class CatBackward(Node):
    """y = cat(xs, dim);  dx_i = the slice of g that x_i filled"""
    cdef readonly list bounds
    cdef readonly int dim
    cpdef tuple backward(self, g):
        out = []
        for start, stop in self.bounds:
            key = (slice(None),) * self.dim + (slice(start, stop),)
            out.append(g[key])
        return tuple(out)

    def create_graph(self, g):
        """y = cat(xs, dim);  dx_i = the slice of g that x_i filled"""
        return tuple(getitem(g, (slice(None),) * self.dim + (slice(start, stop),))
                     if _wants(self, i) else None
                     for i, (start, stop) in enumerate(self.bounds))


def cat(tensors, dim=0):
    tensors = [_t(x) if isinstance(x, Tensor) else Tensor._wrap(_to_array(x, None)) for x in tensors]
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    nd = tensors[0]._data.ndim
    for tt in tensors:
        if (<Tensor>tt)._data.ndim == 0:
            raise ShapeError("cat: zero-dimensional tensors cannot be concatenated")
    cdef int d = _norm_dim(dim, nd)
    ref = tensors[0]._data.shape
    for i, tt in enumerate(tensors):
        s = (<Tensor>tt)._data.shape
        if len(s) != nd or s[:d] + s[d + 1:] != ref[:d] + ref[d + 1:]:
            raise ShapeError(f"cat: sizes of tensors must match except in dimension {d}; "
                             f"tensor 0 has shape {ref}, tensor {i} has shape {s}")
    arrays = [(<Tensor>tt)._data for tt in tensors]
    cdef Tensor res = Tensor._wrap(np.concatenate(arrays, axis=d))
    cdef CatBackward node
    inputs = tuple(tensors)
    if _needs_graph(inputs):
        node = CatBackward.__new__(CatBackward)
        bounds = []
        start = 0
        for a in arrays:
            bounds.append((start, start + a.shape[d]))
            start += a.shape[d]
        node.bounds, node.dim = bounds, d
        _attach(res, node, inputs)
    return res


def stack(tensors, dim=0):
    tensors = [_t(x) if isinstance(x, Tensor) else Tensor._wrap(_to_array(x, None)) for x in tensors]
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    ref = tensors[0]._data.shape
    d = _norm_dim(dim, len(ref) + 1)     # the dim first, as torch checks it
    for i, tt in enumerate(tensors):
        if (<Tensor>tt)._data.shape != ref:
            raise ShapeError(f"stack: expects each tensor to be equal size, but got {ref} at "
                             f"entry 0 and {(<Tensor>tt)._data.shape} at entry {i}")
    return cat([unsqueeze(tt, d) for tt in tensors], d)


cdef tuple _diagonal_geometry(tuple shape, int offset, int d1, int d2):
    """(first row, first column, length) of the offset-th diagonal of the (d1, d2) planes."""
    cdef int r0 = 0 if offset >= 0 else -offset, c0 = offset if offset >= 0 else 0
    return r0, c0, _builtins.max(0, _builtins.min(shape[d1] - r0, shape[d2] - c0))


cdef object _diagonal_view(object a, int offset, int d1, int d2):
    """A writable view of a's diagonal (numpy's np.diagonal is read-only): the other dims,
    then the diagonal with the step of a row plus a column, as torch."""
    r0, c0, n = _diagonal_geometry(a.shape, offset, d1, d2)
    rest = [k for k in range(a.ndim) if k != d1 and k != d2]
    start = a[tuple(slice(r0, None) if k == d1 else slice(c0, None) if k == d2 else slice(None)
                    for k in range(a.ndim))] if n else a
    return _as_strided(start, tuple(a.shape[k] for k in rest) + (n,),
                       tuple(a.strides[k] for k in rest) + (a.strides[d1] + a.strides[d2],))


cdef class DiagonalBackward(Node):
    """y = x.diagonal(offset, dim1, dim2);  dx = zeros, with g on that diagonal"""
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly int offset, dim1, dim2
    cpdef tuple backward(self, g):
        dx = np.zeros(self.shape, dtype=self.dtype)
        _diagonal_view(dx, self.offset, self.dim1, self.dim2)[...] = g
        return (dx,)

    def create_graph(self, g):
        """y = x.diagonal(offset, dim1, dim2);  dx = zeros, with g on that diagonal"""
        # built in the layout (other dims, dim1, dim2), where the diagonal is the last
        # two index arrays, then permuted back
        n = len(self.shape)
        rest = [k for k in range(n) if k != self.dim1 and k != self.dim2]
        order = rest + [self.dim1, self.dim2]
        r0, c0, length = _diagonal_geometry(self.shape, self.offset, self.dim1, self.dim2)
        i = np.arange(length)
        planes = add_at(g, (Ellipsis, r0 + i, c0 + i),
                        tuple(self.shape[k] for k in order), False)
        inverse = [0] * n
        for k in range(n):
            inverse[order[k]] = k
        return (permute(planes, tuple(inverse)),)


def diagonal(x, offset=0, dim1=0, dim2=1):
    """The offset-th diagonal of the (dim1, dim2) planes, as the last dim: a view (writes
    through it reach x), as torch's."""
    cdef Tensor t = _t(x)
    cdef int n = t._data.ndim
    if n < 2:
        raise IndexError(f"diagonal(): expected a tensor of at least 2 dims, got shape "
                         f"{t._data.shape}")
    cdef int d1 = _norm_dim(dim1, n), d2 = _norm_dim(dim2, n)
    if d1 == d2:
        raise ArgumentError(f"diagonal(): dim1 and dim2 cannot be identical, got {d1}")
    cdef Tensor res = Tensor._wrap(_diagonal_view(t._data, int(offset), d1, d2))
    _share_version(res, t)
    cdef DiagonalBackward node
    if _grad_on() and t._requires_grad:
        node = DiagonalBackward.__new__(DiagonalBackward)
        node.shape, node.dtype = t._data.shape, t._data.dtype
        node.offset, node.dim1, node.dim2 = int(offset), d1, d2
        _attach(res, node, (t,))
    return res


cdef class TrilBackward(Node):
    """y = tril(x, k) (or triu);  dx = tril(g, k)"""
    cdef readonly int k
    cdef readonly bint upper
    cpdef tuple backward(self, g):
        return ((np.triu if self.upper else np.tril)(g, self.k),)

    def create_graph(self, g):
        """y = tril(x, k) (or triu);  dx = tril(g, k)"""
        return ((triu if self.upper else tril)(g, self.k),)


cdef Tensor _tri(object x, int diagonal, bint upper):
    cdef Tensor t = _t(x)
    if t._data.ndim < 2:
        raise ShapeError(f"{'triu' if upper else 'tril'}: input must have at least 2 dims, "
                         f"got shape {t._data.shape}")
    cdef Tensor res = Tensor._wrap((np.triu if upper else np.tril)(t._data, diagonal))
    cdef TrilBackward node
    if _grad_on() and t._requires_grad:
        node = TrilBackward.__new__(TrilBackward)
        node.k, node.upper = diagonal, upper
        _attach(res, node, (t,))
    return res


def tril(x, diagonal=0):
    return _tri(x, diagonal, False)


def triu(x, diagonal=0):
    return _tri(x, diagonal, True)


# which tensors each rule reads in backward (version checks): none for pure data movement
declare_saved(ReshapeBackward)
declare_saved(PermuteBackward)
declare_saved(ExpandBackward)
declare_saved(CatBackward)
declare_saved(TrilBackward)
declare_saved(DiagonalBackward)


# the registry rows of this file: mt.<name> and t.<name>() (core/registry.pxi), each a
# view or a copy as torch's same op; the *_as methods take their shape from another
# tensor, as torch's
register_op("reshape", reshape, kind="shape", aliasing="view_or_copy")
register_op("view", view, kind="shape", aliasing="view")
register_op("flatten", flatten, kind="shape", aliasing="view_or_copy")
register_op("unflatten", unflatten, kind="shape", aliasing="view")
register_op("unsqueeze", unsqueeze, kind="shape", aliasing="view")
register_op("squeeze", squeeze, kind="shape", aliasing="view")
register_op("permute", permute, kind="shape", aliasing="view")
register_op("transpose", transpose, kind="shape", aliasing="view")
register_op("expand", expand, kind="shape", aliasing="view")
register_op("contiguous", contiguous, kind="shape", aliasing="view_or_copy")
register_op("split", split, kind="shape", aliasing="view")
register_op("chunk", chunk, kind="shape", aliasing="view")
register_op("cat", cat, method=False, kind="shape")
register_op("stack", stack, method=False, kind="shape")
register_op("tril", tril, kind="pointwise")
register_op("triu", triu, kind="pointwise")
register_op("diagonal", diagonal, kind="index", aliasing="view")
register_tensor_method("view_as", lambda self, other: view(self, other.shape), kind="shape",
                       aliasing="view")
register_tensor_method("reshape_as", lambda self, other: reshape(self, other.shape), kind="shape",
                       aliasing="view_or_copy")
register_tensor_method("expand_as", lambda self, other: expand(self, other.shape), kind="shape",
                       aliasing="view")
register_tensor_method("is_contiguous", lambda self: self._data.flags.c_contiguous, kind="shape",
                       aliasing="none")
