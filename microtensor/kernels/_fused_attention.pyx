# cython: embedsignature=True, wraparound=True
"""Fused scaled-dot-product attention: a forward/backward kernel pair.

Shapes (the Python side folds the batch dims into two, B1 x B2 = BH pairs (b, h)):
    q (B1, B2, Tq, hs), k (B1, B2, Tk, hs), v (B1, B2, Tk, hv), out / dout (B1, B2, Tq, hv)
        each row contiguous, the rows and the two batch dims at any stride: q, k and v
        are read where they lie (the heads of a (B, T, 3C) projection, `qkv.split(C, 2)`
        viewed as (B, T, nh, hs) and transposed, are read with no copy), and out is
        written where it lies (a (B, T, nh, hv) array viewed as (B, nh, T, hv), so that
        `y.transpose(1, 2)` is (B, T, C) in order, with no copy)
    rowmax, logsum (BH, Tq): the log-sum-exp of each row of scores as the pair
        (m, s) of kernels/_fused_math.pxi (lse = m + s, never added up), all backward keeps of
        softmax: P = exp((S - m) - s)
    mask (NM, Tq, Tk) additive float slabs, mask_index (BH,) picks the slab of each bh

    S = scale * q @ k^T + mask         P = softmax_rows(S)        out = P @ v
    dv = P^T @ dout     dP = dout @ v^T     dS = P * (dP - rowsum(P * dP))
    dq = scale * dS @ k          dk = scale * dS^T @ q

How it runs: threads take whole (b, h) pairs (prange over BH, no two threads ever write
the same dk / dv). Inside one pair the query rows go in blocks of `block` rows; a block
is one BLAS gemm for its scores (block, kmax), a row-wise softmax in place (a pass over
the block's rows for their maxima, one for exp and the sums, one for the division), and
one gemm into out. Only that block of scores exists at any time (one buffer per thread, never
the T x T matrix). Under is_causal, row i sees keys 0..i (top-left aligned, as torch),
so the block of rows [i0, i1) needs only the first kmax = min(Tk, i1) keys: the gemms
are trimmed to that and no work is spent on the masked upper triangle beyond the
block's own diagonal. Backward recomputes P from the saved (rowmax, logsum) pair, block by block.

NaN and Inf propagate as in torch, which adds a mask of -inf to the scores: a row of
NaN scores gives a NaN row (only a row whose every score is -inf, all masked, gives 0),
and under is_causal a NaN or inf that reaches a masked entry (NaN + -inf, inf + -inf
and 0 * inf are NaN) poisons that row. So the causal trimming is used only for a (b, h)
whose q, k, v (and dout) are finite and small enough that nothing can overflow (checked
in O((Tq + Tk) head_dim)); any other (b, h) computes every key, masked ones included,
as torch does.

Safety: each kernel checks every shape it relies on and the range of mask_index, and
allocates its per-thread scratch once, before the parallel region: a failed allocation
raises MemoryError (a row block never exceeds Tq, so one query against a long key
sequence needs one row of scores per thread, not `block` rows).

Dropout on P (dropout_p > 0) draws its keep/drop decisions from a counter-based hash of
(seed, bh, i, j), so backward regenerates the same mask without storing it.

BLAS: a Fortran gemm (the one microtensor.kernels._blas chose at import: oneMKL on Intel, else
scipy's cython_blas; callable without the GIL) does the matrix products. Fortran is column-major; a row-major matrix is its transpose there, so
`gemm` (microtensor/kernels/_common.pxd, shared with kernels/_blas.pyx) asks for C^T = op(B)^T op(A)^T:
swap the operands, keep the flags.
"""
from cython.parallel cimport prange, parallel, threadid
from libc.float cimport FLT_MAX, DBL_MAX
cimport cython
from microtensor.kernels._common cimport gemm, use_gemm

include "_kernel_target.pxi"
include "_fused_math.pxi"

