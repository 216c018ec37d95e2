# The gradients of slices: a SliceGrad is zero except on grad_input[key] (what the
# backward of slicing returns), and a _SlicePile keeps the slice gradients one tensor
# receives until its gradient is complete, then builds them into one buffer. The engine
# (engine.pxi, included right after this file) adds them up; indexing.pxi's IndexBackward
# makes them.

cdef class SliceGrad:
    """A gradient that is zero except on `grad_input[key]` (the backward of slicing).

    The engine adds it straight into the input's gradient buffer, so taking three
    slices of one tensor (the q, k, v split) costs one buffer, not three zero-filled
    full-size arrays and two additions."""
    cdef public object key, value
    cdef public tuple shape
    cdef public object dtype

    def __init__(self, key, value, shape, dtype):
        self.key, self.value, self.shape, self.dtype = key, value, shape, dtype

    def dense(self):
        out = np.zeros(self.shape, dtype=self.dtype)
        out[self.key] = self.value
        return out


cdef class RowsGrad(SliceGrad):
    """A gradient that is zero except on the rows `key` (a 1-D index array) of a 2-D
    input, where it is the rows of `value`, a repeated index adding up (the backward of
    a row gather: an embedding's 256 rows of a 50,257-row table).

    The engine adds it straight into the input's gradient buffer: a tied embedding
    (GPT-2's wte, also its lm_head) gets its 256 rows added into the lm_head's gradient,
    not a zero-filled 154 MB array and a 154 MB addition. `adder(out, value, key)`, when
    given, is a kernel doing out[key] += value (repeats adding); else np.add.at."""
    cdef public object adder

    def __init__(self, key, value, shape, dtype, adder=None):
        SliceGrad.__init__(self, key, value, shape, dtype)
        self.adder = adder

    def add_into(self, out):
        """out[key] += value, a repeated index adding up."""
        if self.adder is not None:
            self.adder(out, self.value, self.key)
        else:
            np.add.at(out, self.key, self.value)

    def dense(self):
        out = np.zeros(self.shape, dtype=self.dtype)
        self.add_into(out)
        return out


cdef tuple _slice_box(object key, tuple shape):
    """The box (start, stop) per dim that a key of plain slices (step 1) selects, or None
    for any other key."""
    if type(key) is not tuple:
        key = (key,)
    if len(key) > len(shape):
        return None
    box = []
    for i, k in enumerate(key):
        if type(k) is not slice:
            return None
        start, stop, step = (<slice>k).indices(shape[i])
        if step != 1:
            return None
        box.append((start, stop if stop > start else start))
    for i in range(len(key), len(shape)):
        box.append((0, shape[i]))
    return tuple(box)


cdef bint _boxes_meet(tuple a, tuple b):
    for (a0, a1), (b0, b1) in zip(a, b):
        if a1 <= b0 or b1 <= a0:
            return False
    return True


cdef class _SlicePile:
    """The slice gradients one input received, kept until its node runs: the q, k and v
    of one projection (three slices of it) then make one buffer, each slice copied in
    once, with no zero fill when the slices tile it and no additions when they do not
    overlap (instead of a zero-filled buffer, a copy and two additions)."""
    cdef list grads
    cdef tuple shape
    cdef object dtype

    def __init__(self, SliceGrad first):
        self.grads = [first]
        self.shape, self.dtype = first.shape, first.dtype

    cdef add(self, SliceGrad g):
        self.grads.append(g)

    cdef object dense(self):
        boxes = [_slice_box((<SliceGrad>g).key, self.shape) for g in self.grads]
        tiled = False
        if _builtins.all(b is not None for b in boxes):
            volume = 0
            for b in boxes:
                n = 1
                for lo, hi in b:
                    n *= hi - lo
                volume += n
            total = 1
            for n in self.shape:
                total *= n
            tiled = volume == total and not _builtins.any(
                _boxes_meet(boxes[i], boxes[j])
                for i in range(len(boxes)) for j in range(i))
        out = (np.empty if tiled else np.zeros)(self.shape, dtype=self.dtype)
        written = []              # the boxes written so far; None: a piece of unknown extent
        for g, box in zip(self.grads, boxes):
            if box is not None and not _builtins.any(w is None or _boxes_meet(box, w)
                                                     for w in written):
                out[(<SliceGrad>g).key] = (<SliceGrad>g).value      # nothing there yet
            else:
                out[(<SliceGrad>g).key] += (<SliceGrad>g).value
            written.append(box)
        return out
