# Math helpers shared by the fused kernels (kernels/_fused.pyx, kernels/_fused_attention.pyx).
#
# Why not libm: a scalar call to expf/erff/tanhf costs 5-40 ns here and stops the
# compiler from vectorising the loop around it, which made exp the bottleneck of
# softmax, cross-entropy, attention and GELU. For float32 the functions below are plain
# polynomials and selects that gcc turns into SIMD code; float64 (the gradcheck dtype)
# keeps libm's correctly rounded functions.
#
# NOTE: gcc refuses to vectorise a float select (`a if x > c else b`) while it assumes
# that float compares may trap; the pragma lifts that assumption for this file only
# (it changes no result: microtensor never unmasks floating-point exceptions).

cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__)
    #pragma GCC optimize ("no-trapping-math")
    #endif
    """

from libc.math cimport exp, expf, log, sqrt, erf, erfc, fabs, fabsf, INFINITY, NAN
from libc.stdlib cimport malloc, free
# the float types (real) and the thread bound (bounded_threads, threads_for) of every extension
from microtensor.kernels._common cimport real, bounded_threads, threads_for, use_team
from microtensor.kernels._blas import team_pointer as _team_pointer

if CPU_RUNS_THIS_BUILD:     # use_team is compiled for this build's CPU (see kernels/_kernel_target.pxi)
    use_team(_team_pointer())   # the team microtensor.kernels._blas measures (team_of in kernels/_common.pxd)


cdef union _f32_bits:
    float f
    int i


cdef inline float expf_poly(float x) noexcept nogil:
    """e^x in float32, relative error < 1.2e-7: x = n ln2 + r with |r| <= ln2/2, then
    e^x = 2^n * (degree-7 Taylor polynomial of e^r), 2^n built from its exponent bits.
    e^x = 0 below -87.3 (where float32 turns denormal), inf above 88.7, NaN stays NaN."""
    cdef float xc = x if x > <float>-87.3 else <float>-87.3
    xc = xc if xc < <float>88.7 else <float>88.7
    # round to nearest integer with the 1.5 * 2^23 trick (no floor call, vectorises)
    cdef float n = (xc * <float>1.4426950408889634 + <float>12582912.0) - <float>12582912.0
    # ln2 split in two so that n * ln2_hi is exact (Cody and Waite)
    cdef float r = xc - n * <float>0.693145751953125 - n * <float>1.428606765330187e-06
    cdef float p
    p = <float>1 + r * (<float>1 + r * (<float>0.5 + r * (<float>0.16666667
        + r * (<float>0.041666668 + r * (<float>0.008333334 + r * (<float>0.0013888889
        + r * <float>0.0001984127))))))
    cdef _f32_bits scale
    scale.i = (<int>n + 127) << 23
    p = p * scale.f
    p = <float>0 if x < <float>-87.3 else p
    p = <float>INFINITY if x > <float>88.7 else p
    return x if x != x else p


cdef inline real vexp(real x) noexcept nogil:
    if real is float:
        return expf_poly(x)
    else:
        return exp(x)


cdef inline real vtanh(real x) noexcept nogil:
    """tanh(x) = 1 - 2 / (1 + e^(2x)): exact at both tails (e^(2x) -> 0 or inf);
    absolute error ~1e-7 in float32 near 0."""
    if real is float:
        return <float>1 - <float>2 / (<float>1 + expf_poly(<float>2 * x))
    else:
        return 1 - 2 / (1 + exp(2 * x))


cdef inline float erfc_scaled_poly(float t) noexcept nogil:
    """Q(t) ~= erfcx(z) / t, with t = 1 / (1 + 0.4 z), z >= 0 (erfcx(z) = e^(z^2) erfc(z)).
    Own least-squares fit in Chebyshev form over t in (0, 1], converted to powers of t:
    relative error 1e-8 in float64 arithmetic, so float32 rounding dominates."""
    return (<float>0.22567589 + t * (<float>0.2256649 + t * (<float>0.20797743
        + t * (<float>0.16706989 + t * (<float>0.14942139 + t * (<float>-0.029800415
        + t * (<float>0.21187 + t * (<float>-0.22678812 + t * (<float>0.07444016
        + t * <float>-0.00553106)))))))))


cdef inline real normal_cdf_from(real x, real z, real e) noexcept nogil:
    """Phi(x) = P(N(0,1) <= x), given z = |x| / sqrt 2 and e = exp(-z^2) (which the GELU
    backward reuses for the density). Phi = 1 - erfc(z)/2 for x >= 0, erfc(z)/2 below."""
    cdef real half_erfc
    cdef float t
    if real is float:
        t = <float>1 / (<float>1 + <float>0.4 * z)
        half_erfc = <float>0.5 * t * erfc_scaled_poly(t) * e
        return <float>1 - half_erfc if x >= 0 else half_erfc
    else:
        return 0.5 * erfc(-x * 0.7071067811865476)


cdef inline real row_max(const real* x, Py_ssize_t n) noexcept nogil:
    """max(x[0:n]) (-inf for n = 0), with 8 running maxima so that it vectorises."""
    cdef real m0 = -INFINITY, m1 = -INFINITY, m2 = -INFINITY, m3 = -INFINITY
    cdef real m4 = -INFINITY, m5 = -INFINITY, m6 = -INFINITY, m7 = -INFINITY
    cdef Py_ssize_t j = 0
    while j + 8 <= n:
        m0 = x[j] if x[j] > m0 else m0
        m1 = x[j + 1] if x[j + 1] > m1 else m1
        m2 = x[j + 2] if x[j + 2] > m2 else m2
        m3 = x[j + 3] if x[j + 3] > m3 else m3
        m4 = x[j + 4] if x[j + 4] > m4 else m4
        m5 = x[j + 5] if x[j + 5] > m5 else m5
        m6 = x[j + 6] if x[j + 6] > m6 else m6
        m7 = x[j + 7] if x[j + 7] > m7 else m7
        j = j + 8
    while j < n:
        m0 = x[j] if x[j] > m0 else m0
        j = j + 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    return m4 if m4 > m0 else m0


cdef inline double row_sum(const real* x, Py_ssize_t n) noexcept nogil:
    """sum(x[0:n]) with 8 partial sums (vectorises; also more accurate than one chain)."""
    cdef real s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t j = 0
    while j + 8 <= n:
        s0 = s0 + x[j]
        s1 = s1 + x[j + 1]
        s2 = s2 + x[j + 2]
        s3 = s3 + x[j + 3]
        s4 = s4 + x[j + 4]
        s5 = s5 + x[j + 5]
        s6 = s6 + x[j + 6]
        s7 = s7 + x[j + 7]
        j = j + 8
    while j < n:
        s0 = s0 + x[j]
        j = j + 1
    return (<double>s0 + s1) + (<double>s2 + s3) + ((<double>s4 + s5) + (<double>s6 + s7))


cdef inline double row_sum_dev(const real* x, real m, Py_ssize_t n) noexcept nogil:
    """sum(x[0:n] - m) with 8 partial sums: the row's sum measured from its max, exact
    where sum(x) - n m is not (x of 1e30 in float32: each x - m is 0, sum(x) is off by
    ~1e23)."""
    cdef real s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t j = 0
    while j + 8 <= n:
        s0 = s0 + (x[j] - m)
        s1 = s1 + (x[j + 1] - m)
        s2 = s2 + (x[j + 2] - m)
        s3 = s3 + (x[j + 3] - m)
        s4 = s4 + (x[j + 4] - m)
        s5 = s5 + (x[j + 5] - m)
        s6 = s6 + (x[j + 6] - m)
        s7 = s7 + (x[j + 7] - m)
        j = j + 8
    while j < n:
        s0 = s0 + (x[j] - m)
        j = j + 1
    return (<double>s0 + s1) + (<double>s2 + s3) + ((<double>s4 + s5) + (<double>s6 + s7))


# ---- the log-sum-exp, one for every kernel --------------------------------------------
# lse(x) = log(sum(exp(x))) is kept as a PAIR (m, s): m = max(x), s = log(sum(exp(x - m)))
# in [0, log n], and never added up into one number. m + s rounds s away when m is large
# (1e9 in float32 has a spacing of 64: 1e9 + log 5 == 1e9), so everything that needs the
# log-sum-exp uses the pair in that order: log_softmax(x) = (x - m) - s, the softmax that
# backward recomputes is exp((x - m) - s), the cross-entropy loss is s - (x[t] - m).
# x - m is exact when x is near m (Sterbenz) and only the small s is rounded.
# Rows as torch: a row of -inf gives m = -inf, x - m = NaN, a NaN row (torch's
# log_softmax, softmax and cross_entropy give NaN too); a +inf or NaN entry gives NaN.
# Attention's all-masked rows (every score -inf) are its own rule: see _fused_attention.

cdef inline double row_exp_sum(const real* x, real* e, Py_ssize_t n, real m) noexcept nogil:
    """e[0:n] = exp(x - m) (e may be x itself) and returns sum(e); with m = row_max(x, n)
    that sum is in [1, n] for a finite row, and s = log of it completes the pair (m, s).
    (m is the caller's: a variable assigned in a prange body is private to its thread,
    one written through a pointer would be shared.)"""
    cdef Py_ssize_t j
    for j in range(n):
        e[j] = vexp(x[j] - m)
    return row_sum(e, n)


cdef inline real softmax_at(real x, real m, real s) noexcept nogil:
    """exp(x - lse) for lse kept as the pair (m, s): exp((x - m) - s)."""
    return vexp((x - m) - s)


cdef inline double row_dot(const real* x, const real* y, Py_ssize_t n) noexcept nogil:
    """sum(x[0:n] * y[0:n]) with 8 partial sums."""
    cdef real s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t j = 0
    while j + 8 <= n:
        s0 = s0 + x[j] * y[j]
        s1 = s1 + x[j + 1] * y[j + 1]
        s2 = s2 + x[j + 2] * y[j + 2]
        s3 = s3 + x[j + 3] * y[j + 3]
        s4 = s4 + x[j + 4] * y[j + 4]
        s5 = s5 + x[j + 5] * y[j + 5]
        s6 = s6 + x[j + 6] * y[j + 6]
        s7 = s7 + x[j + 7] * y[j + 7]
        j = j + 8
    while j < n:
        s0 = s0 + x[j] * y[j]
        j = j + 1
    return (<double>s0 + s1) + (<double>s2 + s3) + ((<double>s4 + s5) + (<double>s6 + s7))


cdef inline double row_sum_sq_dev(const real* x, real mean, Py_ssize_t n) noexcept nogil:
    """sum((x[0:n] - mean)^2) with 8 partial sums."""
    cdef real s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef real d0, d1, d2, d3, d4, d5, d6, d7
    cdef Py_ssize_t j = 0
    while j + 8 <= n:
        d0 = x[j] - mean
        d1 = x[j + 1] - mean
        d2 = x[j + 2] - mean
        d3 = x[j + 3] - mean
        d4 = x[j + 4] - mean
        d5 = x[j + 5] - mean
        d6 = x[j + 6] - mean
        d7 = x[j + 7] - mean
        s0 = s0 + d0 * d0
        s1 = s1 + d1 * d1
        s2 = s2 + d2 * d2
        s3 = s3 + d3 * d3
        s4 = s4 + d4 * d4
        s5 = s5 + d5 * d5
        s6 = s6 + d6 * d6
        s7 = s7 + d7 * d7
        j = j + 8
    while j < n:
        d0 = x[j] - mean
        s0 = s0 + d0 * d0
        j = j + 1
    return (<double>s0 + s1) + (<double>s2 + s3) + ((<double>s4 + s5) + (<double>s6 + s7))


cdef inline Py_ssize_t imin(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


# ---- safety at the kernel entry -------------------------------------------------------
# The Python side checks shapes and index ranges, but a kernel must also be safe when
# called directly (bounds checks are off in here): every entry checks the sizes it relies
# on (O(1)), index arrays are range-checked before any row is touched (O(rows), small
# next to the O(rows * cols) work), thread counts are clamped (bounded_threads, from
# kernels/_common.pxd), and scratch memory is allocated once, with the GIL, before the parallel
# region, so that a failed allocation raises MemoryError instead of handing NULL to a
# thread.

cdef size_t _alloc_limit = <size_t>-1   # tests lower it to reach the MemoryError path


def _set_alloc_limit(limit=None):
    """Refuse scratch allocations above `limit` bytes (None: no limit). For tests of the
    MemoryError path; returns the previous limit (None when there was none)."""
    global _alloc_limit
    prev = None if _alloc_limit == <size_t>-1 else _alloc_limit
    _alloc_limit = <size_t>-1 if limit is None else <size_t>limit
    return prev


cdef void* scratch_alloc(Py_ssize_t count, Py_ssize_t itemsize) except NULL:
    """malloc(count * itemsize), or MemoryError (also when the product overflows)."""
    cdef void* p
    if count < 0 or itemsize <= 0:
        raise ValueError(f"bad scratch size: {count} x {itemsize} bytes")
    if count > 0 and <size_t>count > _alloc_limit // <size_t>itemsize:
        raise MemoryError(f"cannot allocate {count} x {itemsize} bytes of kernel scratch memory")
    p = malloc(<size_t>count * <size_t>itemsize if count > 0 else 1)
    if p == NULL:
        raise MemoryError(f"cannot allocate {count} x {itemsize} bytes of kernel scratch memory")
    return p


cdef inline Py_ssize_t first_bad_index(const long long* ids, Py_ssize_t n, long long limit,
                                       bint has_allowed, long long allowed) noexcept nogil:
    """The first i with ids[i] outside [0, limit) (and, when has_allowed, not equal to
    `allowed`, e.g. cross-entropy's ignore_index), or -1 when every index is good."""
    cdef Py_ssize_t i
    for i in range(n):
        if (ids[i] < 0 or ids[i] >= limit) and not (has_allowed and ids[i] == allowed):
            return i
    return -1


cdef check_shape2(str kernel, str what, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t R,
                  Py_ssize_t N):
    if rows != R or cols != N:
        raise ValueError(f"{kernel}: {what} has shape ({rows}, {cols}), expected ({R}, {N})")


cdef check_size(str kernel, str what, Py_ssize_t got, Py_ssize_t expected):
    if got != expected:
        raise ValueError(f"{kernel}: {what} has size {got}, expected {expected}")
