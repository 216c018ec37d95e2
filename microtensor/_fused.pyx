# cython: embedsignature=True, wraparound=True
"""Cython kernels of the fused nn.functional ops (forward/backward pairs).

Every kernel takes C-contiguous typed memoryviews of one float type, states its shapes
in its first docstring line, releases the GIL and loops with prange over rows (or over
column slabs where rows would race). The Python side (microtensor/nn/functional.py)
checks shapes and index ranges before calling: bounds checks are off in here.

Backward kernels WRITE dinp (each op's node returns a fresh gradient array) and
ACCUMULATE (+=) into the per-thread partial sums of dweight / dbias, which the caller
zeroes and then sums over threads.

Naming follows llm.c: `layernorm_forward(out, mean, rstd, inp, weight, bias, ...)`,
`layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, ...)`.
"""
from cython.parallel cimport prange
from libc.math cimport exp, expf, log, sqrt, erf, erff, tanh, tanhf, INFINITY
cimport cython

ctypedef fused real:
    float
    double

cdef double SQRT_2_OVER_PI = 0.7978845608028654
cdef double INV_SQRT_2 = 0.7071067811865476
cdef double INV_SQRT_2PI = 0.3989422804014327
cdef double GELU_C = 0.044715


cdef inline real _exp(real x) noexcept nogil:
    if real is float:
        return expf(x)
    else:
        return exp(x)


cdef inline real _erf(real x) noexcept nogil:
    if real is float:
        return erff(x)
    else:
        return erf(x)


cdef inline real _tanh(real x) noexcept nogil:
    if real is float:
        return tanhf(x)
    else:
        return tanh(x)


