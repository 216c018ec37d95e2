# Cython kernels of the core ops. Each takes contiguous typed memoryviews of a fused
# float type, releases the GIL and loops with prange over rows or elements. Shapes are
# checked by the caller before a kernel runs: bounds checks are off in here.

from cython.parallel cimport prange
from libc.math cimport exp as c_exp, log as c_log, sqrt as c_sqrt, fabs, INFINITY
cimport cython

from microtensor.kernels._common cimport real, threads_for, use_team, MT_PARALLEL_MIN_SCALE   # float32 and float64; the team
from microtensor.kernels._blas import team_pointer as _team_pointer

use_team(_team_pointer())   # the team microtensor.kernels._blas measures (team_of in kernels/_common.pxd)

# The thread policy is microtensor.threads.default_num_threads() (OMP_NUM_THREADS, else
# the physical cores, within the container's CPU quota): microtensor/__init__.py sets it
# once the package is imported. Until then the kernels run on one thread.
cdef int _num_threads = 1
# Parallel threshold (elements; see threads_for in kernels/_common.pxd) of the kernels below,
# which mostly move memory: at one thread, float32, exp_backward 0.27 ns an element,
# relu_forward 0.31, tanh_backward 0.79 on a 2-core Intel Xeon (Sapphire Rapids class;
# best of many runs): 35-100 us at the bound. (It was 1 << 15, under 10 us.)
cdef double _PARALLEL_MIN = 1 << 17


def set_num_threads(n):
    """Threads used by microtensor's own kernels (BLAS has its own setting)."""
    global _num_threads
    _num_threads = _bounded_threads(n, "set_num_threads")


def get_num_threads():
    return _num_threads


cdef inline int _threads(Py_ssize_t work) noexcept nogil:
    return threads_for(work, _PARALLEL_MIN, _num_threads)


cdef inline int _check_same(str kernel, Py_ssize_t n, Py_ssize_t a, Py_ssize_t b) except -1:
    """Every kernel entry checks its arrays' sizes: bounds checks are off inside."""
    if a != n or b != n:
        raise ValueError(f"{kernel}: arrays of {n}, {a} and {b} elements; they must match")
    return 0


cdef int _max_threads():
    import os
    return _builtins_max(256, 4 * (os.cpu_count() or 1))


cdef inline int _builtins_max(int a, int b):
    return a if a > b else b


cdef inline int _bounded_threads(object n, str what) except -1:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"{what}: the number of threads must be an int, got {type(n).__name__}")
    limit = _max_threads()
    if n < 1 or n > limit:
        raise ValueError(f"{what}: number of threads must be between 1 and {limit}, got {n}")
    return n


# ---- elementwise backward pairs (dinp = dout * f'(...)), flat contiguous ----------

@cython.boundscheck(False)
@cython.wraparound(False)
def exp_backward(real[::1] dinp, const real[::1] dout, const real[::1] out):
    """d exp(x) = g * exp(x) = g * y"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("exp_backward", n, dout.shape[0], out.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] * out[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def log_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp):
    """d log(x) = g / x"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("log_backward", n, dout.shape[0], inp.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] / inp[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def sqrt_backward(real[::1] dinp, const real[::1] dout, const real[::1] out):
    """d sqrt(x) = g / (2 sqrt(x))"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("sqrt_backward", n, dout.shape[0], out.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] * 0.5 / out[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def tanh_backward(real[::1] dinp, const real[::1] dout, const real[::1] out):
    """d tanh(x) = g * (1 - y^2)"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("tanh_backward", n, dout.shape[0], out.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] * (1 - out[i] * out[i])


@cython.boundscheck(False)
@cython.wraparound(False)
def sigmoid_forward(real[::1] out, const real[::1] inp):
    """y = 1 / (1 + exp(-x)), written so that neither branch overflows"""
    cdef Py_ssize_t i, n = out.shape[0]
    _check_same("sigmoid_forward", n, inp.shape[0], n)
    cdef real z
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        if inp[i] >= 0:
            out[i] = 1 / (1 + c_exp(-inp[i]))
        else:
            z = c_exp(inp[i])
            out[i] = z / (1 + z)


