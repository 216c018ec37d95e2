# cython: embedsignature=True, wraparound=True
"""The matrix-vector product: y = W @ x (+ b) for a linear layer's forward on one row
(a generated token), W's rows split over the threads, one slice a thread.

Why not the gemm of one row? Generating a token multiplies one row by every weight of
the model: the product is memory-bound (each weight is read once and used once), and
what decides its speed is how the weight is read. A gemm of one row packs the weight
into its own buffer before it multiplies (a read, a write and a second read of the
500 MB of GPT-2 small's weights for each token). Here each thread reads its slice of W
once, row after row, front to back: one sequential stream, which the CPU's prefetcher
follows at close to the memory's speed (mt_dot_rows below). A BLAS gemv 'T' walks
several rows at once, several streams: on one core of an AMD EPYC (Zen 4) it read
GPT-2's weights at 15 GB/s where this reads them at 24-27 (19 ms a token, not 30).

A transposed view (W stored (in, out), a Conv1D layout) is read as it lies by the
BLAS's gemv 'N': oneMKL's sgemv/dgemv when _blas chose oneMKL
(microtensor/runtime/_blas_choice.py), else scipy's OpenBLAS through cython_blas
(pinned to one thread by _blas). The split follows the configured thread count (its
slices are whole tiles of 16 rows), the team only runs it, as in _blas.gemm.
"""
import numpy as np
from cython.parallel cimport prange
cimport cython
from scipy.linalg.cython_blas cimport sgemv, dgemv
from microtensor.kernels._common cimport real, team_of, use_team, MT_PARALLEL_MIN_SCALE
from microtensor.kernels import _blas
from microtensor.runtime import _blas_choice

# Parallel threshold, in weight elements (one multiply-add each): below 1 << 17 (512 KB
# of float32, about 30 us at one thread at 16 GB/s) waking a second thread costs more
# than its half of the reading saves (see "when a kernel goes parallel" in _common.pxd).
cdef double _PARALLEL_MIN = 1 << 17

ctypedef void (*sgemv_ptr)(char*, int*, int*, float*, float*, int*, float*, int*,
                           float*, float*, int*) noexcept nogil
ctypedef void (*dgemv_ptr)(char*, int*, int*, double*, double*, int*, double*, int*,
                           double*, double*, int*) noexcept nogil

cdef void* _sgemv = <void*>sgemv
cdef void* _dgemv = <void*>dgemv

cdef extern from *:
    # W's rows times x, one row after the other: W is read front to back as one stream,
    # which the CPU's prefetcher follows best (a BLAS gemv 'T' walks several rows at once,
    # several streams: 15 GB/s where this reads 21-27 on one core of an AMD EPYC, Zen 4).
    # 16 independent running sums per row: the compiler keeps them in vector registers
    # at any target (SSE2 up), without reordering a single sum.
    """
    #define MT_DOT_ROWS(NAME, T)                                                        \
    static void NAME(const T* w, Py_ssize_t rows, Py_ssize_t K, const T* x, T* y,      \
                     const T* bias) {                                                  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                        \
            const T* wr = w + r * K;                                                   \
            T acc[16] = {0};                                                           \
            Py_ssize_t k = 0;                                                          \
            for (; k + 16 <= K; k += 16)                                               \
                for (int j = 0; j < 16; j++)                                           \
                    acc[j] += wr[k + j] * x[k + j];                                    \
            T total = 0;                                                               \
            for (int j = 0; j < 16; j++)                                               \
                total += acc[j];                                                       \
            for (; k < K; k++)                                                         \
                total += wr[k] * x[k];                                                 \
            y[r] = bias ? total + bias[r] : total;                                     \
        }                                                                              \
    }
    MT_DOT_ROWS(mt_dot_rows_f, float)
    MT_DOT_ROWS(mt_dot_rows_d, double)
    """
    void mt_dot_rows_f(const float* w, Py_ssize_t rows, Py_ssize_t K, const float* x,
                       float* y, const float* bias) noexcept nogil
    void mt_dot_rows_d(const double* w, Py_ssize_t rows, Py_ssize_t K, const double* x,
                       double* y, const double* bias) noexcept nogil


