# Kernels over a list of arrays in one call (PyTorch's `_foreach` ops): gradient clipping's
# sum of squares over every gradient of a model, and its scaling of every gradient, each
# one call from Python instead of one per parameter.
#
# Safety: every entry checks each array it is handed (a float32 or float64 ndarray,
# C-contiguous, and writeable where it is written) before any pointer is taken, and
# names the first one that is not; the loops then run without the GIL on those pointers.
#
# Bits: sum_of_squares splits every array into blocks of _BLOCK elements, sums each block
# with eight running sums in double, and adds the blocks' sums in order, array after
# array. The split does not depend on the thread count, so the result has the same bits
# whatever team computes it (the threads only share out the blocks).

import numpy as np
cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdlib cimport malloc, free
cimport cython
from microtensor.kernels._common cimport threads_for, use_team
from microtensor.kernels._blas import team_pointer as _team_pointer

cnp.import_array()
use_team(_team_pointer())   # the team microtensor.kernels._blas measures (team_of in kernels/_common.pxd)

# Elements per block of the sum (and per thread's share of the scaling). Parallel
# threshold: both kernels move memory at about 0.3 ns an element at one thread (float32,
# a 2-core Intel Xeon, Sapphire Rapids class), so a team pays off from 2^17 elements.
cdef Py_ssize_t _BLOCK = 16384
cdef double _PARALLEL_MIN = 1 << 17


cdef struct _Part:
    char* data            # the array's first element
    Py_ssize_t start      # this block's first element, and its end
    Py_ssize_t stop
    bint is_double


cdef double _block_f(const float* x, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """sum(x[i:n]^2) in double, with eight running sums (which vectorise)."""
    cdef double s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef double a0, a1, a2, a3, a4, a5, a6, a7
    while i + 8 <= n:
        a0 = x[i]; a1 = x[i + 1]; a2 = x[i + 2]; a3 = x[i + 3]
        a4 = x[i + 4]; a5 = x[i + 5]; a6 = x[i + 6]; a7 = x[i + 7]
        s0 = s0 + a0 * a0; s1 = s1 + a1 * a1; s2 = s2 + a2 * a2; s3 = s3 + a3 * a3
        s4 = s4 + a4 * a4; s5 = s5 + a5 * a5; s6 = s6 + a6 * a6; s7 = s7 + a7 * a7
        i = i + 8
    while i < n:
        a0 = x[i]
        s0 = s0 + a0 * a0
        i = i + 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


cdef double _block_d(const double* x, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """_block_f for float64 arrays."""
    cdef double s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    while i + 8 <= n:
        s0 = s0 + x[i] * x[i]; s1 = s1 + x[i + 1] * x[i + 1]
        s2 = s2 + x[i + 2] * x[i + 2]; s3 = s3 + x[i + 3] * x[i + 3]
        s4 = s4 + x[i + 4] * x[i + 4]; s5 = s5 + x[i + 5] * x[i + 5]
        s6 = s6 + x[i + 6] * x[i + 6]; s7 = s7 + x[i + 7] * x[i + 7]
        i = i + 8
    while i < n:
        s0 = s0 + x[i] * x[i]
        i = i + 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


cdef cnp.ndarray _checked(str kernel, object a, Py_ssize_t index, bint writes):
    """a, if the kernels may take its pointer: a float32 / float64 C-contiguous ndarray
    (writeable when the kernel writes it)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{kernel}: item {index} is a {type(a).__name__}, not a numpy array")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    cdef int t = cnp.PyArray_TYPE(arr)
    if t != cnp.NPY_FLOAT32 and t != cnp.NPY_FLOAT64:
        raise TypeError(f"{kernel}: item {index} has dtype {arr.dtype}; float32 or float64 "
                        "arrays only")
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise ValueError(f"{kernel}: item {index} is not C-contiguous")
    if writes and not cnp.PyArray_ISWRITEABLE(arr):
        raise ValueError(f"{kernel}: item {index} is read-only")
    return arr


cdef _Part* _parts(str kernel, list arrays, bint writes, Py_ssize_t block, Py_ssize_t* count,
                   Py_ssize_t* total) except NULL:
    """Every array of the list cut into blocks of `block` elements, in order (malloc'd;
    the caller frees it). The arrays must stay alive while the parts are read."""
    cdef Py_ssize_t i, n, start, k = 0, blocks = 0
    cdef cnp.ndarray arr
    checked = [_checked(kernel, a, i, writes) for i, a in enumerate(arrays)]
    for arr in checked:
        blocks += (cnp.PyArray_SIZE(arr) + block - 1) // block
    cdef _Part* parts = <_Part*>malloc(max(blocks, 1) * sizeof(_Part))
    if parts == NULL:
        raise MemoryError(f"{kernel}: cannot allocate the list of {blocks} blocks")
    total[0] = 0
    for arr in checked:
        n = cnp.PyArray_SIZE(arr)
        total[0] += n
        start = 0
        while start < n:
            parts[k].data = <char*>cnp.PyArray_DATA(arr)
            parts[k].start = start
            parts[k].stop = start + block if start + block < n else n
            parts[k].is_double = cnp.PyArray_TYPE(arr) == cnp.NPY_FLOAT64
            start += block
            k += 1
    count[0] = k
    return parts


@cython.boundscheck(False)
@cython.wraparound(False)
def sum_of_squares(list arrays, int num_threads=1):
    """sum over every array of sum(a^2), accumulated in double: the squared 2-norm of the
    arrays taken together (clip_grad_norm_'s total), in one call. The same bits at any
    thread count (see the top of this file)."""
    cdef Py_ssize_t count, total, b
    cdef double result = 0
    cdef _Part* parts = _parts("sum_of_squares", arrays, False, _BLOCK, &count, &total)
    cdef double* partial = <double*>malloc(max(count, 1) * sizeof(double))
    if partial == NULL:
        free(parts)
        raise MemoryError(f"sum_of_squares: cannot allocate {count} partial sums")
    try:
        for b in prange(count, nogil=True, schedule="static",
                        num_threads=threads_for(<double>total, _PARALLEL_MIN, num_threads)):
            if parts[b].is_double:
                partial[b] = _block_d(<const double*>parts[b].data, parts[b].start, parts[b].stop)
            else:
                partial[b] = _block_f(<const float*>parts[b].data, parts[b].start, parts[b].stop)
        for b in range(count):
            result += partial[b]
    finally:
        free(partial)
        free(parts)
    return result


@cython.boundscheck(False)
@cython.wraparound(False)
def mul_(list arrays, double scale, int num_threads=1):
    """a *= scale for every array, in place, each in its own dtype: a float32 element
    becomes float32(double(a) * scale), which is numpy's `np.multiply(a, s, out=a)` for a
    float32 or float64 scalar s of that value (the double product of two float32 numbers
    is exact, so it rounds once)."""
    cdef Py_ssize_t count, total, b, i
    cdef float* f
    cdef double* d
    cdef _Part* parts = _parts("mul_", arrays, True, _BLOCK, &count, &total)
    try:
        for b in prange(count, nogil=True, schedule="static",
                        num_threads=threads_for(<double>total, _PARALLEL_MIN, num_threads)):
            if parts[b].is_double:
                d = <double*>parts[b].data
                for i in range(parts[b].start, parts[b].stop):
                    d[i] = d[i] * scale
            else:
                f = <float*>parts[b].data
                for i in range(parts[b].start, parts[b].stop):
                    f[i] = <float>(<double>f[i] * scale)
    finally:
        free(parts)