@cython.boundscheck(False)
@cython.wraparound(False)
def sigmoid_backward(real[::1] dinp, const real[::1] dout, const real[::1] out):
    """d sigmoid(x) = g * y * (1 - y)"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("sigmoid_backward", n, dout.shape[0], out.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] * out[i] * (1 - out[i])


@cython.boundscheck(False)
@cython.wraparound(False)
def relu_forward(real[::1] out, const real[::1] inp):
    """y = max(x, 0)"""
    cdef Py_ssize_t i, n = out.shape[0]
    _check_same("relu_forward", n, inp.shape[0], n)
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        out[i] = 0 if inp[i] <= 0 else inp[i]     # NOTE: written so that NaN stays NaN


@cython.boundscheck(False)
@cython.wraparound(False)
def relu_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp):
    """d relu(x) = g * (x > 0).  NOTE: the gradient at exactly 0 is 0, as in torch
    (and at NaN it is g, as torch's `x <= 0 ? 0 : g`)."""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("relu_backward", n, dout.shape[0], inp.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = 0 if inp[i] <= 0 else dout[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def abs_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp):
    """d |x| = g * sign(x)  (0 at 0, as in torch; g * 0 and g * NaN keep a NaN)"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("abs_backward", n, dout.shape[0], inp.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        if inp[i] > 0:
            dinp[i] = dout[i]
        elif inp[i] < 0:
            dinp[i] = -dout[i]
        elif inp[i] == 0:
            dinp[i] = dout[i] * 0
        else:
            dinp[i] = dout[i] * inp[i]     # sign(NaN) is NaN


@cython.boundscheck(False)
@cython.wraparound(False)
def clamp_backward(real[::1] dinp, const real[::1] dout, const real[::1] inp,
                   double lo, double hi):
    """d clamp(x, lo, hi) = g where lo <= x <= hi, else 0"""
    cdef Py_ssize_t i, n = dinp.shape[0]
    _check_same("clamp_backward", n, dout.shape[0], inp.shape[0])
    for i in prange(n, nogil=True, num_threads=_threads(n), schedule="static"):
        dinp[i] = dout[i] if (inp[i] >= lo and inp[i] <= hi) else 0


# ---- reductions along the last axis (rows of a 2-D view) ---------------------------

@cython.boundscheck(False)
@cython.wraparound(False)
def max_lastdim(const real[:, ::1] inp, real[::1] values, long long[::1] indices):
    """(R, N) -> values (R,), indices (R,): the first maximum of each row (NaN wins)"""
    cdef Py_ssize_t r, j, R = inp.shape[0], N = inp.shape[1]
    cdef Py_ssize_t best
    cdef real m
    if values.shape[0] != R or indices.shape[0] != R:
        raise ValueError(f"max_lastdim: {R} rows but {values.shape[0]} values and "
                         f"{indices.shape[0]} indices")
    if N == 0 and R > 0:
        raise ValueError("max_lastdim: rows of length 0 have no maximum")
    for r in prange(R, nogil=True, num_threads=_threads(R * N), schedule="static"):
        best = 0
        m = inp[r, 0]
        for j in range(1, N):
            if inp[r, j] > m or (inp[r, j] != inp[r, j] and m == m):
                m = inp[r, j]
                best = j
        values[r] = m
        indices[r] = best


# ---- gather / scatter-add along the first axis -------------------------------------

@cython.boundscheck(False)
@cython.wraparound(False)
def scatter_add_rows(real[:, ::1] dst, const long long[::1] index, const real[:, ::1] src):
    """dst[index[i], :] += src[i, :]   (repeated indices accumulate)

    NOTE: serial over i on purpose: two rows with the same index must not be added by
    two threads at once. The inner loop over D is what gets vectorised."""
    cdef Py_ssize_t i, j, row, M = index.shape[0], D = src.shape[1], R = dst.shape[0]
    if src.shape[0] != M or dst.shape[1] != D:
        raise ValueError(f"scatter_add_rows: src of shape {tuple(src.shape)[:2]} for {M} "
                         f"indices into rows of {dst.shape[1]}")
    for i in range(M):
        if index[i] < 0 or index[i] >= R:
            raise IndexError(f"scatter_add_rows: index {index[i]} is out of range for {R} rows")
    with nogil:
        for i in range(M):
            row = index[i]
            for j in range(D):
                dst[row, j] += src[i, j]


@cython.boundscheck(False)
@cython.wraparound(False)
def sum_of_squares(const real[::1] x, int num_threads=1):
    """sum(x^2) accumulated in double, in one pass (clip_grad_norm_'s inner loop).

    The elements are split into num_threads pieces (one piece below the threshold), each
    summed in order, and the pieces added in order: the same bits whatever team runs them."""
    cdef Py_ssize_t c, i, i0, i1, chunk, pieces, n = x.shape[0]
    cdef double total = 0
    cdef double s
    cdef double[::1] partial
    _bounded_threads(num_threads, "sum_of_squares")
    pieces = 1 if n < _PARALLEL_MIN * MT_PARALLEL_MIN_SCALE else num_threads
    chunk = (n + pieces - 1) // pieces if n > 0 else 0
    partial = np.zeros(pieces)
    for c in prange(pieces, nogil=True, num_threads=threads_for(n, _PARALLEL_MIN, pieces),
                    schedule="static"):
        i0 = c * chunk
        i1 = i0 + chunk if i0 + chunk < n else n
        s = 0
        for i in range(i0, i1):
            s = s + <double>x[i] * x[i]
        partial[c] = s
    for c in range(pieces):
        total += partial[c]
    return total
