# Cython kernels of the optimizer updates: one call per parameter, in place, no
# temporaries. Each takes flat contiguous views (the caller passes `p._data.reshape(-1)`)
# of one fused float type, releases the GIL and splits the elements across threads.
#
# The arithmetic follows PyTorch's single-tensor (CPU) code path operation by operation,
# so that float64 results agree to rounding:
#   Adam   grad += wd * p                       (L2 penalty, coupled)
#   AdamW  p *= 1 - lr * wd                     (decoupled decay, before the update)
#   m = m + (1 - b1) * (g - m)                  (torch's lerp for a weight < 0.5)
#   v = v * b2 + (1 - b2) * g * g               (mul_ then addcmul_)
#   p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)      (addcdiv_)
# with bc1 = 1 - b1**step, bc2 = 1 - b2**step computed once, in double, per call.

from cython.parallel cimport prange
from libc.math cimport sqrt
cimport cython

ctypedef fused real:
    float
    double

# Below this many elements one thread is faster than waking a second one.
cdef Py_ssize_t _PARALLEL_MIN = 1 << 15


cdef inline int _threads(Py_ssize_t n, int num_threads) noexcept nogil:
    return num_threads if n >= _PARALLEL_MIN and num_threads > 1 else 1


@cython.boundscheck(False)
@cython.wraparound(False)
def adam_step(real[::1] param, const real[::1] grad, real[::1] exp_avg,
              real[::1] exp_avg_sq, real[::1] max_exp_avg_sq,
              double lr, double beta1, double beta2, double eps, double weight_decay,
              double step, bint decoupled_weight_decay, bint amsgrad, int num_threads):
    """One Adam / AdamW update of one parameter (N,), in place over param, exp_avg,
    exp_avg_sq (and max_exp_avg_sq when amsgrad; otherwise any (N,) array, unread)."""
    # NOTE: every buffer is indexed by the same i, and each element is read and written
    # by exactly one thread, so the in-place update inside prange is race-free.
    cdef Py_ssize_t i, n = param.shape[0]
    cdef double bias_correction1 = 1.0 - beta1 ** step
    cdef double bias_correction2 = 1.0 - beta2 ** step
    # the coefficients are rounded to the parameter's type once, as torch does
    cdef real neg_step_size = -(lr / bias_correction1)
    cdef real bias_correction2_sqrt = bias_correction2 ** 0.5
    cdef real one_minus_beta1 = 1.0 - beta1
    cdef real beta2_r = beta2
    cdef real one_minus_beta2 = 1.0 - beta2
    cdef real eps_r = eps
    cdef real decay = 1.0 - lr * weight_decay
    cdef real wd = weight_decay
    cdef bint coupled_decay = weight_decay != 0 and not decoupled_weight_decay
    cdef bint decoupled_decay = weight_decay != 0 and decoupled_weight_decay
    cdef real p, g, m, v, denom
    for i in prange(n, nogil=True, num_threads=_threads(n, num_threads), schedule="static"):
        p = param[i]
        g = grad[i]
        if decoupled_decay:
            p = p * decay
        elif coupled_decay:
            g = g + wd * p
        m = exp_avg[i]
        m = m + one_minus_beta1 * (g - m)
        v = exp_avg_sq[i] * beta2_r + one_minus_beta2 * g * g
        exp_avg[i] = m
        exp_avg_sq[i] = v
        if amsgrad:
            if max_exp_avg_sq[i] > v:
                v = max_exp_avg_sq[i]
            max_exp_avg_sq[i] = v
        denom = <real>sqrt(v) / bias_correction2_sqrt + eps_r
        param[i] = p + neg_step_size * m / denom


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
    cdef real neg_lr = -lr
    cdef real wd = weight_decay
    cdef real mom = momentum
    cdef real one_minus_dampening = 1.0 - dampening
    cdef bint use_decay = weight_decay != 0
    cdef bint use_momentum = momentum != 0
    cdef real p, g, b
    for i in prange(n, nogil=True, num_threads=_threads(n, num_threads), schedule="static"):
        p = param[i]
        g = grad[i]
        if use_decay:
            g = g + wd * p
        if use_momentum:
            if first_step:
                b = g
            else:
                b = momentum_buffer[i] * mom + one_minus_dampening * g
            momentum_buffer[i] = b
            if nesterov:
                g = g + mom * b
            else:
                g = b
        param[i] = p + neg_lr * g
