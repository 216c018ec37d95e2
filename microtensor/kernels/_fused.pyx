# cython: embedsignature=True, wraparound=True
"""Cython kernels of the fused nn.functional ops (forward/backward pairs).

Every kernel takes C-contiguous typed memoryviews of one float type, states its shapes
in its first docstring line, releases the GIL and loops with prange over rows (or over
column slabs where rows would race). The Python side (the families of microtensor/ops/)
checks shapes and index ranges before calling; bounds checks are off in here, so each
kernel also checks, at its entry, every size it relies on and the range of every index
array it reads (see "safety at the kernel entry" in kernels/_fused_math.pxi): called directly
with wrong arguments, a kernel raises, it never reads or writes out of bounds.

Backward kernels WRITE dinp (each op's node returns a fresh gradient array) and
ACCUMULATE (+=) into the per-thread partial sums of dweight / dbias, which the caller
zeroes and then sums over threads.

Naming follows llm.c: `layernorm_forward(out, mean, rstd, inp, weight, bias, ...)`,
`layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, ...)`.
Inner loops are written as maps over one row (out[j] = f(in[j])) and reductions through
row_sum / row_max / row_dot, the shapes gcc vectorises (see kernels/_fused_math.pxi).
"""
from cython.parallel cimport prange, parallel, threadid
cimport cython

include "_kernel_target.pxi"
include "_fused_math.pxi"

cdef double SQRT_2_OVER_PI = 0.7978845608028654
cdef double INV_SQRT_2 = 0.7071067811865476
cdef double INV_SQRT_2PI = 0.3989422804014327
cdef double GELU_C = 0.044715


# ---- layer norm ------------------------------------------------------------------

# Parallel thresholds (elements; see threads_for in kernels/_common.pxd): one thread, float32,
# best of many runs on a 2-core Intel Xeon (Sapphire Rapids class), (64, 256) rows:
# layernorm_forward 0.94 ns an element, rmsnorm_forward 0.65, layernorm_backward 2.8
# (rmsnorm_backward, one pass less, takes the same bound): about 50 us at the bound.
cdef double _LAYERNORM_PARALLEL_MIN = 1 << 16
# rows taken a pass at a time by the row-wise kernels that split their work into passes
cdef Py_ssize_t _ROWS_AT_ONCE = 8
cdef double _RMSNORM_PARALLEL_MIN = 1 << 16
cdef double _NORM_BACKWARD_PARALLEL_MIN = 1 << 14

@cython.wraparound(False)
def layernorm_forward(real[:, ::1] out, real[::1] mean, real[::1] rstd,
                      const real[:, ::1] inp, const real[::1] weight, const real[::1] bias,
                      double eps, int num_threads):
    """(R, N) rows -> out (R, N), mean (R,), rstd (R,):
    out = (inp - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)

    NOTE: two passes (mean, then squared deviations), partial sums added in double:
    float32 rows with a large offset keep their variance."""
    cdef Py_ssize_t c, r, r0, r1, j, R = inp.shape[0], N = inp.shape[1]
    cdef const real* x
    cdef real* o
    cdef real m, s
    check_shape2("layernorm_forward", "out", out.shape[0], out.shape[1], R, N)
    check_size("layernorm_forward", "mean", mean.shape[0], R)
    check_size("layernorm_forward", "rstd", rstd.shape[0], R)
    check_size("layernorm_forward", "weight", weight.shape[0], N)
    check_size("layernorm_forward", "bias", bias.shape[0], N)
    if R == 0 or N == 0:
        return
    num_threads = threads_for(<double>R * N, _LAYERNORM_PARALLEL_MIN, num_threads)
    # _ROWS_AT_ONCE rows a pass (their means, their deviations, their outputs; each row's
    # arithmetic as in one pass): the rows' sums, chains of dependent steps, overlap
    for c in prange((R + _ROWS_AT_ONCE - 1) // _ROWS_AT_ONCE, nogil=True,
                    num_threads=num_threads, schedule="static"):
        r0 = c * _ROWS_AT_ONCE
        r1 = imin(R, r0 + _ROWS_AT_ONCE)
        for r in range(r0, r1):
            mean[r] = <real>(row_sum(&inp[r, 0], N) / N)
        for r in range(r0, r1):
            rstd[r] = <real>(1.0 / sqrt(row_sum_sq_dev(&inp[r, 0], mean[r], N) / N + eps))
        for r in range(r0, r1):
            x = &inp[r, 0]
            o = &out[r, 0]
            m = mean[r]
            s = rstd[r]
            for j in range(N):
                o[j] = (x[j] - m) * s * weight[j] + bias[j]


