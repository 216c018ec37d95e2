# Declarations shared by microtensor's Cython extensions (cimport, never import):
#
#   from microtensor.kernels._common cimport real, gemm, bounded_threads, threads_for
#
# Everything here is a type or an inline function, so there is no _common module to
# build: each extension that cimports it compiles its own copy of what it uses.

from scipy.linalg.cython_blas cimport sgemm, dgemm

# The float types of every kernel: float32 and float64.
ctypedef fused real:
    float
    double


cdef inline int bounded_threads(long n) noexcept nogil:
    """A thread count in [1, 256]: n clamped (below 1 gives 1). More threads than 256 is
    a caller's mistake, not a request."""
    if n < 1:
        return 1
    return <int>n if n < 256 else 256


# ---- when a kernel goes parallel -------------------------------------------------------
#
# Opening and closing a parallel region costs about 6 us on a quiet 2-core Intel Xeon
# (Sapphire Rapids class, KVM guest; OMP_WAIT_POLICY=PASSIVE: the worker is woken
# from sleep): the 2-thread minus the 1-thread time of a small kernel, best of many runs
# (benchmarks/bench_thresholds.py). On another such VM a wake-up took about 100 us, and
# a worker still spinning from the last region (microtensor's GOMP_SPINCOUNT=10000,
# runtime/_omp_env.py) took about 3. On a busy machine the same region waits for a core
# someone else holds. So a kernel goes parallel only when one thread would spend about
# 50 us in it (eight wake-ups' worth): each kernel names its threshold, a work size in
# its own units (elements, multiply-adds), beside it, with the per-unit cost measured at
# one thread, and asks threads_for() for its team.
#
# MT_PARALLEL_MIN_SCALE multiplies every threshold at compile time (setup.py passes
# MICROTENSOR_PARALLEL_MIN_SCALE; 1 by default): 0 turns them off, which is how
# bench_thresholds.py measures below them.
cdef extern from *:
    """
    #ifndef MT_PARALLEL_MIN_SCALE
    #define MT_PARALLEL_MIN_SCALE 1
    #endif
    """
    double MT_PARALLEL_MIN_SCALE


# ---- the team: the threads a parallel region takes now ---------------------------------
#
# num_threads (mt.set_num_threads) is the *configured* count: it fixes how a kernel splits
# its work (the gemm's row blocks, the layer norm's partial sums, clipping's partial
# sums), so a given seed gives the same bits whatever runs it. The *team* is how many
# threads run those pieces now: the configured count, or fewer while other processes hold
# cores (a waiting thread whose partner lost its core is what made 2 threads slower than
# 1 on a busy machine). microtensor.kernels._blas measures that (mt_team, "the team" there) and
# every extension reaches it through this pointer, set at import by use_team; until then
# the team is the configured count.
cdef extern from *:
    """
    typedef int (*mt_team_ptr)(int);
    static mt_team_ptr mt_team_fn = 0;
    """
    ctypedef int (*mt_team_ptr)(int) noexcept nogil
    mt_team_ptr mt_team_fn


cdef inline void use_team(size_t f) noexcept nogil:
    """Point this extension's team at microtensor.kernels._blas's (its address, team_pointer())."""
    global mt_team_fn
    mt_team_fn = <mt_team_ptr>f


cdef inline int team_of(long num_threads) noexcept nogil:
    """The threads that run a region split into num_threads pieces: num_threads clamped to
    [1, 256], fewer while other processes hold cores. Never changes a result: only the
    split (num_threads) does."""
    cdef int n = bounded_threads(num_threads)
    if n > 1 and mt_team_fn != NULL:
        return mt_team_fn(n)
    return n


cdef inline int threads_for(double work, double min_work, long num_threads) noexcept nogil:
    """The team for `work` units when `min_work` is the kernel's threshold: one thread
    below it, else team_of(num_threads). Only for kernels whose pieces do not depend on
    the team (rows, elements, (b, h) pairs, a split the caller fixed)."""
    if work < min_work * MT_PARALLEL_MIN_SCALE:
        return 1
    return team_of(num_threads)


# ---- the one gemm ----------------------------------------------------------------------
#
# A Fortran sgemm/dgemm reached through a pointer, so that the library is chosen once at
# import (microtensor/runtime/_blas_choice.py: scipy's OpenBLAS, or oneMKL on Intel). The
# pointers are C statics: each extension that cimports gemm holds its own pair, set by
# `use_gemm` when the module is imported (from microtensor.kernels._blas.gemm_pointers()); until
# then, and when the choice is scipy's, they point at scipy's cython_blas.
ctypedef void (*sgemm_ptr)(char*, char*, int*, int*, int*, float*, float*, int*,
                           float*, int*, float*, float*, int*) noexcept nogil
ctypedef void (*dgemm_ptr)(char*, char*, int*, int*, int*, double*, double*, int*,
                           double*, int*, double*, double*, int*) noexcept nogil

cdef extern from *:
    """
    static void* mt_sgemm = 0;
    static void* mt_dgemm = 0;
    """
    void* mt_sgemm
    void* mt_dgemm


cdef inline void use_gemm(size_t s, size_t d) noexcept nogil:
    """Point this extension's gemm at sgemm/dgemm (addresses; 0 = scipy's cython_blas)."""
    global mt_sgemm, mt_dgemm
    mt_sgemm = <void*>s if s else <void*>sgemm
    mt_dgemm = <void*>d if d else <void*>dgemm


cdef inline void gemm(char transa, char transb, int M, int N, int K, real alpha,
                      const real* A, int lda, const real* B, int ldb, real beta,
                      real* C, int ldc) noexcept nogil:
    """Row-major C (M, N) = alpha * op(A) @ op(B) + beta * C;  op(A) (M, K), op(B) (K, N).

    transa = 'N' when A is stored (M, K) row-major, 'T' when (K, M); transb likewise for
    B, (K, N) or (N, K); lda, ldb, ldc are the row lengths of the row-major storages.
    The BLAS (Fortran, column-major; callable without the GIL) reads a row-major matrix
    as its transpose, so this asks for C^T = op(B)^T op(A)^T: the operands swapped, the
    flags kept."""
    if mt_sgemm == NULL:        # an extension that never called use_gemm: scipy's
        use_gemm(0, 0)
    if real is float:
        (<sgemm_ptr>mt_sgemm)(&transb, &transa, &N, &M, &K, &alpha, <float*>B, &ldb,
                              <float*>A, &lda, &beta, C, &ldc)
    else:
        (<dgemm_ptr>mt_dgemm)(&transb, &transa, &N, &M, &K, &alpha, <double*>B, &ldb,
                              <double*>A, &lda, &beta, C, &ldc)
