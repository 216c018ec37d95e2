# Declarations of the engine's two types, so that other Cython modules can reach
# their fields at C speed (`from microtensor._core cimport Tensor, Node`).

cdef class Node:
    cdef public tuple inputs         # the tensors this op read; grads flow back to them
    cdef public bint freed           # set after backward without retain_graph
    cdef public list _hooks          # hooks registered on the (non-leaf) output
    cdef public object _retained     # the output tensor, when it called retain_grad()
    cdef public object _trace        # where the op was created (anomaly mode only)
    cdef object __weakref__
    cpdef tuple backward(self, object grad_output)
    cpdef release(self)


cdef class Tensor:
    cdef public object _data         # the numpy array holding the values
    cdef public object _grad         # a Tensor or None
    cdef public bint _requires_grad
    cdef public Node _node           # the op that made this tensor (None on leaves)
    cdef public list _hooks          # hooks of a leaf
    cdef object __weakref__

    @staticmethod
    cdef Tensor _wrap(object array)
    cdef _check_inplace(self)