@cython.wraparound(False)
def layernorm_backward(real[:, ::1] dinp, real[:, ::1] dweight, real[:, ::1] dbias,
                       const real[:, ::1] dout, const real[:, ::1] inp,
                       const real[::1] weight, const real[::1] mean, const real[::1] rstd,
                       int num_threads):
    """(R, N) rows; dweight, dbias (P, N): one partial sum per chunk of rows (P chunks):
    xhat = (inp - mean) * rstd,  dnorm = dout * weight,
    dinp = rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)),
    dweight[p] += sum_rows(dout * xhat),  dbias[p] += sum_rows(dout)"""
    cdef Py_ssize_t c, r, j, r0, r1, R = inp.shape[0], N = inp.shape[1]
    cdef Py_ssize_t P = dweight.shape[0]
    cdef Py_ssize_t rows_per
    cdef real* scratch                                    # two rows of N per thread
    cdef real* xhat = NULL
    cdef real* dnorm = NULL
    cdef const real* x
    cdef const real* g
    cdef real* dx
    cdef real* dw
    cdef real* db
    cdef real mu, s, a, b
    check_shape2("layernorm_backward", "dinp", dinp.shape[0], dinp.shape[1], R, N)
    check_shape2("layernorm_backward", "dout", dout.shape[0], dout.shape[1], R, N)
    check_shape2("layernorm_backward", "dbias", dbias.shape[0], dbias.shape[1], P, N)
    if dweight.shape[1] != N or P < 1:
        raise ValueError(f"layernorm_backward: dweight must be (P >= 1, {N}), got "
                         f"({dweight.shape[0]}, {dweight.shape[1]})")
    check_size("layernorm_backward", "weight", weight.shape[0], N)
    check_size("layernorm_backward", "mean", mean.shape[0], R)
    check_size("layernorm_backward", "rstd", rstd.shape[0], R)
    if R == 0 or N == 0:
        return
    rows_per = (R + P - 1) // P
    num_threads = threads_for(<double>R * N, _NORM_BACKWARD_PARALLEL_MIN, num_threads)
    scratch = <real*>scratch_alloc(2 * N * num_threads, sizeof(real))
    with nogil, parallel(num_threads=num_threads):
        xhat = scratch + 2 * N * threadid()
        dnorm = xhat + N
        for c in prange(P, schedule="static"):
            dw = &dweight[c, 0]
            db = &dbias[c, 0]
            r0 = c * rows_per
            r1 = imin(R, r0 + rows_per)
            for r in range(r0, r1):
                x = &inp[r, 0]
                g = &dout[r, 0]
                dx = &dinp[r, 0]
                mu = mean[r]
                s = rstd[r]
                for j in range(N):
                    xhat[j] = (x[j] - mu) * s
                    dnorm[j] = g[j] * weight[j]
                a = <real>(row_sum(dnorm, N) / N)
                b = <real>(row_dot(dnorm, xhat, N) / N)
                # NOTE: one loop per output: a loop storing to three arrays that may
                # alias (as far as the compiler knows) stayed scalar, 3x slower
                for j in range(N):
                    dx[j] = (dnorm[j] - a - xhat[j] * b) * s
                for j in range(N):
                    dw[j] = dw[j] + g[j] * xhat[j]
                for j in range(N):
                    db[j] = db[j] + g[j]
    free(scratch)


