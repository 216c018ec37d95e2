# distutils: extra_compile_args = -fno-math-errno
# (sqrt without errno bookkeeping, so that the update loops vectorize)
# Cython kernels of the optimizer updates: one call per parameter, in place, no
# temporaries. Each takes flat contiguous views (the caller passes `p._data.reshape(-1)`)
# of one fused float type, releases the GIL and splits the elements across threads.
#
# The arithmetic follows PyTorch's single-tensor (CPU) code path operation by operation,
# so that float64 results agree to rounding:
#   Adam   g = grad + wd * p                    (L2 penalty, coupled)
#   AdamW  p = p * (1 - lr * wd)                (decoupled decay, before the update)
#   m = m + (1 - b1) * (g - m)                  (torch's lerp form when b1 > 0.5)
#   v = v * b2 + (1 - b2) * g * g               (mul_ then addcmul_)
#   p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)      (addcdiv_)
# with bc1 = 1 - b1**step, bc2 = 1 - b2**step computed once, in double, per call.

from cython.parallel cimport prange
from libc.math cimport sqrt, sqrtf
from libc.stdlib cimport malloc, free
cimport cython
import numpy as np
cimport numpy as cnp
from microtensor.kernels._common cimport real, threads_for, use_team
from microtensor.kernels._blas import team_pointer as _team_pointer

use_team(_team_pointer())   # the team microtensor.kernels._blas measures (team_of in kernels/_common.pxd)
cnp.import_array()

# Parallel threshold (elements; see threads_for in kernels/_common.pxd): adam_step at one
# thread, float32, 1.8 ns an element (2^15 elements in 58 us) on a 2-core Intel Xeon
# (Sapphire Rapids class, best of many runs); sgd_step takes the same bound.
cdef double _PARALLEL_MIN = 1 << 15


cdef _check_length(str kernel, str what, Py_ssize_t got, Py_ssize_t n):
    # NOTE: bounds checks are off in the loops below, so a buffer shorter than the
    # parameter (a tampered checkpoint, a replaced .data) must be refused here
    if got != n:
        raise ValueError(f"{kernel}: {what} has {got} elements, but the parameter has {n}")


cdef inline int _threads(Py_ssize_t n, int num_threads) noexcept nogil:
    return threads_for(n, _PARALLEL_MIN, num_threads)     # one rule for every kernel


cdef inline real _sqrt(real x) noexcept nogil:
    if real is float:
        return sqrtf(x)
    else:
        return sqrt(x)


cdef inline void _adam_element(real* param, real grad, real* exp_avg, real* exp_avg_sq,
                               real* max_exp_avg_sq, real neg_step_size,
                               real bias_correction2_sqrt, real one_minus_beta1, real beta2,
                               real one_minus_beta2, real eps, real decay, real l2,
                               bint amsgrad) noexcept nogil:
    """The update of one element (inlined into the loops below)."""
    cdef real p = param[0] * decay        # AdamW's decay (decay is exactly 1 for Adam)
    # NOTE: with l2 = 0 this adds 0 * p, which is exact for every finite p
    cdef real g = grad + l2 * p           # Adam's L2 term (l2 is 0 for AdamW)
    cdef real m = exp_avg[0]
    cdef real v
    m = m + one_minus_beta1 * (g - m)
    v = exp_avg_sq[0] * beta2 + one_minus_beta2 * g * g
    exp_avg[0] = m
    exp_avg_sq[0] = v
    if amsgrad:
        v = v if v > max_exp_avg_sq[0] else max_exp_avg_sq[0]
        max_exp_avg_sq[0] = v
    param[0] = p + neg_step_size * m / (_sqrt(v) / bias_correction2_sqrt + eps)