cdef inline void _blas_gemv(char trans, int m, int n, const real* a, int lda,
                            const real* x, real beta, real* y) noexcept nogil:
    """Column-major y (n or m) = op(A) x + beta * y, A (m, n) with leading dimension lda
    (Fortran's gemv, unit strides)."""
    cdef int inc = 1
    cdef real one = 1
    if real is float:
        (<sgemv_ptr>_sgemv)(&trans, &m, &n, &one, <float*>a, &lda, <float*>x, &inc,
                            &beta, y, &inc)
    else:
        (<dgemv_ptr>_dgemv)(&trans, &m, &n, &one, <double*>a, &lda, <double*>x, &inc,
                            &beta, y, &inc)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _gemv_slice(bint w_transposed, int r0, int rows, int M, int N, int K,
                      const real* w, const real* x, real* y, const real* bias) noexcept nogil:
    """y[m, r0:r0+rows] = W[r0:r0+rows] @ x[m] (+ bias[r0:r0+rows]) for each of the M rows
    of x (M, K); y (M, N).

    W (N, K) row-major is, read column-major, W^T (K, N): gemv 'T' over its columns
    r0.. . A transposed view (W stored (K, N) row-major) is column-major W (N, K):
    gemv 'N' over its rows r0.. ."""
    cdef Py_ssize_t m, j
    cdef real beta = 0
    cdef real* yrow
    cdef char trans_n = b'N'
    for m in range(M):
        yrow = y + m * <Py_ssize_t>N + r0
        if not w_transposed:                        # W's rows in order: one stream
            if real is float:
                mt_dot_rows_f(w + r0 * <Py_ssize_t>K, rows, K, x + m * <Py_ssize_t>K, yrow,
                              NULL if bias == NULL else bias + r0)
            else:
                mt_dot_rows_d(w + r0 * <Py_ssize_t>K, rows, K, x + m * <Py_ssize_t>K, yrow,
                              NULL if bias == NULL else bias + r0)
            continue
        if bias != NULL:
            for j in range(rows):
                yrow[j] = bias[r0 + j]
            beta = 1                                # y = W x + y: the bias rides along
        _blas_gemv(trans_n, rows, K, w + r0, N, x + m * <Py_ssize_t>K, beta, yrow)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _gemv_rows(bint w_transposed, int M, int N, int K, const real* w, const real* x,
                     real* y, const real* bias, int nthreads) noexcept nogil:
    """y (M, N) = x (M, K) @ W^T (+ bias), W (N, K), split into nthreads slices of W's
    rows (the output features), each a multiple of 16 rows but the last."""
    cdef int n = nthreads if N >= 16 * nthreads else 1
    cdef int chunk = ((N + n - 1) // n + 15) // 16 * 16
    cdef int nchunks = (N + chunk - 1) // chunk
    cdef int i, r0, rows
    if nchunks == 1:                                # no parallel region to open
        _gemv_slice(w_transposed, 0, N, M, N, K, w, x, y, bias)
        return
    for i in prange(nchunks, nogil=True, num_threads=team_of(nchunks), schedule="static"):
        r0 = i * chunk
        rows = N - r0 if N - r0 < chunk else chunk
        _gemv_slice(w_transposed, r0, rows, M, N, K, w, x, y, bias)


def gemv(w, x, bias=None, int num_threads=1):
    """x @ w.T (+ bias) for a weight w (N, K) and rows x (M, K) or a vector x (K,):
    (M, N) or (N,), float32/float64 of one dtype. For a few rows (M = 1 above all):
    each row is a gemv that reads w in place, once per row.

    w may be C-contiguous or a transposed view of a C-contiguous array (no copy either
    way); x is made contiguous; bias, when given, a 1-D array of N."""
    if not isinstance(w, np.ndarray) or not isinstance(x, np.ndarray):
        raise TypeError(f"gemv takes numpy arrays, got {type(w).__name__} and {type(x).__name__}")
    if w.ndim != 2 or x.ndim not in (1, 2) or x.shape[x.ndim - 1] != w.shape[1]:
        raise ValueError(f"gemv: weight {w.shape} and input {x.shape} do not fit (weight "
                         f"(N, K), input (M, K) or (K,))")
    if w.dtype != x.dtype or w.dtype.kind != "f" or w.dtype.itemsize not in (4, 8):
        raise TypeError(f"gemv takes float32 or float64 arrays of one dtype, got {w.dtype} "
                        f"and {x.dtype}")
    cdef int N = w.shape[0], K = w.shape[1]
    cdef int M = 1 if x.ndim == 1 else x.shape[0]
    if bias is not None:
        if (not isinstance(bias, np.ndarray) or bias.ndim != 1 or bias.shape[0] != N
                or bias.dtype != w.dtype):
            raise ValueError(f"gemv: bias must be a 1-D {w.dtype} array of {N}, got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} "
                             f"{getattr(bias, 'shape', '')}")
        bias = np.ascontiguousarray(bias)
    if x.ndim == 2:
        out = np.empty((M, N), dtype=w.dtype)
    else:
        out = np.empty(N, dtype=w.dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out[...] = 0 if bias is None else bias
        return out
    cdef bint w_transposed = False
    if not w.flags.c_contiguous:
        if w.T.flags.c_contiguous:
            w, w_transposed = w.T, True              # (K, N) storage: gemv 'N'
        else:
            w = np.ascontiguousarray(w)
    x = np.ascontiguousarray(x)
    cdef int nthreads = num_threads
    if <double>N * K * M < _PARALLEL_MIN * MT_PARALLEL_MIN_SCALE or nthreads < 1:
        nthreads = 1
    cdef const float[::1] fw, fx, fb
    cdef float[::1] fy
    cdef const double[::1] dw, dx, db
    cdef double[::1] dy
    cdef const float* fbias = NULL
    cdef const double* dbias = NULL
    if w.dtype.itemsize == 4:
        fw, fx, fy = w.reshape(-1), x.reshape(-1), out.reshape(-1)
        if bias is not None:
            fb = bias
            fbias = &fb[0]
        _gemv_rows[float](w_transposed, M, N, K, &fw[0], &fx[0], &fy[0], fbias, nthreads)
    else:
        dw, dx, dy = w.reshape(-1), x.reshape(-1), out.reshape(-1)
        if bias is not None:
            db = bias
            dbias = &db[0]
        _gemv_rows[double](w_transposed, M, N, K, &dw[0], &dx[0], &dy[0], dbias, nthreads)
    return out


def _choose_gemv():
    """Point gemv at the chosen BLAS's: oneMKL's sgemv_/dgemv_ when _blas chose oneMKL,
    else scipy's. Returns the library's name."""
    global _sgemv, _dgemv
    lib = _blas_choice._loaded.get("mkl") if _blas.blas_choice()["name"] == "mkl" else None
    if lib is None:
        _sgemv, _dgemv = <void*>sgemv, <void*>dgemv
        return "openblas"
    cdef size_t s = _blas_choice._address(lib, "sgemv_")
    cdef size_t d = _blas_choice._address(lib, "dgemv_")
    _sgemv, _dgemv = <void*>s, <void*>d
    return "mkl"


use_team(<size_t>_blas.team_pointer())
_library = _choose_gemv()