# ---- RMS norm --------------------------------------------------------------------

@cython.wraparound(False)
def rmsnorm_forward(real[:, ::1] out, real[::1] rstd, const real[:, ::1] inp,
                    const real[::1] weight, double eps, int num_threads):
    """(R, N) rows -> out (R, N), rstd (R,):  out = inp * rstd * weight,
    rstd = 1 / sqrt(mean(inp^2) + eps)"""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef const real* x
    cdef real* o
    cdef real s
    check_shape2("rmsnorm_forward", "out", out.shape[0], out.shape[1], R, N)
    check_size("rmsnorm_forward", "rstd", rstd.shape[0], R)
    check_size("rmsnorm_forward", "weight", weight.shape[0], N)
    if R == 0 or N == 0:
        return
    num_threads = threads_for(<double>R * N, _RMSNORM_PARALLEL_MIN, num_threads)
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        x = &inp[r, 0]
        o = &out[r, 0]
        s = <real>(1.0 / sqrt(row_dot(x, x, N) / N + eps))
        for j in range(N):
            o[j] = x[j] * s * weight[j]
        rstd[r] = s


@cython.wraparound(False)
def rmsnorm_backward(real[:, ::1] dinp, real[:, ::1] dweight, const real[:, ::1] dout,
                     const real[:, ::1] inp, const real[::1] weight, const real[::1] rstd,
                     int num_threads):
    """(R, N) rows; dweight (P, N) partial sums:  xhat = inp * rstd,  dnorm = dout * weight,
    dinp = rstd * (dnorm - xhat * mean(dnorm * xhat)),  dweight[p] += sum_rows(dout * xhat)"""
    cdef Py_ssize_t c, r, j, r0, r1, R = inp.shape[0], N = inp.shape[1]
    cdef Py_ssize_t P = dweight.shape[0]
    cdef Py_ssize_t rows_per
    cdef real* scratch                                    # two rows of N per thread
    cdef real* xhat = NULL
    cdef real* dnorm = NULL
    cdef const real* x
    cdef const real* g
    cdef real* dx
    cdef real* dw
    cdef real s, b
    check_shape2("rmsnorm_backward", "dinp", dinp.shape[0], dinp.shape[1], R, N)
    check_shape2("rmsnorm_backward", "dout", dout.shape[0], dout.shape[1], R, N)
    if dweight.shape[1] != N or P < 1:
        raise ValueError(f"rmsnorm_backward: dweight must be (P >= 1, {N}), got "
                         f"({dweight.shape[0]}, {dweight.shape[1]})")
    check_size("rmsnorm_backward", "weight", weight.shape[0], N)
    check_size("rmsnorm_backward", "rstd", rstd.shape[0], R)
    if R == 0 or N == 0:
        return
    rows_per = (R + P - 1) // P
    num_threads = threads_for(<double>R * N, _NORM_BACKWARD_PARALLEL_MIN, num_threads)
    scratch = <real*>scratch_alloc(2 * N * num_threads, sizeof(real))
    with nogil, parallel(num_threads=num_threads):
        xhat = scratch + 2 * N * threadid()
        dnorm = xhat + N
        for c in prange(P, schedule="static"):
            dw = &dweight[c, 0]
            r0 = c * rows_per
            r1 = imin(R, r0 + rows_per)
            for r in range(r0, r1):
                x = &inp[r, 0]
                g = &dout[r, 0]
                dx = &dinp[r, 0]
                s = rstd[r]
                for j in range(N):
                    xhat[j] = x[j] * s
                    dnorm[j] = g[j] * weight[j]
                b = <real>(row_dot(dnorm, xhat, N) / N)
                for j in range(N):                   # one loop per output (see layer_norm)
                    dx[j] = (dnorm[j] - xhat[j] * b) * s
                for j in range(N):
                    dw[j] = dw[j] + g[j] * xhat[j]
    free(scratch)


# ---- GELU and SiLU (flat, elementwise) -------------------------------------------

