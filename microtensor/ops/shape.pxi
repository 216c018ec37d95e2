# Shape ops: views and copies that move elements around. Backward moves the gradient
# back the same way.

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


def unsqueeze(x, dim):
    cdef Tensor t = _t(x)
    cdef int d = _norm_dim(dim, t._data.ndim + 1)
    shp = t._data.shape
    return reshape(t, shp[:d] + (1,) + shp[d:])


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
    cdef Tensor res = Tensor._wrap(np.broadcast_to(t._data, tuple(resolved)))
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


# ---- indexing ------------------------------------------------------------------

cdef object _index_key(object key):
    """Tensors and lists inside an index become numpy arrays."""
    if isinstance(key, tuple):
        return tuple(_index_part(k) for k in key)
    return _index_part(key)


cdef object _index_part(object k):
    if isinstance(k, Tensor):
        a = (<Tensor>k)._data
        if a.dtype.kind == "f":
            raise IndexError("tensors used as indices must be long, int or bool, got float")
        return a if a.ndim else a.item()
    if isinstance(k, list):
        a = np.asarray(k)
        if a.dtype.kind == "f":
            raise IndexError("lists used as indices must hold integers or bools")
        return a
    return k


cdef bint _is_basic(object key):
    if isinstance(key, tuple):
        for k in key:
            if isinstance(k, np.ndarray):
                return False
        return True
    return not isinstance(key, np.ndarray)


cdef class IndexBackward(Node):
    """y = x[key];  dx = zeros, then dx[key] += g (repeated indices accumulate)"""
    cdef readonly object key
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly bint basic
    cpdef tuple backward(self, g):
        key = self.key
        if self.basic:
            return (SliceGrad(key, g, self.shape, self.dtype),)
        dinp = np.zeros(self.shape, dtype=self.dtype)
        if isinstance(key, np.ndarray) and key.dtype == int64 and key.ndim == 1 \
                and dinp.ndim >= 1 and (self.dtype == float32 or self.dtype == float64):
            # the common gather of rows: a Cython scatter-add kernel
            idx = np.where(key < 0, key + self.shape[0], key)
            if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
                raise IndexError(f"index out of range in backward of indexing (size {self.shape[0]})")
            rows = dinp.reshape(self.shape[0], -1)
            scatter_add_rows(rows, idx, _contig(g).reshape(len(idx), -1))
        else:
            np.add.at(dinp, key, g)
        return (dinp,)

    cpdef release(self):
        self.key = None

    def create_graph(self, g):
        """y = x[key];  dx = zeros, then dx[key] += g"""
        return (add_at(g, self.key, self.shape, self.basic),)


cdef bint _ints_beside_arrays(object key):
    """A tuple index holding both plain ints and index arrays (and nothing that moves dims:
    no None, no Ellipsis, no bool masks). numpy counts the ints as advanced indices, so
    x[i, :, idx] would put idx's dims first; torch applies the ints first (a select)."""
    if not isinstance(key, tuple):
        return False
    cdef bint has_int = False, has_array = False
    for k in key:
        if k is None or k is Ellipsis:
            return False
        if isinstance(k, np.ndarray):
            if k.dtype == bool_:
                return False
            has_array = True
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            has_int = True
    return has_int and has_array


cdef tuple _select_then_gather(tuple key):
    """torch's order for a key of ints beside index arrays: (select, gather). The select
    applies the ints and slices (the arrays' dims kept whole); the gather applies the
    arrays to what is left, every other dim kept whole (its slice is already applied)."""
    first = tuple(slice(None) if isinstance(k, np.ndarray) else k for k in key)
    rest = tuple(k if isinstance(k, np.ndarray) else slice(None) for k in key
                 if isinstance(k, bool) or not isinstance(k, (int, np.integer)))
    return first, rest


cdef bint _is_mask(object k):
    if isinstance(k, Tensor):                   # a 0-d one too: x[t] keeps 1 or 0 rows
        return (<Tensor>k)._data.dtype == bool_
    return isinstance(k, np.ndarray) and k.dtype == bool_ and k.ndim > 0


cdef bint _has_mask(object key):
    """Whether an index key (before _index_key) holds a boolean tensor or array: its
    result's shape is read from the values."""
    if isinstance(key, tuple):
        for k in key:
            if _is_mask(k):
                return True
        return False
    return _is_mask(key)


def getitem(x, key):
    cdef Tensor t = _t(x)
    if _capture_hook is not None and _has_mask(key):
        _capture_hook(t, "indexing with a boolean mask (a shape read from the values)")
    key = _index_key(key)
    if _ints_beside_arrays(key):
        first, rest = _select_then_gather(key)
        return getitem(getitem(t, first), rest)
    try:
        out = t._data[key]
    except IndexError as e:
        raise IndexError(f"{e} (indexing a tensor of shape {t._data.shape})") from None
    if not isinstance(out, np.ndarray):
        out = np.asarray(out)
    cdef Tensor res = Tensor._wrap(out)
    cdef bint basic = _is_basic(key)
    if basic:
        _share_version(res, t)
    cdef IndexBackward node
    if _grad_on() and t._requires_grad:
        node = IndexBackward.__new__(IndexBackward)
        # index arrays are copied: the caller may change its index tensor before backward
        node.key = key if basic else _own_key(key)
        node.shape, node.dtype = t._data.shape, t._data.dtype
        node.basic = basic
        _attach(res, node, (t,))
    return res


cdef object _own_key(object key):
    if isinstance(key, tuple):
        return tuple(k.copy() if isinstance(k, np.ndarray) else k for k in key)
    return key.copy() if isinstance(key, np.ndarray) else key


def index_select(x, dim, index):
    cdef Tensor t = _t(x)
    d = _norm_dim(dim, t._data.ndim)
    return getitem(t, (slice(None),) * d + (index,))


# which tensors each rule reads in backward (version checks): none for pure data movement
declare_saved(ReshapeBackward)
declare_saved(PermuteBackward)
declare_saved(ExpandBackward)
declare_saved(CatBackward)
declare_saved(TrilBackward)
declare_saved(IndexBackward)


# the registry rows of this file: mt.<name> and t.<name>() (core/registry.pxi); the *_as
# methods take their shape from another tensor, as torch's
register_op("reshape", reshape, kind="shape")
register_op("view", view, kind="shape")
register_op("flatten", flatten, kind="shape")
register_op("unsqueeze", unsqueeze, kind="shape")
register_op("squeeze", squeeze, kind="shape")
register_op("permute", permute, kind="shape")
register_op("transpose", transpose, kind="shape")
register_op("expand", expand, kind="shape")
register_op("contiguous", contiguous, kind="shape")
register_op("split", split, kind="shape")
register_op("chunk", chunk, kind="shape")
register_op("cat", cat, method=False, kind="shape")
register_op("stack", stack, method=False, kind="shape")
register_op("tril", tril, kind="pointwise")
register_op("triu", triu, kind="pointwise")
register_op("getitem", getitem, method=False, operator="[]", kind="index")
register_op("index_select", index_select, kind="index")
register_tensor_method("view_as", lambda self, other: reshape(self, other.shape), kind="shape")
register_tensor_method("reshape_as", lambda self, other: reshape(self, other.shape), kind="shape")
register_tensor_method("expand_as", lambda self, other: expand(self, other.shape), kind="shape")
register_tensor_method("is_contiguous", lambda self: self._data.flags.c_contiguous, kind="shape")