cdef unsigned long long _GOLDEN = 0x9E3779B97F4A7C15
cdef unsigned long long _MIX1 = 0xBF58476D1CE4E5B9
cdef unsigned long long _MIX2 = 0x94D049BB133111EB


# ---- BLAS threads ------------------------------------------------------------------
# The kernels call gemm from inside an OpenMP parallel region, one (b, h) per thread.
# A pthreads-built OpenBLAS (scipy's wheels) would then start its own threads as well:
# oversubscription, and it warns that it "may hang". So scipy's OpenBLAS is set to one
# thread (microtensor.kernels._blas.pin_blas_threads; numpy's OpenBLAS is another library).
# NOTE: openblas_set_num_threads_local is not per-thread in pthreads builds: not used.

from microtensor.kernels._blas import pin_blas_threads, gemm_pointers

_pointers = gemm_pointers()
if CPU_RUNS_THIS_BUILD:     # use_gemm is compiled for this build's CPU (see kernels/_kernel_target.pxi)
    use_gemm(_pointers[0], _pointers[1])    # the BLAS microtensor.kernels._blas chose


def blas_thread_control_found():
    """True when the BLAS threads are pinned to one (else kernels use one thread)."""
    return pin_blas_threads()


cdef inline double _uniform(unsigned long long seed, unsigned long long counter) noexcept nogil:
    """A uniform number in [0, 1) from (seed, counter): the splitmix64 finaliser."""
    cdef unsigned long long z = seed + (counter + 1) * _GOLDEN
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    z = z ^ (z >> 31)
    return <double>(z >> 11) * (1.0 / 9007199254740992.0)


@cython.wraparound(False)
def attention_dropout_mask(real[:, :, ::1] keep, unsigned long long seed, double dropout_p):
    """(BH, Tq, Tk) keep = 1/(1-p) where the kernels keep P[bh, i, j], else 0
    (the same draws as attention_forward/backward; for tests and references)"""
    cdef Py_ssize_t bh, i, j, BH = keep.shape[0], Tq = keep.shape[1], Tk = keep.shape[2]
    cdef real scale = <real>(1.0 / (1.0 - dropout_p)) if dropout_p < 1 else 0
    with nogil:
        for bh in range(BH):
            for i in range(Tq):
                for j in range(Tk):
                    if _uniform(seed, (bh * Tq + i) * Tk + j) >= dropout_p:
                        keep[bh, i, j] = scale
                    else:
                        keep[bh, i, j] = 0


cdef inline void _scores_block(real* S, const real* qb, int ldq, const real* kb, int ldk,
                               const real* mrow0,
                               Py_ssize_t i0, Py_ssize_t nb, Py_ssize_t kmax, Py_ssize_t Tk,
                               int hs, real scale, bint has_mask, bint is_causal,
                               bint full) noexcept nogil:
    """S (nb, kmax) = scale * q[i0:i0+nb] @ k[:kmax]^T + mask[i0:i0+nb, :kmax], with the
    causally masked entries (j > i) set to -inf (full: -inf added, as torch, so that a
    NaN or +inf score there turns into NaN)."""
    cdef Py_ssize_t r, j, i, ncol
    cdef real* row
    gemm(c'N', c'T', <int>nb, <int>kmax, hs, scale, qb, ldq, kb, ldk, <real>0, S, <int>kmax)
    for r in range(nb):
        i = i0 + r
        row = S + r * kmax
        ncol = imin(i + 1, Tk) if is_causal else kmax
        if has_mask:
            for j in range(ncol):
                row[j] = row[j] + mrow0[i * Tk + j]
        if full:
            for j in range(ncol, kmax):
                row[j] = row[j] + <real>(-INFINITY)
        else:
            for j in range(ncol, kmax):
                row[j] = -INFINITY


cdef inline double _abs_bound(const real* x, Py_ssize_t n) noexcept nogil:
    """A bound on max |x[0:n]|: its 2-norm, sqrt(sum x^2) (row_dot's eight running sums,
    which vectorise). NaN or inf when x holds one, or when the sum overflows: then the
    caller takes the general path, which is only slower. (A running max and a running sum
    of x - x, the exact test, are chains of dependent scalar operations that no compiler
    may reorder without fast-math: they were a fifth of the forward at T = 64.)"""
    return sqrt(row_dot(x, x, n))