# Parallel threshold (elements): GELU forward 1.6 ns an element at one thread, its
# backward 1.7, SiLU 1.4 (float32, AVX2 build, same machine as above): about 50 us here.
cdef double _GELU_PARALLEL_MIN = 1 << 15

@cython.wraparound(False)
def gelu_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x, z
    check_size("gelu_forward", "out", out.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        z = (x if x >= 0 else -x) * <real>INV_SQRT_2
        out[i] = x * normal_cdf_from(x, z, vexp(-z * z))


@cython.wraparound(False)
def gelu_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp, int num_threads):
    """(n,):  dinp = dout * (Phi(x) + x phi(x)),  phi(x) = exp(-x^2/2) / sqrt(2 pi)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x, z, e
    check_size("gelu_backward", "dinp", dinp.shape[0], n)
    check_size("gelu_backward", "dout", dout.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        z = (x if x >= 0 else -x) * <real>INV_SQRT_2
        e = vexp(-z * z)                                  # exp(-x^2 / 2)
        dinp[i] = dout[i] * (normal_cdf_from(x, z, e) + x * <real>INV_SQRT_2PI * e)


@cython.wraparound(False)
def gelu_tanh_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x
    check_size("gelu_tanh_forward", "out", out.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        out[i] = <real>0.5 * x * (1 + vtanh(<real>SQRT_2_OVER_PI * (x + <real>GELU_C * x * x * x)))


@cython.wraparound(False)
def gelu_tanh_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp,
                       int num_threads):
    """(n,):  dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx),  t = tanh(u),
    du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real x, t
    check_size("gelu_tanh_backward", "dinp", dinp.shape[0], n)
    check_size("gelu_tanh_backward", "dout", dout.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        x = inp[i]
        t = vtanh(<real>SQRT_2_OVER_PI * (x + <real>GELU_C * x * x * x))
        dinp[i] = dout[i] * (<real>0.5 * (1 + t) + <real>0.5 * x * (1 - t * t)
                             * <real>SQRT_2_OVER_PI * (1 + <real>(3 * GELU_C) * x * x))


@cython.wraparound(False)
def silu_forward(real[::1] out, const real[::1] inp, int num_threads):
    """(n,) -> (n,):  out = x * sigmoid(x) = x / (1 + e^-x)   (e^-x = inf gives -0, fine)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    check_size("silu_forward", "out", out.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        out[i] = inp[i] / (1 + vexp(-inp[i]))


@cython.wraparound(False)
def silu_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp, int num_threads):
    """(n,):  dinp = dout * s (1 + x (1 - s)),  s = sigmoid(x)"""
    cdef Py_ssize_t i, n = inp.shape[0]
    cdef real s
    check_size("silu_backward", "dinp", dinp.shape[0], n)
    check_size("silu_backward", "dout", dout.shape[0], n)
    num_threads = threads_for(n, _GELU_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        s = 1 / (1 + vexp(-inp[i]))
        dinp[i] = dout[i] * s * (1 + inp[i] * (1 - s))


# ---- softmax / log-softmax over the last dim ----------------------------------------

# Parallel thresholds (elements): softmax forward 1.3 ns an element at one thread,
# log-softmax 1.3, softmax backward 0.56 (float32, (64, 256) rows): about 40-60 us here.
cdef double _SOFTMAX_PARALLEL_MIN = 1 << 15
cdef double _SOFTMAX_BACKWARD_PARALLEL_MIN = 1 << 16

@cython.wraparound(False)
def softmax_forward(real[:, ::1] out, const real[:, ::1] inp, int num_threads):
    """(R, N) rows -> (R, N):  out = exp(x - max) / sum(exp(x - max))"""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef const real* x
    cdef real* o
    cdef real m, inv
    check_shape2("softmax_forward", "out", out.shape[0], out.shape[1], R, N)
    num_threads = threads_for(<double>R * N, _SOFTMAX_PARALLEL_MIN, num_threads)
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        x = &inp[r, 0]
        o = &out[r, 0]
        m = row_max(x, N)
        inv = <real>(1.0 / row_exp_sum(x, o, N, m))
        for j in range(N):
            o[j] = o[j] * inv


@cython.wraparound(False)
def softmax_backward(real[:, ::1] dinp, const real[:, ::1] dout, const real[:, ::1] out,
                     int num_threads):
    """(R, N):  dinp = y * (g - sum(g * y))"""
    cdef Py_ssize_t r, j, R = out.shape[0], N = out.shape[1]
    cdef const real* y
    cdef const real* g
    cdef real* dx
    cdef real d
    check_shape2("softmax_backward", "dinp", dinp.shape[0], dinp.shape[1], R, N)
    check_shape2("softmax_backward", "dout", dout.shape[0], dout.shape[1], R, N)
    num_threads = threads_for(<double>R * N, _SOFTMAX_BACKWARD_PARALLEL_MIN, num_threads)
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        y = &out[r, 0]
        g = &dout[r, 0]
        dx = &dinp[r, 0]
        d = <real>row_dot(g, y, N)
        for j in range(N):
            dx[j] = y[j] * (g[j] - d)


@cython.wraparound(False)
def log_softmax_forward(real[:, ::1] out, const real[:, ::1] inp, int num_threads):
    """(R, N) rows -> (R, N):  out = (x - m) - s,  m = max(x),  s = log(sum(exp(x - m)))
    (the log-sum-exp pair of kernels/_fused_math.pxi: never x - (m + s), which loses s)"""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef const real* x
    cdef real* o
    cdef real m, s
    check_shape2("log_softmax_forward", "out", out.shape[0], out.shape[1], R, N)
    num_threads = threads_for(<double>R * N, _SOFTMAX_PARALLEL_MIN, num_threads)
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        x = &inp[r, 0]
        o = &out[r, 0]
        m = row_max(x, N)
        s = <real>log(row_exp_sum(x, o, N, m))           # scratch: the output row
        for j in range(N):
            o[j] = (x[j] - m) - s


@cython.wraparound(False)
def log_softmax_backward(real[:, ::1] dinp, const real[:, ::1] dout, const real[:, ::1] out,
                         int num_threads):
    """(R, N):  dinp = g - exp(y) * sum(g)"""
    cdef Py_ssize_t r, j, R = out.shape[0], N = out.shape[1]
    cdef const real* y
    cdef const real* g
    cdef real* dx
    cdef real s
    check_shape2("log_softmax_backward", "dinp", dinp.shape[0], dinp.shape[1], R, N)
    check_shape2("log_softmax_backward", "dout", dout.shape[0], dout.shape[1], R, N)
    num_threads = threads_for(<double>R * N, _SOFTMAX_BACKWARD_PARALLEL_MIN, num_threads)
    for r in prange(R, nogil=True, num_threads=num_threads, schedule="static"):
        y = &out[r, 0]
        g = &dout[r, 0]
        dx = &dinp[r, 0]
        s = <real>row_sum(g, N)
        for j in range(N):
            dx[j] = g[j] - vexp(y[j]) * s


# ---- cross-entropy (fused log-softmax + NLL) -------------------------------------

# Parallel threshold (logits): forward 1.9 ns a logit at one thread, backward 1.5
# (float32, (64, 256)): about 50-60 us here.
cdef double _CROSSENTROPY_PARALLEL_MIN = 1 << 15

@cython.wraparound(False)
def crossentropy_forward(real[::1] losses, real[::1] rowmax, real[::1] logsum,
                         const real[:, ::1] logits, const long long[::1] targets,
                         long long ignore_index, double label_smoothing, int num_threads):
    """(M, C) logits, (M,) targets -> losses (M,), and each row's log-sum-exp as the pair
    rowmax (M,) = m = max(x), logsum (M,) = s = log(sum(exp(x - m))) (lse = m + s):
    loss = (1 - eps) (s - (x[t] - m)) + eps (s - mean(x - m)),
    loss = 0 where t == ignore_index.  Stable: exp(x - m) never overflows, and the
    huge m cancels before it can round s away (see kernels/_fused_math.pxi)."""
    cdef Py_ssize_t c, r, r0, r1, j, bad, M = logits.shape[0], C = logits.shape[1]
    cdef const real* x
    cdef real* scratch
    cdef real* e = NULL                                   # per-thread row of exp(x - max)
    cdef double* sum_scratch
    cdef double* sums = NULL                              # per-thread: each row's sum
    cdef real m
    cdef double l
    cdef long long t
    check_size("crossentropy_forward", "losses", losses.shape[0], M)
    check_size("crossentropy_forward", "rowmax", rowmax.shape[0], M)
    check_size("crossentropy_forward", "logsum", logsum.shape[0], M)
    check_size("crossentropy_forward", "targets", targets.shape[0], M)
    if M == 0:
        return
    bad = first_bad_index(&targets[0], M, C, True, ignore_index)
    if bad >= 0:
        raise IndexError(f"crossentropy_forward: target {targets[bad]} is out of bounds for "
                         f"{C} classes (ignore_index={ignore_index})")
    num_threads = threads_for(<double>M * C, _CROSSENTROPY_PARALLEL_MIN, num_threads)
    scratch = <real*>scratch_alloc(C * num_threads, sizeof(real))
    try:
        sum_scratch = <double*>scratch_alloc(_ROWS_AT_ONCE * num_threads, sizeof(double))
    except MemoryError:
        free(scratch)
        raise
    with nogil, parallel(num_threads=num_threads):
        e = scratch + C * threadid()
        sums = sum_scratch + _ROWS_AT_ONCE * threadid()
        for c in prange((M + _ROWS_AT_ONCE - 1) // _ROWS_AT_ONCE, schedule="static"):
            # _ROWS_AT_ONCE rows a pass (see layernorm_forward): their maxima, their sums,
            # then their logs and losses
            r0 = c * _ROWS_AT_ONCE
            r1 = imin(M, r0 + _ROWS_AT_ONCE)
            for r in range(r0, r1):
                rowmax[r] = row_max(&logits[r, 0], C)
            for r in range(r0, r1):
                sums[r - r0] = row_exp_sum(&logits[r, 0], e, C, rowmax[r])
            for r in range(r0, r1):
                x = &logits[r, 0]
                m = rowmax[r]
                l = log(sums[r - r0])                      # s, in double
                logsum[r] = <real>l
                t = targets[r]
                if t == ignore_index:
                    losses[r] = 0
                elif label_smoothing > 0:
                    losses[r] = <real>((1 - label_smoothing) * (l - <real>(x[t] - m))
                                       + label_smoothing * (l - row_sum_dev(x, m, C) / C))
                else:
                    losses[r] = <real>(l - <real>(x[t] - m))
    free(scratch)
    free(sum_scratch)


@cython.wraparound(False)
def crossentropy_backward(real[:, ::1] dlogits, const real[::1] dlosses,
                          const real[:, ::1] logits, const real[::1] rowmax,
                          const real[::1] logsum, const long long[::1] targets,
                          long long ignore_index, double label_smoothing, int num_threads):
    """(M, C):  dlogits = dloss * (softmax(x) - (1 - eps) onehot(t) - eps / C),
    softmax recomputed from forward's pair as exp((x - rowmax) - logsum);  0 on ignored rows

    NOTE: an ignored row gets 0 * softmax(x), not a plain 0: NaN where that row's softmax
    is NaN (a NaN or +inf logit), as torch, whose log_softmax backward multiplies the
    zero gradient of an ignored row by exp(log_softmax(x))."""
    cdef Py_ssize_t r, j, bad, M = logits.shape[0], C = logits.shape[1]
    cdef const real* x
    cdef real* dx
    cdef real g, m, l, off
    cdef long long t
    check_shape2("crossentropy_backward", "dlogits", dlogits.shape[0], dlogits.shape[1], M, C)
    check_size("crossentropy_backward", "dlosses", dlosses.shape[0], M)
    check_size("crossentropy_backward", "rowmax", rowmax.shape[0], M)
    check_size("crossentropy_backward", "logsum", logsum.shape[0], M)
    check_size("crossentropy_backward", "targets", targets.shape[0], M)
    if M == 0:
        return
    bad = first_bad_index(&targets[0], M, C, True, ignore_index)
    if bad >= 0:
        raise IndexError(f"crossentropy_backward: target {targets[bad]} is out of bounds for "
                         f"{C} classes (ignore_index={ignore_index})")
    num_threads = threads_for(<double>M * C, _CROSSENTROPY_PARALLEL_MIN, num_threads)
    for r in prange(M, nogil=True, num_threads=num_threads, schedule="static"):
        x = &logits[r, 0]
        dx = &dlogits[r, 0]
        t = targets[r]
        m = rowmax[r]
        l = logsum[r]
        if t == ignore_index:
            for j in range(C):
                dx[j] = 0 * softmax_at(x[j], m, l)
        else:
            g = dlosses[r]
            off = <real>(label_smoothing / C)
            for j in range(C):
                dx[j] = g * (softmax_at(x[j], m, l) - off)
            dx[t] = dx[t] - g * <real>(1 - label_smoothing)


# ---- embedding -------------------------------------------------------------------

# Parallel threshold (elements copied) of embedding and dropout, which move memory:
# 0.39 ns an element at one thread (float32): about 50 us here.
cdef double _COPY_PARALLEL_MIN = 1 << 17

@cython.wraparound(False)
def embedding_forward(real[:, ::1] out, const long long[::1] ids, const real[:, ::1] weight,
                      int num_threads):
    """(M,) ids, (V, D) weight -> out (M, D):  out[i] = weight[ids[i]]"""
    cdef Py_ssize_t i, j, bad, M = ids.shape[0], D = weight.shape[1]
    cdef long long row
    check_shape2("embedding_forward", "out", out.shape[0], out.shape[1], M, D)
    if M == 0 or D == 0:
        return
    bad = first_bad_index(&ids[0], M, weight.shape[0], False, 0)
    if bad >= 0:
        raise IndexError(f"embedding_forward: index {ids[bad]} is out of range for "
                         f"{weight.shape[0]} rows")
    num_threads = threads_for(<double>M * D, _COPY_PARALLEL_MIN, num_threads)
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
    cdef Py_ssize_t c, i, j, j0, j1, bad, M = ids.shape[0], D = dout.shape[1]
    cdef Py_ssize_t P, cols_per
    cdef long long row
    check_shape2("embedding_backward", "dout", dout.shape[0], dout.shape[1], M, dweight.shape[1])
    if M == 0 or D == 0:
        return
    bad = first_bad_index(&ids[0], M, dweight.shape[0], False, 0)
    if bad >= 0:
        raise IndexError(f"embedding_backward: index {ids[bad]} is out of range for "
                         f"{dweight.shape[0]} rows")
    num_threads = threads_for(<double>M * D, _COPY_PARALLEL_MIN, num_threads)
    P = num_threads if D >= 16 * num_threads else 1
    cols_per = (D + P - 1) // P
    for c in prange(P, nogil=True, num_threads=num_threads, schedule="static"):
        j0 = c * cols_per
        j1 = imin(D, j0 + cols_per)
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
    check_size("dropout_forward", "out", out.shape[0], n)
    check_size("dropout_forward", "mask", mask.shape[0], n)
    check_size("dropout_forward", "uniform", uniform.shape[0], n)
    num_threads = threads_for(n, _COPY_PARALLEL_MIN, num_threads)
    for i in prange(n, nogil=True, num_threads=num_threads, schedule="static"):
        if uniform[i] >= pf:
            mask[i] = scale
        else:
            mask[i] = 0
        out[i] = inp[i] * mask[i]