cdef inline void _bias_corrections(double lr, double beta1, double beta2, double step,
                                   double* neg_step_size, double* bias_correction2_sqrt) noexcept nogil:
    """-lr / (1 - b1^step) and sqrt(1 - b2^step), in double (rounded to the parameter's type
    by the caller, once)."""
    neg_step_size[0] = -(lr / (1.0 - beta1 ** step))
    bias_correction2_sqrt[0] = (1.0 - beta2 ** step) ** 0.5


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_step(real[::1] param, const real[::1] grad, real[::1] exp_avg,
              real[::1] exp_avg_sq, real[::1] max_exp_avg_sq,
              double lr, double beta1, double beta2, double eps, double weight_decay,
              double step, bint decoupled_weight_decay, bint amsgrad, int num_threads):
    """One Adam / AdamW update of one parameter (N,), in place over param, exp_avg,
    exp_avg_sq (and max_exp_avg_sq when amsgrad; otherwise any (N,) array, unread)."""
    # NOTE: one parameter is adam_step_many's case of a list of one: the same blocks and
    # the same loop (_adam_blocks), so the update is written once
    cdef Py_ssize_t n = param.shape[0], count
    _check_length("adam_step", "grad", grad.shape[0], n)
    _check_length("adam_step", "exp_avg", exp_avg.shape[0], n)
    _check_length("adam_step", "exp_avg_sq", exp_avg_sq.shape[0], n)
    if amsgrad:
        _check_length("adam_step", "max_exp_avg_sq", max_exp_avg_sq.shape[0], n)
    if n == 0:
        return
    cdef real* ptrs[5]
    cdef double coef[2]
    ptrs[0] = &param[0]
    ptrs[1] = <real*>&grad[0]                 # read only
    ptrs[2] = &exp_avg[0]
    ptrs[3] = &exp_avg_sq[0]
    ptrs[4] = &max_exp_avg_sq[0] if amsgrad else ptrs[3]
    _bias_corrections(lr, beta1, beta2, step, &coef[0], &coef[1])
    cdef _Block* blocks = _blocks_of(&n, 1, &count)
    try:
        with nogil:
            _adam_blocks(ptrs, coef, blocks, count, lr, beta1, beta2, eps, weight_decay,
                         decoupled_weight_decay, amsgrad, _threads(n, num_threads))
    finally:
        free(blocks)


cdef inline void _sgd_element(real* param, real grad, real* momentum_buffer, real neg_lr,
                              real wd, real momentum, real one_minus_dampening,
                              bint use_decay, bint use_momentum, bint nesterov,
                              bint first_step) noexcept nogil:
    cdef real p = param[0]
    cdef real g = grad
    cdef real b
    if use_decay:
        g = g + wd * p
    if use_momentum:
        if first_step:
            b = g
        else:
            b = momentum_buffer[0] * momentum + one_minus_dampening * g
        momentum_buffer[0] = b
        if nesterov:
            g = g + momentum * b
        else:
            g = b
    param[0] = p + neg_lr * g


@cython.boundscheck(False)
@cython.wraparound(False)
def sgd_step(real[::1] param, const real[::1] grad, real[::1] momentum_buffer,
             double lr, double momentum, double dampening, double weight_decay,
             bint nesterov, bint first_step, int num_threads):
    """One SGD update of one parameter (N,), in place over param and momentum_buffer
    (any (N,) array, unread, when momentum is 0):
        g = grad + wd * p
        b = g (first step)  or  b = b * momentum + (1 - dampening) * g
        g = g + momentum * b (nesterov)  or  g = b
        p = p - lr * g"""
    cdef Py_ssize_t i, n = param.shape[0]
    _check_length("sgd_step", "grad", grad.shape[0], n)
    if momentum != 0:
        _check_length("sgd_step", "momentum_buffer", momentum_buffer.shape[0], n)
    for i in prange(n, nogil=True, num_threads=_threads(n, num_threads), schedule="static"):
        _sgd_element(&param[i], grad[i], &momentum_buffer[i], <real>(-lr), <real>weight_decay,
                     <real>momentum, <real>(1.0 - dampening), weight_decay != 0,
                     momentum != 0, nesterov, first_step)


# ---- every parameter of a group in one call -----------------------------------------

cdef struct _Block:
    Py_ssize_t tensor       # which parameter
    Py_ssize_t start        # this block's elements [start, stop)
    Py_ssize_t stop


