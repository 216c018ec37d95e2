# How a leaf's gradient reaches .grad: the gradients of its graph edges summed as they
# arrive (sparse pieces kept sparse: a slice's SliceGrad, an embedding's RowsGrad), then,
# once every edge has reported, its hooks, and .grad: the summed buffer itself when the
# engine alone holds it, else a private copy. run_backward (engine.pxi) calls
# _leaf_receive per edge and _finish_leaf per leaf.

from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK,
                               NOWAIT_LOCK)
from cpython.ref cimport Py_REFCNT


# One lock around leaf accumulation (see _accumulate_leaf). A C-level lock: taking it
# uncontended costs a few nanoseconds; waiting for it releases the GIL, since the thread
# holding it may be inside numpy's addition, which releases the GIL too.
cdef PyThread_type_lock _accumulate_lock = PyThread_allocate_lock()


cdef inline void _lock_accumulation():
    if not PyThread_acquire_lock(_accumulate_lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(_accumulate_lock, WAIT_LOCK)


cdef class _LeafGrad:
    """A leaf's gradient while backward runs: the sum so far, and how many graph edges
    into the leaf have yet to report (when none are left, the gradient is final)."""
    cdef Tensor leaf
    cdef object grad
    cdef Py_ssize_t waiting
    cdef bint owned          # grad is a buffer the engine alone holds (see _leaf_receive)


cdef _finish_leaf(_LeafGrad lg, dict captured, bint accumulate, bint create_graph):
    """A leaf's gradient is complete: its hooks, then .grad (or capture), then the
    post-accumulate hooks (DistributedDataParallel starts its all-reduce from there)."""
    cdef Tensor t = lg.leaf
    g = lg.grad
    cdef bint owned = lg.owned
    lg.grad = None
    if g is None:
        return
    if t._hooks or captured is not None:
        if _is_piece(g):
            g, owned = _dense(g), True
    if t._hooks:
        g = _run_tensor_hooks(t._hooks, g, create_graph)
        owned = False                  # a hook may have kept the array it was shown
    if captured is not None:
        captured[id(t)] = g
    elif accumulate:
        _accumulate_leaf(t, g, owned)
        if t._post_hooks:
            for hook in list(t._post_hooks):
                hook(t)


cdef _accumulate_leaf(Tensor t, object g, bint owned=False):
    """t.grad += g. The first time, .grad becomes g itself when the engine `owned` it (a
    buffer nothing else can reach: see _unshared), else a private copy of g, which may be
    shared (the upstream gradient, an array a rule also handed another input, a hook's).

    A lock makes this safe when several threads run backward into one shared parameter
    (numpy releases the GIL inside the addition, so two unlocked adds can lose one)."""
    _lock_accumulation()
    try:
        if isinstance(g, Tensor):             # create_graph: keep the graph of the gradient
            # the first time a (differentiable) copy, as PyTorch: g may be a tensor the
            # caller passed to backward, which .grad must never alias
            t._grad = (<Tensor>g).clone() if t._grad is None else add(t._grad, g)
            return
        if t._grad is None:
            if _is_piece(g):
                g, owned = _dense(g), True
            if owned and _fits_as_grad(g, t._data):
                t._grad = Tensor._wrap(g)     # taken over: no copy of the whole gradient
            else:
                t._grad = Tensor._wrap(np.array(g, dtype=t._data.dtype, order="C", copy=True))
        else:
            gd = (<Tensor>t._grad)._data
            if gd.flags.writeable and gd.shape == t._data.shape:
                if _is_piece(g):
                    _add_piece(gd, g)         # only the rows or slices it holds
                else:
                    np.add(gd, g, out=gd, casting="unsafe")
            else:
                t._grad = Tensor._wrap(gd + _dense(g))
    finally:
        PyThread_release_lock(_accumulate_lock)


cdef bint _fits_as_grad(object g, object data):
    """Whether array g can be a leaf's .grad as it is: its dtype, shape, C order, writable."""
    return (type(g) is np.ndarray and g.dtype == data.dtype and g.shape == data.shape
            and g.flags.c_contiguous and g.flags.writeable)


cdef bint _unshared(object a, Py_ssize_t held):
    """Whether array `a`, which the caller holds `held` times, is a buffer the engine may
    keep and write: writable, contiguous (no element seen twice: a broadcast is neither),
    and sharing its memory with nothing else: no other reference to it, and each array its
    memory comes from (its .base chain) held only by the view above it. (PyTorch's
    AccumulateGrad takes a gradient over on the same test: a use count of one.)"""
    if type(a) is not np.ndarray or Py_REFCNT(a) > held:
        return False
    flags = (<cnp.ndarray>a).flags
    if not (flags.writeable and (flags.c_contiguous or flags.f_contiguous)):
        return False
    cdef object base = a.base
    while base is not None:
        # the view above holds it once, `base` here once
        if type(base) is not np.ndarray or Py_REFCNT(base) > 2:
            return False
        base = base.base
    return True


cdef inline bint _is_piece(object g):
    """A gradient kept sparse: a slice's or a row gather's, or a pile of slices."""
    return type(g) is _SlicePile or isinstance(g, SliceGrad)


cdef object _dense(object g):
    """A sparse gradient as one fresh buffer (an array or a tensor as it is)."""
    if type(g) is _SlicePile:
        return (<_SlicePile>g).dense()
    if isinstance(g, SliceGrad):
        return g.dense()
    return g


cdef _add_piece(object out, object piece):
    """out += a sparse gradient, in place, touching only what the piece holds."""
    if type(piece) is _SlicePile:
        for sg in (<_SlicePile>piece).grads:
            out[(<SliceGrad>sg).key] += (<SliceGrad>sg).value
    elif type(piece) is RowsGrad:
        piece.add_into(out)
    else:
        out[(<SliceGrad>piece).key] += (<SliceGrad>piece).value


cdef _leaf_receive(_LeafGrad lg, object gi, bint gi_owned):
    """lg.grad += gi, one edge's gradient into a leaf. Slices pile up (one buffer when the
    leaf completes); a row gather's rows wait as they are; a dense gradient the engine
    owns takes the sparse pieces in place; two dense ones add in place when one is owned.
    lg.owned says whether the engine may hand lg.grad to .grad without a copy."""
    prev = lg.grad
    if prev is None:
        if type(gi) is SliceGrad:
            lg.grad, lg.owned = _SlicePile(gi), True
        else:
            lg.grad, lg.owned = gi, gi_owned or type(gi) is RowsGrad
        return
    if type(gi) is SliceGrad and type(prev) is _SlicePile:
        (<_SlicePile>prev).add(<SliceGrad>gi)
        return
    if isinstance(prev, Tensor) or isinstance(gi, Tensor):    # create_graph
        lg.grad, lg.owned = _gsum(_dense(prev), _dense(gi)), False
        return
    if _is_piece(prev) and _is_piece(gi):
        prev, lg.owned = _dense(prev), True
    if _is_piece(gi):                       # into the dense sum so far
        if not lg.owned:
            prev = np.array(prev, copy=True)
        _add_piece(prev, gi)
        lg.grad, lg.owned = prev, True
    elif _is_piece(prev):                   # the sum so far into this dense gradient
        if not gi_owned:
            gi = np.array(gi, copy=True)
        _add_piece(gi, prev)
        lg.grad, lg.owned = gi, True
    elif lg.owned and prev.ndim and prev.flags.writeable:
        np.add(prev, gi, out=prev)
    elif gi_owned and gi.ndim and gi.flags.writeable:
        np.add(gi, prev, out=gi)
        lg.grad = gi
        lg.owned = True
    else:
        lg.grad, lg.owned = _gsum(prev, gi), True