cdef inline double _abs_bound_rows(const real* x, Py_ssize_t rows, int cols, int ld) noexcept nogil:
    """_abs_bound over `rows` rows of `cols` elements, `ld` elements apart: the squares
    summed down the columns, then across them. Sixteen columns at a time: with the width
    fixed, the sixteen sums stay in vector registers (a head of a (B, T, 3C) projection
    is a band of 16 to 64 columns); the columns left over (cols % 16) are summed the same
    way at their own width."""
    cdef real a[16]
    cdef double total = 0
    cdef const real* row
    cdef Py_ssize_t r, j, c0 = 0, w
    if ld == cols or rows == 1:
        return _abs_bound(x, rows * cols)
    while c0 + 16 <= cols:
        for j in range(16):
            a[j] = 0
        for r in range(rows):
            row = x + r * ld + c0
            for j in range(16):
                a[j] = a[j] + row[j] * row[j]
        for j in range(16):
            total += a[j]
        c0 += 16
    if c0 < cols:
        w = cols - c0
        for j in range(w):
            a[j] = 0
        for r in range(rows):
            row = x + r * ld + c0
            for j in range(w):
                a[j] = a[j] + row[j] * row[j]
        for j in range(w):
            total += a[j]
    return sqrt(total)


cdef inline bint _causal_needs_full(const real* q, Py_ssize_t Tq, int ldq, const real* k,
                                    Py_ssize_t Tk, int ldk, const real* v, int ldv, int hs,
                                    double scale, const real* dout, int ldd,
                                    int hv) noexcept nogil:
    """True when a masked entry of this (b, h) could be NaN in torch's computation, which
    adds -inf to the masked scores and then multiplies by their zero probabilities: a
    score that is NaN or overflows (from q, k), 0 * inf in P @ v (an inf in v), and in
    backward (dout given) 0 * inf in P^T @ dout and in rowsum(P * dP), dP = dout @ v^T.
    Then every key is computed, as torch does (see top)."""
    cdef double limit = 0.25 * (FLT_MAX if real is float else DBL_MAX)
    cdef double sc = scale if scale >= 0 else -scale
    cdef double mv = _abs_bound_rows(v, Tk, hv, ldv), md
    if not (_abs_bound_rows(q, Tq, hs, ldq) * _abs_bound_rows(k, Tk, hs, ldk) * hs
            * (sc if sc > 1 else 1.0) < limit):
        return True
    if not (mv < limit):
        return True
    if dout != NULL:
        md = _abs_bound_rows(dout, Tq, hv, ldd)
        if not (md < limit and md * mv * hv < limit):
            return True
    return False


