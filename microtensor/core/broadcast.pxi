# Included in core/_core.pyx, before engine.pxi, which calls _as_grad_array on every
# gradient a rule hands back.
#
# Broadcasting is undone here, once, for every rule.
# A rule returns each input's gradient in the shape the forward computed in (the broadcast
# shape); the engine sums it down to the input's shape as it hands it on (torch's engine
# does the same in validate_outputs, tinygrad 2020 in its one unbroadcast()). Rules stay
# free of shape bookkeeping, and a custom Function may return a broadcast gradient too.

cdef bint _expands_to(tuple shape, tuple grad_shape):
    """Whether broadcasting `shape` can give `grad_shape` (so summing undoes it)."""
    cdef Py_ssize_t extra = len(grad_shape) - len(shape), i
    if extra < 0:
        return False
    for i in range(len(shape)):
        if shape[i] != 1 and shape[i] != grad_shape[extra + i]:
            return False
    return True


cdef tuple _broadcast_axes(tuple shape, tuple grad_shape):
    """The axes of a `grad_shape` gradient to sum (keeping them) to reach `shape`, after
    the leading `len(grad_shape) - len(shape)` axes are summed away."""
    return tuple(i for i in range(len(shape)) if shape[i] == 1 and grad_shape[
        len(grad_shape) - len(shape) + i] != 1)


cdef object unbroadcast(object grad, tuple shape):
    """Sum the array `grad` down to `shape`, undoing numpy broadcasting."""
    cdef tuple grad_shape = grad.shape
    if grad_shape == shape:
        return grad
    cdef Py_ssize_t extra = len(grad_shape) - len(shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = _broadcast_axes(shape, grad_shape)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


cdef object _sum_to(object g, tuple shape):
    """unbroadcast for a tensor gradient (create_graph): a differentiable sum."""
    cdef tuple grad_shape = (<Tensor>g)._data.shape
    cdef Py_ssize_t extra = len(grad_shape) - len(shape)
    if extra > 0:
        g = sum(g, tuple(range(extra)))
    axes = _broadcast_axes(shape, grad_shape)
    if axes:
        g = sum(g, axes, True)
    return g


cdef object _as_grad_array(object g, Tensor t):
    """One gradient coming out of a backward rule, made ready for its input tensor:
    summed down to the input's shape where the rule returned it broadcast, and cast to
    the input's dtype. Only a shape tuple comparison when nothing is to be done."""
    cdef tuple shape = t._data.shape
    if isinstance(g, SliceGrad):           # a slice's, or a row gather's (RowsGrad)
        if (<SliceGrad>g).shape != shape:
            raise RuntimeError(f"internal error: slice gradient for shape {(<SliceGrad>g).shape} "
                               f"reached an input of shape {shape}")
        if type(g) is RowsGrad and (<SliceGrad>g).dtype != t._data.dtype:
            return g.dense().astype(t._data.dtype)
        return g
    if isinstance(g, Tensor):            # create_graph: gradients are tensors
        if (<Tensor>g)._data.shape != shape:
            if not _expands_to(shape, (<Tensor>g)._data.shape):
                raise RuntimeError(
                    f"internal error: gradient of shape {(<Tensor>g)._data.shape} for an input "
                    f"of shape {shape}")
            g = _sum_to(g, shape)
        return g
    if g.shape != shape:
        if not _expands_to(shape, g.shape):
            raise RuntimeError(
                f"internal error: gradient of shape {g.shape} for an input of shape {shape}")
        g = unbroadcast(g, shape)
    if g.dtype != t._data.dtype:
        g = g.astype(t._data.dtype)
    return g


def sum_to_inputs(Node node, tuple grads):
    """The gradients a rule returned as the engine hands them on: each summed down to
    its input's shape and cast to its dtype (None stays None). For code that runs a
    node's rule itself and records what it sends (mt.inspect's per-node hooks)."""
    cdef list out = []
    cdef Py_ssize_t i
    for i in range(len(grads)):
        gi = grads[i]
        inp = node.inputs[i] if i < len(node.inputs) else None
        out.append(gi if gi is None or inp is None else _as_grad_array(gi, <Tensor>inp))
    return tuple(out)