cdef inline Py_ssize_t _min(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


# ---- layer norm ------------------------------------------------------------------

@cython.wraparound(False)
def layernorm_forward(real[:, ::1] out, real[::1] mean, real[::1] rstd,
                      const real[:, ::1] inp, const real[::1] weight, const real[::1] bias,
                      double eps, int num_threads):
    """(R, N) rows -> out (R, N), mean (R,), rstd (R,):
    out = (inp - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)

    NOTE: the row statistics accumulate in double, also for float32 input."""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef double m, v, d, s
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        m = 0
        for j in range(N):
            m = m + inp[r, j]
        m = m / N
        v = 0
        for j in range(N):
            d = inp[r, j] - m
            v = v + d * d
        s = 1.0 / sqrt(v / N + eps)
        for j in range(N):
            out[r, j] = <real>((inp[r, j] - m) * s) * weight[j] + bias[j]
        mean[r] = <real>m
        rstd[r] = <real>s


@cython.wraparound(False)
def layernorm_backward(real[:, ::1] dinp, real[:, ::1] dweight, real[:, ::1] dbias,
                       const real[:, ::1] dout, const real[:, ::1] inp,
                       const real[::1] weight, const real[::1] mean, const real[::1] rstd,
                       int num_threads):
    """(R, N) rows; dweight, dbias (P, N): one partial sum per row chunk (P chunks):
    xhat = (inp - mean) * rstd,  dnorm = dout * weight,
    dinp = rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)),
    dweight[p] += sum_rows(dout * xhat),  dbias[p] += sum_rows(dout)"""
    cdef Py_ssize_t c, r, j, r0, r1, R = inp.shape[0], N = inp.shape[1]
    cdef Py_ssize_t P = dweight.shape[0]
    cdef Py_ssize_t rows_per = (R + P - 1) // P
    cdef double a, b, xhat, dnorm, mu, s
    for c in prange(P, nogil=True, num_threads=num_threads, schedule="static"):
        r0 = c * rows_per
        r1 = _min(R, r0 + rows_per)
        for r in range(r0, r1):
            mu = mean[r]
            s = rstd[r]
            a = 0
            b = 0
            for j in range(N):
                xhat = (inp[r, j] - mu) * s
                dnorm = dout[r, j] * weight[j]
                a = a + dnorm
                b = b + dnorm * xhat
            a = a / N
            b = b / N
            for j in range(N):
                xhat = (inp[r, j] - mu) * s
                dnorm = dout[r, j] * weight[j]
                dbias[c, j] = dbias[c, j] + dout[r, j]
                dweight[c, j] = dweight[c, j] + <real>(dout[r, j] * xhat)
                dinp[r, j] = <real>((dnorm - a - xhat * b) * s)


# ---- RMS norm --------------------------------------------------------------------

@cython.wraparound(False)
def rmsnorm_forward(real[:, ::1] out, real[::1] rstd, const real[:, ::1] inp,
                    const real[::1] weight, double eps, int num_threads):
    """(R, N) rows -> out (R, N), rstd (R,):  out = inp * rstd * weight,
    rstd = 1 / sqrt(mean(inp^2) + eps)"""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef double v, s
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        v = 0
        for j in range(N):
            v = v + <double>inp[r, j] * inp[r, j]
        s = 1.0 / sqrt(v / N + eps)
        for j in range(N):
            out[r, j] = <real>(inp[r, j] * s) * weight[j]
        rstd[r] = <real>s


@cython.wraparound(False)
def rmsnorm_backward(real[:, ::1] dinp, real[:, ::1] dweight, const real[:, ::1] dout,
                     const real[:, ::1] inp, const real[::1] weight, const real[::1] rstd,
                     int num_threads):
    """(R, N) rows; dweight (P, N) partial sums:  xhat = inp * rstd,  dnorm = dout * weight,
    dinp = rstd * (dnorm - xhat * mean(dnorm * xhat)),  dweight[p] += sum_rows(dout * xhat)"""
    cdef Py_ssize_t c, r, j, r0, r1, R = inp.shape[0], N = inp.shape[1]
    cdef Py_ssize_t P = dweight.shape[0]
    cdef Py_ssize_t rows_per = (R + P - 1) // P
    cdef double b, xhat, s
    for c in prange(P, nogil=True, num_threads=num_threads, schedule="static"):
        r0 = c * rows_per
        r1 = _min(R, r0 + rows_per)
        for r in range(r0, r1):
            s = rstd[r]
            b = 0
            for j in range(N):
                b = b + dout[r, j] * weight[j] * (inp[r, j] * s)
            b = b / N
            for j in range(N):
                xhat = inp[r, j] * s
                dweight[c, j] = dweight[c, j] + <real>(dout[r, j] * xhat)
                dinp[r, j] = <real>((dout[r, j] * weight[j] - xhat * b) * s)


# ---- GELU and SiLU (flat, elementwise) -------------------------------------------

@cython.wraparound(False)
def gelu_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        out[i] = <real>0.5 * x * (1 + _erf(x * <real>INV_SQRT_2))


@cython.wraparound(False)
def gelu_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp, int num_threads):
    """(n,):  dinp = dout * (Phi(x) + x phi(x)),  phi(x) = exp(-x^2/2) / sqrt(2 pi)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        dinp[i] = dout[i] * (<real>0.5 * (1 + _erf(x * <real>INV_SQRT_2))
                             + x * <real>INV_SQRT_2PI * _exp(<real>-0.5 * x * x))


@cython.wraparound(False)
def gelu_tanh_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        out[i] = <real>0.5 * x * (1 + _tanh(<real>SQRT_2_OVER_PI * (x + <real>GELU_C * x * x * x)))


@cython.wraparound(False)
def gelu_tanh_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp,
                       int num_threads):
    """(n,):  dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx),  t = tanh(u),
    du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x, t
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        t = _tanh(<real>SQRT_2_OVER_PI * (x + <real>GELU_C * x * x * x))
        dinp[i] = dout[i] * (<real>0.5 * (1 + t) + <real>0.5 * x * (1 - t * t)
                             * <real>SQRT_2_OVER_PI * (1 + <real>(3 * GELU_C) * x * x))


@cython.wraparound(False)
def silu_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = x * sigmoid(x)   (exp(-x) may overflow to inf: x/inf = -0, fine)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        out[i] = inp[i] / (1 + _exp(-inp[i]))