cdef inline bint _has_nan(const real* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        if x[j] != x[j]:
            return True
    return False


cdef _check_attention(str kernel, Py_ssize_t BH, Py_ssize_t Tq, Py_ssize_t Tk, Py_ssize_t hs,
                      Py_ssize_t hv, tuple q_batch, tuple k_shape, tuple v_shape,
                      tuple mask_shape, const long long[::1] mask_index, bint has_mask,
                      int block):
    """The shapes the kernels rely on (bounds checks are off inside)."""
    cdef Py_ssize_t bh
    if k_shape != q_batch + (Tk, hs) or v_shape[:3] != q_batch + (Tk,):
        raise ValueError(f"{kernel}: q {q_batch + (Tq, hs)}, k {k_shape} and v {v_shape} do not fit")
    if Tq < 1 or Tk < 1 or hs < 1 or hv < 1 or block < 1:
        raise ValueError(f"{kernel}: needs Tq, Tk, head sizes and block >= 1, got Tq={Tq}, "
                         f"Tk={Tk}, hs={hs}, hv={hv}, block={block}")
    if max(Tq, Tk, hs, hv, block) > 2147483647 // 2:
        raise ValueError(f"{kernel}: sizes beyond the BLAS integer range")
    if has_mask:
        if mask_shape[1:] != (Tq, Tk) or mask_index.shape[0] != BH:
            raise ValueError(f"{kernel}: mask {mask_shape} and mask_index ({mask_index.shape[0]},) "
                             f"do not fit (expected (NM, {Tq}, {Tk}) and ({BH},))")
        for bh in range(BH):
            if not 0 <= mask_index[bh] < mask_shape[0]:
                raise IndexError(f"{kernel}: mask_index {mask_index[bh]} is out of range for "
                                 f"{mask_shape[0]} mask slabs")


cdef int _row_step(str kernel, str name, Py_ssize_t* strides, Py_ssize_t rows,
                   Py_ssize_t cols, Py_ssize_t itemsize) except -1:
    """The distance between two rows of a (B1, B2, rows, cols) operand, in elements: the
    BLAS leading dimension. Each row must be contiguous, and the rows whole elements
    apart, in order and not overlapping (a gemm reads or writes `cols` elements from each
    row start); the batch dims may lie at any stride. A single row gets `cols`."""
    cdef Py_ssize_t step = strides[2]
    if cols > 1 and strides[3] != itemsize:
        raise ValueError(f"{kernel}: the last dim of {name} is not contiguous (its elements "
                         f"are {strides[3]} bytes apart; pass a copy with contiguous rows)")
    if rows <= 1:
        return <int>cols
    if step % itemsize or step // itemsize < cols or step // itemsize > 2147483647:
        raise ValueError(f"{kernel}: the rows of {name} are {step} bytes apart; they must be "
                         f"whole elements apart, at least its last dim ({cols}) and in order "
                         "(pass a contiguous copy)")
    return <int>(step // itemsize)


cdef int _qkv_steps(str kernel, const real[:, :, :, :] q, const real[:, :, :, :] k,
                    const real[:, :, :, :] v, int* ldq, int* ldk, int* ldv) except -1:
    """The row steps (BLAS leading dimensions) of q, k and v, each checked by _row_step."""
    ldq[0] = _row_step(kernel, "q", q.strides, q.shape[2], q.shape[3], sizeof(real))
    ldk[0] = _row_step(kernel, "k", k.strides, k.shape[2], k.shape[3], sizeof(real))
    ldv[0] = _row_step(kernel, "v", v.strides, v.shape[2], v.shape[3], sizeof(real))
    return 0


# Parallel threshold (BH * Tq * Tk * hs, the multiply-adds of q @ k^T): forward at one
# thread, float32, causal, 0.2-0.5 ns a unit on a 2-core Intel Xeon (Sapphire Rapids
# class; (16, 4, 32, 16) 0.42, (12, 4, 64, 32) 0.21): about 30-60 us at the bound.
cdef double _ATTENTION_PARALLEL_MIN = 1 << 17


@cython.wraparound(False)
def attention_forward(real[:, :, :, :] out, real[:, ::1] rowmax, real[:, ::1] logsum,
                      const real[:, :, :, :] q, const real[:, :, :, :] k,
                      const real[:, :, :, :] v,
                      const real[:, :, ::1] mask, const long long[::1] mask_index,
                      bint has_mask, bint is_causal, double scale, double dropout_p,
                      unsigned long long seed, int block, int num_threads):
    """q (B1, B2, Tq, hs), k (B1, B2, Tk, hs), v (B1, B2, Tk, hv) -> out (B1, B2, Tq, hv),
    rowmax and logsum (BH, Tq), BH = B1 B2 in C order:
    out = softmax(S) @ v,  S = scale * q @ k^T + mask,
    rowmax = max(S),  logsum = log(sum(exp(S - rowmax))) of each row

    NOTE: a row with every key masked (every score -inf) gets P = 0 (out = 0),
    rowmax = 0 and logsum = +inf, so that backward's exp((S - 0) - inf) is 0 there too
    (torch also returns 0 for such rows); a row holding a NaN score gets NaN (out = NaN,
    rowmax = logsum = NaN), as torch. A row masked by finfo.min is no such row: its
    scores are finite, and softmax spreads it over the keys as torch does."""
    cdef Py_ssize_t B1 = q.shape[0], B2 = q.shape[1], Tq = q.shape[2], Tk = k.shape[2]
    cdef Py_ssize_t BH = B1 * B2
    cdef int hs, hv, ldq, ldk, ldv, ldo
    cdef Py_ssize_t bh, b1, b2, blk, i0, nb, kmax, ncol, r, i, j, rows
    cdef real* scratch
    cdef real* S = NULL                                  # per-thread block of scores
    cdef double* sum_scratch
    cdef double* sums = NULL                             # per-thread: each row's sum
    cdef real* row
    cdef const real* mrow0
    cdef const real* qp
    cdef const real* kp
    cdef const real* vp
    cdef real* op
    cdef real mx, inv
    cdef real sc = <real>scale
    cdef real keep_scale = <real>(1.0 / (1.0 - dropout_p)) if dropout_p < 1 else 0
    cdef bint full
    _check_attention("attention_forward", BH, Tq, Tk, q.shape[3], v.shape[3], (B1, B2),
                     (k.shape[0], k.shape[1], k.shape[2], k.shape[3]),
                     (v.shape[0], v.shape[1], v.shape[2], v.shape[3]),
                     (mask.shape[0], mask.shape[1], mask.shape[2]), mask_index, has_mask, block)
    if ((out.shape[0], out.shape[1], out.shape[2], out.shape[3]) != (B1, B2, Tq, v.shape[3])
            or (rowmax.shape[0], rowmax.shape[1]) != (BH, Tq)
            or (logsum.shape[0], logsum.shape[1]) != (BH, Tq)):
        raise ValueError(f"attention_forward: out {(out.shape[0], out.shape[1], out.shape[2], out.shape[3])} / "
                         f"rowmax {(rowmax.shape[0], rowmax.shape[1])} / logsum "
                         f"{(logsum.shape[0], logsum.shape[1])} do not fit ({B1}, {B2}, {Tq}, {v.shape[3]})")
    hs, hv = <int>q.shape[3], <int>v.shape[3]
    _qkv_steps("attention_forward", q, k, v, &ldq, &ldk, &ldv)
    ldo = _row_step("attention_forward", "out", out.strides, Tq, hv, sizeof(real))
    num_threads = threads_for(<double>BH * Tq * Tk * hs, _ATTENTION_PARALLEL_MIN, num_threads)
    rows = imin(block, Tq)
    if not pin_blas_threads():      # scipy's BLAS threads out of our hands: one thread
        num_threads = 1
    scratch = <real*>scratch_alloc(rows * Tk * num_threads, sizeof(real))
    try:
        sum_scratch = <double*>scratch_alloc(rows * num_threads, sizeof(double))
    except MemoryError:
        free(scratch)
        raise
    try:
        with nogil, parallel(num_threads=num_threads):
            S = scratch + rows * Tk * threadid()
            sums = sum_scratch + rows * threadid()
            for bh in prange(BH, schedule="static"):
                b1 = bh // B2
                b2 = bh - b1 * B2
                qp = &q[b1, b2, 0, 0]
                kp = &k[b1, b2, 0, 0]
                vp = &v[b1, b2, 0, 0]
                op = &out[b1, b2, 0, 0]
                mrow0 = &mask[mask_index[bh], 0, 0] if has_mask else NULL
                full = is_causal and _causal_needs_full(qp, Tq, ldq, kp, Tk, ldk, vp, ldv, hs,
                                                        scale, NULL, 0, hv)
                for blk in range((Tq + block - 1) // block):
                    i0 = blk * block
                    nb = imin(block, Tq - i0)
                    kmax = imin(Tk, i0 + nb) if is_causal and not full else Tk
                    _scores_block(S, qp + i0 * ldq, ldq, kp, ldk, mrow0, i0, nb, kmax, Tk, hs,
                                  sc, has_mask, is_causal, full)
                    # softmax of each row, in place, in three passes over the block's rows
                    # (each row's arithmetic as in one pass: the same bits): a row's max,
                    # sum and log are chains of dependent steps, short rows (T = 32) are
                    # mostly those chains, and rows taken one pass at a time overlap them
                    for r in range(nb):                       # 1. each row's max
                        i = i0 + r
                        # keys row i may see (those beyond hold -inf, or NaN when full)
                        ncol = imin(i + 1, Tk) if is_causal and not full else kmax
                        rowmax[bh, i] = row_max(S + r * kmax, ncol)
                    for r in range(nb):                       # 2. exp(S - max) and its sum
                        i = i0 + r
                        row = S + r * kmax
                        ncol = imin(i + 1, Tk) if is_causal and not full else kmax
                        mx = rowmax[bh, i]
                        if mx == -INFINITY:                   # all masked, or NaN
                            if _has_nan(row, ncol):
                                for j in range(kmax):
                                    row[j] = NAN
                                rowmax[bh, i] = NAN
                                logsum[bh, i] = NAN
                            else:
                                for j in range(kmax):
                                    row[j] = 0
                                rowmax[bh, i] = 0
                                logsum[bh, i] = INFINITY
                            sums[r] = -1                      # done (a sum is >= 1 or NaN)
                            continue
                        sums[r] = row_exp_sum(row, row, ncol, mx)
                    for r in range(nb):                       # 3. divided by the sum
                        if sums[r] < 0:
                            continue
                        i = i0 + r
                        row = S + r * kmax
                        ncol = imin(i + 1, Tk) if is_causal and not full else kmax
                        for j in range(ncol, kmax):
                            row[j] = 0
                        inv = <real>(1.0 / sums[r])
                        for j in range(ncol):
                            row[j] = row[j] * inv
                        logsum[bh, i] = <real>log(sums[r])
                        if dropout_p > 0:
                            for j in range(ncol):
                                if _uniform(seed, (bh * Tq + i) * Tk + j) >= dropout_p:
                                    row[j] = row[j] * keep_scale
                                else:
                                    row[j] = 0
                    # out[i0:i0+nb] = P (nb, kmax) @ v[:kmax] (kmax, hv)
                    gemm(c'N', c'N', <int>nb, hv, <int>kmax, <real>1, S, <int>kmax, vp, ldv,
                         <real>0, op + i0 * ldo, ldo)
    finally:
        free(scratch)
        free(sum_scratch)


@cython.wraparound(False)
def attention_backward(real[:, :, :, :] dq, real[:, :, :, :] dk, real[:, :, :, :] dv,
                       const real[:, :, :, :] dout,
                       const real[:, :, :, :] q, const real[:, :, :, :] k,
                       const real[:, :, :, :] v,
                       const real[:, ::1] rowmax, const real[:, ::1] logsum,
                       const real[:, :, ::1] mask, const long long[::1] mask_index,
                       bint has_mask, bint is_causal, double scale, double dropout_p,
                       unsigned long long seed, int block, int num_threads,
                       real[:, :, ::1] dmask=None):
    """dout (B1, B2, Tq, hv) -> dq (B1, B2, Tq, hs) written, dk (B1, B2, Tk, hs) and dv
    (B1, B2, Tk, hv) accumulated (+=; the caller zeroes them), and, when given, dmask
    (BH, Tq, Tk) written (the gradient of the additive mask, dS before the scale); every
    (B1, B2, T, d) operand at any row and batch strides, as in attention_forward:
    P = exp((S - rowmax) - logsum) (recomputed),  Pd = P * dropout_keep,  dv += Pd^T @ dout,
    dP = (dout @ v^T) * dropout_keep,  dS = P * (dP - rowsum(P * dP)),
    dq = scale * dS @ k,  dk += scale * dS^T @ q,  dmask = dS"""
    cdef Py_ssize_t B1 = q.shape[0], B2 = q.shape[1], Tq = q.shape[2], Tk = k.shape[2]
    cdef Py_ssize_t BH = B1 * B2
    cdef int hs, hv, ldq, ldk, ldv, ldd, lddq, lddk, lddv
    cdef Py_ssize_t bh, b1, b2, blk, i0, nb, kmax, r, i, j, rows, per_thread
    cdef bint full, want_dmask = dmask is not None
    cdef real* dmrow
    cdef real ds
    cdef real* scratch
    cdef real* P = NULL                                  # per-thread blocks: P, dP -> dS,
    cdef real* dP = NULL                                 # and P after dropout
    cdef real* Pd = NULL
    cdef real* prow
    cdef real* dprow
    cdef real* pdrow
    cdef const real* mrow0
    cdef const real* qp
    cdef const real* kp
    cdef const real* vp
    cdef const real* gp
    cdef real* dqp
    cdef real* dkp
    cdef real* dvp
    cdef real m, l, D
    cdef real sc = <real>scale
    cdef real keep_scale = <real>(1.0 / (1.0 - dropout_p)) if dropout_p < 1 else 0
    _check_attention("attention_backward", BH, Tq, Tk, q.shape[3], v.shape[3], (B1, B2),
                     (k.shape[0], k.shape[1], k.shape[2], k.shape[3]),
                     (v.shape[0], v.shape[1], v.shape[2], v.shape[3]),
                     (mask.shape[0], mask.shape[1], mask.shape[2]), mask_index, has_mask, block)
    if ((dq.shape[0], dq.shape[1], dq.shape[2], dq.shape[3]) != (q.shape[0], q.shape[1], q.shape[2], q.shape[3])
            or (dk.shape[0], dk.shape[1], dk.shape[2], dk.shape[3]) != (k.shape[0], k.shape[1], k.shape[2], k.shape[3])
            or (dv.shape[0], dv.shape[1], dv.shape[2], dv.shape[3]) != (v.shape[0], v.shape[1], v.shape[2], v.shape[3])
            or (dout.shape[0], dout.shape[1], dout.shape[2], dout.shape[3]) != (B1, B2, Tq, v.shape[3])
            or (rowmax.shape[0], rowmax.shape[1]) != (BH, Tq)
            or (logsum.shape[0], logsum.shape[1]) != (BH, Tq)):
        raise ValueError("attention_backward: dq, dk, dv, dout, rowmax or logsum do not fit q, k, v")
    if want_dmask and (dmask.shape[0], dmask.shape[1], dmask.shape[2]) != (BH, Tq, Tk):
        raise ValueError(f"attention_backward: dmask must be ({BH}, {Tq}, {Tk}), got "
                         f"{(dmask.shape[0], dmask.shape[1], dmask.shape[2])}")
    hs, hv = <int>q.shape[3], <int>v.shape[3]
    _qkv_steps("attention_backward", q, k, v, &ldq, &ldk, &ldv)
    ldd = _row_step("attention_backward", "dout", dout.strides, Tq, hv, sizeof(real))
    lddq = _row_step("attention_backward", "dq", dq.strides, Tq, hs, sizeof(real))
    lddk = _row_step("attention_backward", "dk", dk.strides, Tk, hs, sizeof(real))
    lddv = _row_step("attention_backward", "dv", dv.strides, Tk, hv, sizeof(real))
    num_threads = threads_for(<double>BH * Tq * Tk * hs, _ATTENTION_PARALLEL_MIN, num_threads)
    rows = imin(block, Tq)
    per_thread = rows * Tk * (3 if dropout_p > 0 else 2)
    if not pin_blas_threads():      # scipy's BLAS threads out of our hands: one thread
        num_threads = 1
    scratch = <real*>scratch_alloc(per_thread * num_threads, sizeof(real))
    try:
        with nogil, parallel(num_threads=num_threads):
            P = scratch + per_thread * threadid()
            dP = P + rows * Tk
            Pd = dP + rows * Tk if dropout_p > 0 else P
            for bh in prange(BH, schedule="static"):
                b1 = bh // B2
                b2 = bh - b1 * B2
                qp = &q[b1, b2, 0, 0]
                kp = &k[b1, b2, 0, 0]
                vp = &v[b1, b2, 0, 0]
                gp = &dout[b1, b2, 0, 0]
                dqp = &dq[b1, b2, 0, 0]
                dkp = &dk[b1, b2, 0, 0]
                dvp = &dv[b1, b2, 0, 0]
                mrow0 = &mask[mask_index[bh], 0, 0] if has_mask else NULL
                full = is_causal and _causal_needs_full(qp, Tq, ldq, kp, Tk, ldk, vp, ldv, hs,
                                                        scale, gp, ldd, hv)
                for blk in range((Tq + block - 1) // block):
                    i0 = blk * block
                    nb = imin(block, Tq - i0)
                    kmax = imin(Tk, i0 + nb) if is_causal and not full else Tk
                    _scores_block(P, qp + i0 * ldq, ldq, kp, ldk, mrow0, i0, nb, kmax, Tk, hs,
                                  sc, has_mask, is_causal, full)
                    for r in range(nb):                       # P = exp((S - m) - s), in place
                        m = rowmax[bh, i0 + r]
                        l = logsum[bh, i0 + r]
                        prow = P + r * kmax
                        for j in range(kmax):
                            prow[j] = softmax_at(prow[j], m, l)
                    if dropout_p > 0:
                        for r in range(nb):
                            i = i0 + r
                            prow = P + r * kmax
                            pdrow = Pd + r * kmax
                            for j in range(kmax):
                                if _uniform(seed, (bh * Tq + i) * Tk + j) >= dropout_p:
                                    pdrow[j] = prow[j] * keep_scale
                                else:
                                    pdrow[j] = 0
                    # dv[:kmax] += Pd^T (kmax, nb) @ dout[i0:i0+nb] (nb, hv)
                    gemm(c'T', c'N', <int>kmax, hv, <int>nb, <real>1, Pd, <int>kmax,
                         gp + i0 * ldd, ldd, <real>1, dvp, lddv)
                    # dP (nb, kmax) = dout[i0:i0+nb] @ v[:kmax]^T
                    gemm(c'N', c'T', <int>nb, <int>kmax, hv, <real>1, gp + i0 * ldd, ldd,
                         vp, ldv, <real>0, dP, <int>kmax)
                    for r in range(nb):                       # dS = scale * P * (dP - D), in place
                        i = i0 + r
                        prow = P + r * kmax
                        dprow = dP + r * kmax
                        if dropout_p > 0:
                            for j in range(kmax):
                                if _uniform(seed, (bh * Tq + i) * Tk + j) >= dropout_p:
                                    dprow[j] = dprow[j] * keep_scale
                                else:
                                    dprow[j] = 0
                        D = <real>row_dot(prow, dprow, kmax)
                        if want_dmask:
                            dmrow = &dmask[bh, i, 0]
                            for j in range(kmax):
                                ds = prow[j] * (dprow[j] - D)
                                dmrow[j] = ds
                                dprow[j] = sc * ds
                            for j in range(kmax, Tk):
                                dmrow[j] = 0
                        else:
                            for j in range(kmax):
                                dprow[j] = sc * prow[j] * (dprow[j] - D)
                    # dq[i0:i0+nb] = dS (nb, kmax) @ k[:kmax] (kmax, hs)
                    gemm(c'N', c'N', <int>nb, hs, <int>kmax, <real>1, dP, <int>kmax, kp, ldk,
                         <real>0, dqp + i0 * lddq, lddq)
                    # dk[:kmax] += dS^T (kmax, nb) @ q[i0:i0+nb] (nb, hs)
                    gemm(c'T', c'N', <int>kmax, hs, <int>nb, <real>1, dP, <int>kmax,
                         qp + i0 * ldq, ldq, <real>1, dkp, lddk)
    finally:
        free(scratch)