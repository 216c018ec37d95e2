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
cimport cython
from microtensor.kernels._common cimport real, threads_for, use_team
from microtensor.kernels._blas import team_pointer as _team_pointer

use_team(_team_pointer())   # the team microtensor.kernels._blas measures (team_of in kernels/_common.pxd)

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


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_step(real[::1] param, const real[::1] grad, real[::1] exp_avg,
              real[::1] exp_avg_sq, real[::1] max_exp_avg_sq,
              double lr, double beta1, double beta2, double eps, double weight_decay,
              double step, bint decoupled_weight_decay, bint amsgrad, int num_threads):
    """One Adam / AdamW update of one parameter (N,), in place over param, exp_avg,
    exp_avg_sq (and max_exp_avg_sq when amsgrad; otherwise any (N,) array, unread)."""
    # NOTE: every buffer is indexed by the same i, and each element is read and written
    # by exactly one thread, so the in-place update inside prange is race-free. The
    # per-element work sits in an inline function so that the loop has no private
    # temporaries (Cython resets those to NaN on every iteration), and the options are
    # folded into coefficients rather than branches, so the compiler vectorizes it.
    cdef Py_ssize_t i, n = param.shape[0]
    cdef int threads = _threads(n, num_threads)
    _check_length("adam_step", "grad", grad.shape[0], n)
    _check_length("adam_step", "exp_avg", exp_avg.shape[0], n)
    _check_length("adam_step", "exp_avg_sq", exp_avg_sq.shape[0], n)
    if amsgrad:
        _check_length("adam_step", "max_exp_avg_sq", max_exp_avg_sq.shape[0], n)
    cdef double bias_correction1 = 1.0 - beta1 ** step
    cdef double bias_correction2 = 1.0 - beta2 ** step
    # the coefficients are rounded to the parameter's type once, as torch does
    cdef real neg_step_size = -(lr / bias_correction1)
    cdef real bias_correction2_sqrt = bias_correction2 ** 0.5
    cdef real one_minus_beta1 = 1.0 - beta1
    cdef real beta2_r = beta2
    cdef real one_minus_beta2 = 1.0 - beta2
    cdef real eps_r = eps
    cdef real decay = 1.0 - lr * weight_decay if decoupled_weight_decay else 1.0
    cdef real l2 = 0.0 if decoupled_weight_decay else weight_decay
    if amsgrad:
        for i in prange(n, nogil=True, num_threads=threads, schedule="static"):
            _adam_element(&param[i], grad[i], &exp_avg[i], &exp_avg_sq[i], &max_exp_avg_sq[i],
                          neg_step_size, bias_correction2_sqrt, one_minus_beta1, beta2_r,
                          one_minus_beta2, eps_r, decay, l2, True)
    else:
        for i in prange(n, nogil=True, num_threads=threads, schedule="static"):
            _adam_element(&param[i], grad[i], &exp_avg[i], &exp_avg_sq[i], &exp_avg_sq[i],
                          neg_step_size, bias_correction2_sqrt, one_minus_beta1, beta2_r,
                          one_minus_beta2, eps_r, decay, l2, False)


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