# Elements per block: the threads share out the blocks of every parameter at once, so a
# model of many small parameters (none above _PARALLEL_MIN alone) still uses the team.
cdef Py_ssize_t _BLOCK = 1 << 14


cdef _Block* _blocks_of(const Py_ssize_t* sizes, Py_ssize_t n, Py_ssize_t* count) except NULL:
    """Every parameter's elements cut into blocks of _BLOCK, in order (malloc'd; the
    caller frees it); count: how many."""
    cdef Py_ssize_t i, b = 0, start
    count[0] = 0
    for i in range(n):
        count[0] += (sizes[i] + _BLOCK - 1) // _BLOCK
    cdef _Block* blocks = <_Block*>malloc(max(count[0], 1) * sizeof(_Block))
    if blocks == NULL:
        raise MemoryError(f"adam_step: cannot allocate {count[0]} blocks")
    for i in range(n):
        start = 0
        while start < sizes[i]:
            blocks[b].tensor = i
            blocks[b].start = start
            blocks[b].stop = start + _BLOCK if start + _BLOCK < sizes[i] else sizes[i]
            start += _BLOCK
            b += 1
    return blocks


cdef char* _pointer(str what, Py_ssize_t index, object a, int dtype, Py_ssize_t n,
                    bint writes) except NULL:
    """The data of a 1-D float array of n elements and the group's dtype, C-contiguous
    (writeable where the kernel writes it), or an exception that names it."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"adam_step_many: {what} {index} is a {type(a).__name__}, not a numpy array")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != dtype:
        raise TypeError(f"adam_step_many: {what} {index} has dtype {arr.dtype}, but the group's "
                        f"parameters are {np.dtype(np.float32 if dtype == cnp.NPY_FLOAT32 else np.float64)}")
    if cnp.PyArray_NDIM(arr) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise ValueError(f"adam_step_many: {what} {index} must be 1-D and contiguous")
    if cnp.PyArray_SIZE(arr) != n:
        raise ValueError(f"adam_step_many: {what} {index} has {cnp.PyArray_SIZE(arr)} elements, "
                         f"but its parameter has {n}")
    if writes and not cnp.PyArray_ISWRITEABLE(arr):
        raise ValueError(f"adam_step_many: {what} {index} is read-only")
    return <char*>cnp.PyArray_DATA(arr)


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_step_many(list params, list grads, list exp_avgs, list exp_avg_sqs,
                   list max_exp_avg_sqs, const double[::1] steps, double lr, double beta1,
                   double beta2, double eps, double weight_decay, bint decoupled_weight_decay,
                   bint amsgrad, int num_threads):
    """adam_step for every parameter of a list in one call: params[i] (N_i,) flat and
    contiguous, all float32 or all float64, with grads[i], exp_avgs[i], exp_avg_sqs[i]
    (and max_exp_avg_sqs[i] when amsgrad; otherwise the list is unread) of the same size
    and dtype, and steps[i] its step count. Each element gets exactly adam_step's update
    (the same coefficients, rounded the same way), so the results are adam_step's bits,
    at any thread count. Every array is checked before any is written."""
    cdef Py_ssize_t n = len(params), i, count = 0, total = 0, size
    cdef int threads
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == steps.shape[0] == n) or \
            (amsgrad and len(max_exp_avg_sqs) != n):
        raise ValueError(f"adam_step_many: {n} parameters, but {len(grads)} gradients, "
                         f"{len(exp_avgs)} exp_avg, {len(exp_avg_sqs)} exp_avg_sq, "
                         f"{steps.shape[0]} steps" + (f", {len(max_exp_avg_sqs)} max_exp_avg_sq"
                                                      if amsgrad else ""))
    if n == 0:
        return
    if not isinstance(params[0], np.ndarray):
        raise TypeError(f"adam_step_many: parameter 0 is a {type(params[0]).__name__}, not a numpy array")
    cdef int dtype = cnp.PyArray_TYPE(<cnp.ndarray>params[0])
    if dtype != cnp.NPY_FLOAT32 and dtype != cnp.NPY_FLOAT64:
        raise TypeError(f"adam_step_many: parameters must be float32 or float64, got {params[0].dtype}")
    cdef char** ptrs = <char**>malloc(5 * n * sizeof(char*))
    cdef double* coef = <double*>malloc(2 * n * sizeof(double))
    cdef Py_ssize_t* sizes = <Py_ssize_t*>malloc(n * sizeof(Py_ssize_t))
    cdef _Block* blocks = NULL
    if ptrs == NULL or coef == NULL or sizes == NULL:
        free(ptrs)
        free(coef)
        free(sizes)
        raise MemoryError("adam_step_many: cannot allocate the list of parameters")
    try:
        for i in range(n):
            size = params[i].size if isinstance(params[i], np.ndarray) else -1
            ptrs[5 * i] = _pointer("parameter", i, params[i], dtype, size, True)
            ptrs[5 * i + 1] = _pointer("gradient", i, grads[i], dtype, size, False)
            ptrs[5 * i + 2] = _pointer("exp_avg", i, exp_avgs[i], dtype, size, True)
            ptrs[5 * i + 3] = _pointer("exp_avg_sq", i, exp_avg_sqs[i], dtype, size, True)
            ptrs[5 * i + 4] = (_pointer("max_exp_avg_sq", i, max_exp_avg_sqs[i], dtype, size, True)
                               if amsgrad else ptrs[5 * i + 3])
            _bias_corrections(lr, beta1, beta2, steps[i], &coef[2 * i], &coef[2 * i + 1])
            sizes[i] = size
            total += size
        blocks = _blocks_of(sizes, n, &count)
        threads = _threads(total, num_threads)
        with nogil:
            if dtype == cnp.NPY_FLOAT32:
                _adam_blocks(<float**>ptrs, coef, blocks, count, lr, beta1, beta2, eps,
                             weight_decay, decoupled_weight_decay, amsgrad, threads)
            else:
                _adam_blocks(<double**>ptrs, coef, blocks, count, lr, beta1, beta2, eps,
                             weight_decay, decoupled_weight_decay, amsgrad, threads)
    finally:
        free(blocks)
        free(sizes)
        free(coef)
        free(ptrs)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _adam_blocks(real** ptrs, const double* coef, const _Block* blocks, Py_ssize_t count,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       bint decoupled_weight_decay, bint amsgrad, int threads) noexcept nogil:
    """The blocks' updates, shared out over the team (each element by one thread), with
    adam_step's coefficients: ptrs holds (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)
    of each parameter, coef its (-lr / bias_correction1, sqrt(bias_correction2))."""
    cdef Py_ssize_t b, i, t
    cdef real one_minus_beta1 = 1.0 - beta1
    cdef real beta2_r = beta2
    cdef real one_minus_beta2 = 1.0 - beta2
    cdef real eps_r = eps
    cdef real decay = 1.0 - lr * weight_decay if decoupled_weight_decay else 1.0
    cdef real l2 = 0.0 if decoupled_weight_decay else weight_decay
    for b in prange(count, num_threads=threads, schedule="static"):
        t = blocks[b].tensor
        if amsgrad:
            for i in range(blocks[b].start, blocks[b].stop):
                _adam_element(&ptrs[5 * t][i], ptrs[5 * t + 1][i], &ptrs[5 * t + 2][i],
                              &ptrs[5 * t + 3][i], &ptrs[5 * t + 4][i], <real>(coef[2 * t]),
                              <real>(coef[2 * t + 1]), one_minus_beta1, beta2_r,
                              one_minus_beta2, eps_r, decay, l2, True)
        else:
            for i in range(blocks[b].start, blocks[b].stop):
                _adam_element(&ptrs[5 * t][i], ptrs[5 * t + 1][i], &ptrs[5 * t + 2][i],
                              &ptrs[5 * t + 3][i], &ptrs[5 * t + 3][i], <real>(coef[2 * t]),
                              <real>(coef[2 * t + 1]), one_minus_beta1, beta2_r,
                              one_minus_beta2, eps_r, decay, l2, False)
