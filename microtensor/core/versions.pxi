# ---- version counters: an in-place change to a tensor that backward needs is an error --
#
# Every tensor can carry a counter that its in-place ops bump (views share their base's
# counter). When an op is recorded, the versions of the tensors its rule will read are
# noted (which ones: the rule's `saved` mask); backward compares them before it runs the
# rule. This is the one place the check hooks into: `_attach`, which every op calls.

cdef int SAVES_OUTPUT = 1 << 30
cdef int LIVE_SHIFT = 15       # bits 15..29: inputs only the create-graph rule reads (live)
cdef int MAX_SAVED = 15        # bits 0..14: inputs the backward rule reads
cdef int _SAVES_UNSET = -2
cdef dict _SAVED_MASKS = {}     # Node class -> mask (core rules declare theirs below them)


cdef class _VersionCounter:
    """How many in-place changes a tensor (and every view of it) has had."""
    pass


cdef inline _VersionCounter _counter(Tensor t):
    if t._vc is None:
        t._vc = _VersionCounter.__new__(_VersionCounter)
    return <_VersionCounter>t._vc


cdef inline void _bump(Tensor t):
    cdef _VersionCounter vc = _counter(t)
    vc.value += 1


cdef inline void _share_version(Tensor view, Tensor base):
    """`view` shares `base`'s storage, so an in-place change to one is a change to both."""
    view._vc = _counter(base)


cdef int _saved_mask(Node node):
    cdef int mask = node._saves
    if mask != _SAVES_UNSET:
        return mask
    cls = type(node)
    m = _SAVED_MASKS.get(cls)
    if m is None:
        # a rule written in Python declares `saved_mask`; without it, everything counts
        m = getattr(cls, "saved_mask", -1)
        _SAVED_MASKS[cls] = m
    return m


cdef inline _record_versions(Tensor out, Node node, tuple inputs, int mask):
    # kept flat, (counter, version, input index or -1) after one another: this runs for
    # every recorded op, so it allocates one tuple (two when a rule saves 3+ tensors).
    # An input only the create-graph rule reads is noted as -2 - index.
    cdef _VersionCounter vc
    cdef Py_ssize_t i, n = len(inputs)
    cdef tuple saved = ()
    for i in range(n if n < MAX_SAVED else MAX_SAVED):
        inp = inputs[i]
        if inp is None:
            continue
        if (mask >> i) & 1:
            vc = _counter(<Tensor>inp)
            saved = saved + (vc, vc.value, i)
        elif (mask >> (i + LIVE_SHIFT)) & 1:
            vc = _counter(<Tensor>inp)
            saved = saved + (vc, vc.value, -2 - i)
    if mask & SAVES_OUTPUT:
        vc = _counter(out)
        saved = saved + (vc, vc.value, -1)
    if saved:
        node._saved_versions = saved


def declare_saved(cls, *inputs, output=False, live=()):
    """Declare which tensors a rule reads in backward: input positions, and the output.
    `live`: inputs the backward keeps its own copy of, but the create-graph rule reads
    as the live tensors (to differentiate through them): checked on that path only."""
    cdef int mask = 0
    for i in tuple(inputs) + tuple(live):
        if not 0 <= i < MAX_SAVED:
            raise ValueError(f"declare_saved({cls.__name__}): input {i} is out of range "
                             f"(0..{MAX_SAVED - 1})")
    for i in inputs:
        mask |= 1 << i
    for i in live:
        mask |= 1 << (i + LIVE_SHIFT)
    if output:
        mask |= SAVES_OUTPUT
    _SAVED_MASKS[cls] = mask


cdef _check_versions(Node node, bint create_graph):
    """Raise if a tensor this node's rule reads (on this path: with or without
    create_graph) was changed in place after the forward pass."""
    cdef _VersionCounter vc
    cdef tuple saved = node._saved_versions
    cdef Py_ssize_t k
    cdef long index
    for k in range(0, len(saved), 3):
        index = saved[k + 2]
        if index <= -2 and not create_graph:
            continue                      # read live by the create-graph rule only
        vc = <_VersionCounter>saved[k]
        if vc.value != <long>saved[k + 1]:
            which = ("output 0" if index == -1 else
                     f"input {index}" if index >= 0 else f"input {-2 - index}")
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: {which} of {node.name()} is at "
                f"version {vc.value}; expected version {saved[k + 1]} instead. Compute the "
                f"in-place change out of place (y = y + 1) or clone() the tensor first.")