@cython.wraparound(False)
def silu_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp, int num_threads):
    """(n,):  dinp = dout * s (1 + x (1 - s)),  s = sigmoid(x)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real s
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        s = 1 / (1 + _exp(-inp[i]))
        dinp[i] = dout[i] * s * (1 + inp[i] * (1 - s))


# ---- cross-entropy (fused log-softmax + NLL) -------------------------------------

@cython.wraparound(False)
def crossentropy_forward(real[::1] losses, real[::1] lse, const real[:, ::1] logits,
                         const long long[::1] targets, long long ignore_index,
                         double label_smoothing, int num_threads):
    """(M, C) logits, (M,) targets -> losses (M,), lse (M,):
    lse = logsumexp(x),  loss = (1 - eps) (lse - x[t]) + eps (lse - mean(x)),
    loss = 0 where t == ignore_index.  Stable: exp(x - max) never overflows."""
    cdef Py_ssize_t r, j, M = logits.shape[0], C = logits.shape[1]
    cdef double m, s, total, l
    cdef long long t
    for r in prange(M, nogil=True, num_threads=num_threads, schedule="static"):
        m = -INFINITY
        total = 0
        for j in range(C):
            if logits[r, j] > m:
                m = logits[r, j]
            total = total + logits[r, j]
        s = 0
        for j in range(C):
            s = s + exp(logits[r, j] - m)
        l = m + log(s)
        lse[r] = <real>l
        t = targets[r]
        if t == ignore_index:
            losses[r] = 0
        else:
            losses[r] = <real>((1 - label_smoothing) * (l - logits[r, t])
                               + label_smoothing * (l - total / C))


@cython.wraparound(False)
def crossentropy_backward(real[:, ::1] dlogits, const real[::1] dlosses,
                          const real[:, ::1] logits, const real[::1] lse,
                          const long long[::1] targets, long long ignore_index,
                          double label_smoothing, int num_threads):
    """(M, C):  dlogits = dloss * (softmax(x) - (1 - eps) onehot(t) - eps / C),
    softmax recomputed as exp(x - lse);  0 on ignored rows"""
    cdef Py_ssize_t r, j, M = logits.shape[0], C = logits.shape[1]
    cdef real g, l, off
    cdef long long t
    for r in prange(M, nogil=True, num_threads=num_threads, schedule="static"):
        t = targets[r]
        if t == ignore_index:
            for j in range(C):
                dlogits[r, j] = 0
            continue
        g = dlosses[r]
        l = lse[r]
        off = <real>(label_smoothing / C)
        for j in range(C):
            dlogits[r, j] = g * (_exp(logits[r, j] - l) - off)
        dlogits[r, t] = dlogits[r, t] - g * <real>(1 - label_smoothing)


# ---- embedding -------------------------------------------------------------------

@cython.wraparound(False)
def embedding_forward(real[:, ::1] out, const long long[::1] ids, const real[:, ::1] weight,
                      int num_threads):
    """(M,) ids, (V, D) weight -> out (M, D):  out[i] = weight[ids[i]]"""
    cdef Py_ssize_t i, j, M = ids.shape[0], D = weight.shape[1]
    cdef long long row
    for i in prange(M, nogil=True, num_threads=num_threads, schedule="static"):
        row = ids[i]
        for j in range(D):
            out[i, j] = weight[row, j]


@cython.wraparound(False)
def embedding_backward(real[:, ::1] dweight, const real[:, ::1] dout, const long long[::1] ids,
                       int num_threads):
    """(V, D) dweight, (M, D) dout, (M,) ids:  dweight[ids[i]] += dout[i]

    NOTE: threads split the D columns, not the M rows: two rows with the same id would
    otherwise add into one dweight row at once. Each thread walks every row, in order,
    over its own column slab, so repeated ids accumulate without a race."""
    cdef Py_ssize_t c, i, j, j0, j1, M = ids.shape[0], D = dout.shape[1]
    cdef Py_ssize_t P = num_threads if D >= 16 * num_threads else 1
    cdef Py_ssize_t cols_per = (D + P - 1) // P
    cdef long long row
    for c in prange(P, nogil=True, num_threads=num_threads, schedule="static"):
        j0 = c * cols_per
        j1 = _min(D, j0 + cols_per)
        for i in range(M):
            row = ids[i]
            for j in range(j0, j1):
                dweight[row, j] = dweight[row, j] + dout[i, j]


# ---- dropout ---------------------------------------------------------------------

@cython.wraparound(False)
def dropout_forward(real[::1] out, real[::1] mask, const real[::1] inp, const float[::1] uniform,
                    double p, int num_threads):
    """(n,):  mask = (u >= p) / (1 - p),  out = inp * mask"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real scale = <real>(1.0 / (1.0 - p))
    cdef float pf = <float>p
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        if uniform[i] >= pf:
            mask[i] = scale
        else:
            mask[i] = 0
        out[i] = inp[i] * mask[i]
