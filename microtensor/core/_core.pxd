# Declarations of the engine's two types, so that other Cython modules can reach
# their fields at C speed (`from microtensor.core._core cimport Tensor, Node`).

# NOTE: a field Python may set is typed (Cython checks each assignment) or readonly
# (set by the core only): nothing Python assigns reaches the engine unchecked.

cdef class _VersionCounter:
    cdef public long value


cdef class Node:
    cdef readonly tuple inputs       # the tensors this op read; grads flow back to them
    cdef public bint freed           # set after backward without retain_graph
    cdef public list _hooks          # hooks registered on the (non-leaf) output
    cdef readonly object _retained   # weakref to the output tensor, when it called retain_grad()
    cdef readonly tuple _saved_versions  # (counter, version, input index or -1, ...) per saved tensor
    cdef public int _saves           # which tensors the rule reads: bit i = input i, bit 30 = output
    cdef public object _trace        # where the op was created (anomaly mode only)
    cdef object __weakref__
    cpdef tuple backward(self, object grad_output)
    cpdef release(self)


cdef class Tensor:
    cdef public object _data         # the numpy array holding the values
    cdef public Tensor _grad         # a Tensor or None
    cdef public bint _requires_grad
    cdef public Node _node           # the op that made this tensor (None on leaves)
    cdef public list _hooks          # hooks of a leaf
    cdef public list _post_hooks     # leaf hooks that run after .grad is accumulated
    cdef public _VersionCounter _vc  # the version counter (shared with views), made on demand
    cdef object __weakref__

    @staticmethod
    cdef Tensor _wrap(object array)
    cdef _check_inplace(self)
    cpdef _bump_version(self)

