# Indexing: x[key] and index_select. Basic keys (ints, slices, None, ...) give views with
# torch's strides (a None dim: the size times the step of the dim it lands before); a
# negative step, which torch refuses, gives a copy (no tensor has a negative stride);
# index arrays and masks give new memory in C order. Backward adds the gradient back at
# [key] (core/slice_grads.pxi for slices).

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


cdef tuple _c_strides(tuple shape, Py_ssize_t itemsize):
    """The byte strides of a new C-order array of this shape (size-1 dims included)."""
    cdef list out = []
    cdef Py_ssize_t step = itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n if n > 1 else 1
    return tuple(reversed(out))


cdef bint _negative_step(object key):
    if isinstance(key, slice):
        return key.step is not None and key.step < 0
    if isinstance(key, tuple):
        for k in key:
            if isinstance(k, slice) and k.step is not None and k.step < 0:
                return True
    return False


cdef bint _has_new_axis(object key):
    if key is None:
        return True
    if isinstance(key, tuple):
        for k in key:
            if k is None:
                return True
    return False


cdef tuple _new_axis_strides(object key, object a, object out):
    """out = a[key] (basic) with torch's stride on each None dim: torch indexes left to
    right and a None unsqueezes before the input dim not yet indexed (its size times its
    step; the itemsize past the last dim). numpy puts 0 there."""
    key = key if isinstance(key, tuple) else (key,)
    strides = list(out.strides)
    cdef Py_ssize_t given = 0, j = 0, o = 0
    for k in key:
        if k is not None and k is not Ellipsis:
            given += 1
    for k in key:
        if k is None:
            strides[o] = a.shape[j] * a.strides[j] if j < a.ndim else a.itemsize
            o += 1
        elif k is Ellipsis:
            j += a.ndim - given
            o += a.ndim - given
        elif isinstance(k, slice):
            j += 1
            o += 1
        elif isinstance(k, (bool, np.bool_)):
            return out.strides            # a bool scalar adds a dim: numpy's strides kept
        else:
            j += 1                        # an int: the dim is gone
    return tuple(strides)


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
    cdef bint basic = _is_basic(key)
    cdef bint view = basic
    if not isinstance(out, np.ndarray):
        # numpy hands back a scalar for x[i, j]: a trailing ... makes it a 0-d view
        out = t._data[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)] if basic \
            else np.asarray(out)
    if not basic:
        # new memory in C order with the standard steps (numpy's advanced index may
        # leave the dims in another order in memory), as torch's index gives
        out = _restride(_contig(out), _c_strides(out.shape, out.itemsize))
    else:
        if _negative_step(key):
            # torch refuses a negative step; here it gives a copy, never a view with a
            # negative stride (no tensor of the engine has one)
            out, view = out.astype(out.dtype, copy=True), False
        elif _has_new_axis(key):
            out = _restride(out, _new_axis_strides(key, t._data, out))
    cdef Tensor res = Tensor._wrap(out)
    if view:
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


# which tensors each rule reads in backward (version checks): none, the key is owned
declare_saved(IndexBackward)


# the registry rows of this file (core/registry.pxi)
register_op("getitem", getitem, method=False, operator="[]", kind="index",
            aliasing="view_or_copy")
register_op("index_select", index_select, kind="index")
