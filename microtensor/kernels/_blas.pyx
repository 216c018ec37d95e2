# cython: embedsignature=True, wraparound=True
"""Matrix products for the hot path: BLAS gemm with transposes passed as flags, split
over microtensor's OpenMP threads.

Why not numpy's `@`? numpy's OpenBLAS runs its own thread pool, and microtensor's
kernels run OpenMP's. On a 2-core machine the two pools take turns spinning on the
same cores, and a small model's step got 10-100x slower with 2 threads than with 1.
So every matmul of the engine goes through here instead: one thread pool (OpenMP),
each thread calling a single-threaded gemm on its own block of output rows. Which
library's gemm is chosen once, at import (microtensor/runtime/_blas_choice.py): oneMKL's
sequential layer on an Intel CPU when the `mkl` wheel is there, else scipy's OpenBLAS
through cython_blas (callable without the GIL), pinned to one thread. Both are separate
libraries from numpy's: numpy's `@` is left untouched.

Row-major arrays meet column-major BLAS through one identity: a row-major (r, c)
array is, read column-major, its transpose (c, r). So row-major C = A @ B is computed
as column-major C^T = B^T @ A^T, and a transposed view (W.T) is passed as the
untransposed array plus a 'T' flag: no copy. That swap lives in one place, the `gemm`
of microtensor/kernels/_common.pxd (cimported here as `rowmajor_gemm`, this module's `gemm` being
the Python entry), which the attention kernels call too.
"""
import numpy as np
from cython.parallel cimport prange
cimport cython
from microtensor.kernels._common cimport (real, bounded_threads, threads_for, team_of, use_team,
                                  MT_PARALLEL_MIN_SCALE, gemm as rowmajor_gemm, use_gemm)
from microtensor.runtime import _blas_choice

# Parallel threshold (multiply-adds, M * N * K; see threads_for in kernels/_common.pxd): sgemm
# at one thread took 0.020-0.034 ns a multiply-add on a 2-core Intel Xeon (Sapphire
# Rapids class; (64, 64) @ (64, 64) 9 us, (64, 256) @ (256, 256) 96 us, best of many
# runs): about 50 us at the bound. (It was 1 << 17, about 4 us: a small model's every
# matmul went parallel.)
cdef double _PARALLEL_MIN_FLOPS = 1 << 21


# ---- the team: how many threads run a parallel region now ---------------------------
#
# The configured count (mt.set_num_threads) splits the work; the team is the threads that
# run the pieces (see team_of in kernels/_common.pxd). It is the configured count on a quiet
# machine, and shrinks while other processes keep cores busy: every 0.25 s (checked when a
# kernel opens a parallel region, no thread of its own) the team reads how busy the CPUs
# this process may run on were (/proc/stat: user, system, irq, softirq and steal time,
# not `nice` time, which yields to us), takes away this process's own CPU time
# (CLOCK_PROCESS_CPUTIME_ID), and so knows the cores other processes held. The team is
# the cores left, rounded to the nearest: fewer at once, more only after two windows agree.
# Where /proc/stat cannot be read (not Linux) the team is the configured count.
cdef extern from *:
    """
    #include <sched.h>
    #include <stdio.h>
    #include <time.h>
    #include <unistd.h>

    /* seconds between two readings of the load. /proc/stat counts in 10 ms units per CPU,
       so a reading over 0.1 s was off by up to 0.3 cores on an idle 2-core machine (the
       team dropped to one thread with nobody else running); over 0.25 s, by under 0.1 */
    #define MT_TEAM_WINDOW 0.25
    #define MT_TEAM_MAX_CPU 1024

    typedef struct {
        int adaptive;      /* 1: follow the load; 0: the team is the configured count */
        int forced;        /* > 0: the team is at most this (tests, benchmarks) */
        int cap;           /* the team the last windows allow */
        int rising;        /* windows in a row that allowed more than cap */
        int lock;          /* one thread reads the load at a time */
        int ready;         /* a first reading exists */
        int cpus;          /* CPUs of this process's affinity mask seen in /proc/stat */
        double wall, self, busy, others, hz;
        unsigned char allowed[MT_TEAM_MAX_CPU];
    } mt_team_t;

    static mt_team_t mt_team_state = {1, 0, 256, 0, 0, 0, 0, 0, 0, 0, 0, 100};

    static double mt_clock(clockid_t which) {
        struct timespec t;
        clock_gettime(which, &t);
        return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
    }

    /* The CPUs this process may run on, and the clock tick of /proc/stat. */
    static void mt_team_init(void) {
        cpu_set_t set;
        int cpu;
        mt_team_t* s = &mt_team_state;
        CPU_ZERO(&set);
        if (sched_getaffinity(0, sizeof set, &set) == 0) {
            for (cpu = 0; cpu < MT_TEAM_MAX_CPU && cpu < CPU_SETSIZE; cpu++)
                s->allowed[cpu] = CPU_ISSET(cpu, &set) ? 1 : 0;
        } else {
            for (cpu = 0; cpu < MT_TEAM_MAX_CPU; cpu++) s->allowed[cpu] = 1;
        }
        s->hz = (double)sysconf(_SC_CLK_TCK);
        if (s->hz <= 0) s->hz = 100;
    }

    static void mt_team_sample(double now);

    /* The first reading, at import: the first parallel kernel 0.25 s later already knows
       the load (else its team would be the configured count until the second window). */
    static void mt_team_start(void) {
        mt_team_init();
        if (mt_team_state.adaptive) mt_team_sample(mt_clock(CLOCK_MONOTONIC));
    }

    /* Busy ticks of the allowed CPUs (user + system + irq + softirq + steal) since boot,
       and how many allowed CPUs /proc/stat lists; -1 when it cannot be read. */
    static int mt_busy_ticks(double* busy) {
        char line[256];
        int seen = 0, cpu;
        unsigned long long user, nice, sys, idle, iowait, irq, softirq, steal;
        FILE* f = fopen("/proc/stat", "r");
        if (f == NULL) return -1;
        *busy = 0;
        while (fgets(line, sizeof line, f) != NULL) {
            if (line[0] != 'c' || line[1] != 'p' || line[2] != 'u') break;  /* past the CPUs */
            if (line[3] < '0' || line[3] > '9') continue;                   /* the total */
            steal = 0;
            if (sscanf(line + 3, "%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &user,
                       &nice, &sys, &idle, &iowait, &irq, &softirq, &steal) < 8) continue;
            if (cpu < 0 || cpu >= MT_TEAM_MAX_CPU || !mt_team_state.allowed[cpu]) continue;
            *busy += (double)(user + sys + irq + softirq + steal);
            seen++;
        }
        fclose(f);
        return seen > 0 ? seen : -1;
    }

    /* One window: how many cores other processes held, and the team that leaves. */
    static void mt_team_sample(double now) {
        mt_team_t* s = &mt_team_state;
        double busy, self, dt, others;
        int fit, cpus = mt_busy_ticks(&busy);
        if (cpus < 0) {                       /* no /proc/stat: no load to follow */
            s->adaptive = 0;
            s->cap = 256;
            return;
        }
        self = mt_clock(CLOCK_PROCESS_CPUTIME_ID);
        dt = now - s->wall;
        if (s->ready && dt > 0) {
            others = ((busy - s->busy) / s->hz - (self - s->self)) / dt;
            s->others = others > 0 ? others : 0;
            fit = (int)((double)cpus - s->others + 0.5);
            if (fit < 1) fit = 1;
            if (fit < s->cap) {
                s->cap = fit;
                s->rising = 0;
            } else if (fit > s->cap) {
                if (++s->rising >= 2) { s->cap = fit; s->rising = 0; }
            } else {
                s->rising = 0;
            }
        }
        s->cpus = cpus;
        s->wall = now;
        s->self = self;
        s->busy = busy;
        s->ready = 1;
    }

    /* Set once a region ran with more than one thread: libgomp's worker threads exist
       from then on, and a child made by fork() does not have them (see _after_fork). */
    static int mt_team_went_parallel = 0;

    /* The team for a region split into n pieces: n, or fewer while the load says so. */
    static int mt_team(int n) {
        mt_team_t* s = &mt_team_state;
        double now;
        int cap;
        if (n <= 1) return 1;
        if (s->forced > 0) {
            cap = s->forced;
        } else if (!s->adaptive) {
            cap = n;
        } else {
            now = mt_clock(CLOCK_MONOTONIC);
            if (now - s->wall >= MT_TEAM_WINDOW
                    && __atomic_exchange_n(&s->lock, 1, __ATOMIC_ACQUIRE) == 0) {
                if (now - s->wall >= MT_TEAM_WINDOW) mt_team_sample(now);
                __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE);
            }
            cap = s->cap;
        }
        if (n < cap) cap = n;
        if (cap > 1) mt_team_went_parallel = 1;
        return cap;
    }
    """
    ctypedef struct mt_team_t:
        int adaptive, forced, cap, cpus, ready
        double others
    mt_team_t mt_team_state
    int mt_team_went_parallel
    void mt_team_start() noexcept nogil
    int mt_team(int n) noexcept nogil


from microtensor.runtime._variables import switch as _switch


# MICROTENSOR_ADAPTIVE_THREADS=0 (or off, false, no): always run the configured count,
# whatever the load; 1 (on, true, yes, auto, unset) follows it; another value warns
def _adaptive_setting(environ):
    return int(_switch(environ, "MICROTENSOR_ADAPTIVE_THREADS"))


import os as _os
mt_team_state.adaptive = _adaptive_setting(_os.environ)
mt_team_start()
use_team(<size_t>&mt_team)


def _after_fork():
    """In a child made by os.fork(): libgomp's worker threads stayed behind in the parent,
    and the child's first region with more than one thread would wait for them forever.
    So a child of a parent that ran such a region runs every kernel on one thread (the
    same split, so the same bits: only the team shrinks); its set_num_threads still sets
    the split. A child of a parent that never went parallel keeps its threads."""
    if mt_team_went_parallel:
        mt_team_state.forced = 1


def forked_child_runs_alone():
    """True in a forked child whose kernels run on one thread (see _after_fork)."""
    return mt_team_went_parallel == 1 and mt_team_state.forced == 1


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_after_fork)


def team_pointer():
    """The address of the team function, for the other extensions (use_team at import)."""
    return <size_t>&mt_team


def team(int n):
    """How many threads run a region split into n pieces now (n on a quiet machine)."""
    if n < 1:
        raise ValueError(f"team: the number of pieces must be at least 1, got {n}")
    return mt_team(n)


def set_team(adaptive=None, limit=None):
    """adaptive: follow the load (True, the default) or always run the configured count
    (False). limit: run at most this many threads (a test of the fixed split, or a
    benchmark), 0 or None to lift it. Returns team_info() as it was before."""
    before = team_info()
    if adaptive is not None:
        mt_team_state.adaptive = 1 if adaptive else 0
        mt_team_state.cap = 256
        mt_team_state.ready = 0
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"set_team: limit must be an int >= 0, got {limit!r}")
        mt_team_state.forced = limit
    return before


def team_info():
    """The team's state: adaptive, limit, cap (the threads the load allows now, 256 when
    it allows any), cpus (this process's CPUs) and others (cores other processes held in
    the last window)."""
    return {"adaptive": bool(mt_team_state.adaptive), "limit": mt_team_state.forced,
            "cap": mt_team_state.cap, "cpus": mt_team_state.cpus,
            "others": mt_team_state.others}


# ---- scipy's OpenBLAS: one thread, once ---------------------------------------------

_pinned = None


def pin_blas_threads():
    """Set the OpenBLAS behind scipy's cython_blas to one thread (microtensor splits the
    work itself). Returns True when that library was found and pinned."""
    global _pinned
    if _pinned is not None:
        return _pinned
    import scipy.linalg.cython_blas  # noqa: F401  (loads the library, so it can be found)
    from threadpoolctl import ThreadpoolController
    # numpy's OpenBLAS is another library (numpy's own `@`): left alone
    libs = [lib for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers
            if "numpy" not in lib.filepath]
    for lib in libs:
        lib.set_num_threads(1)
    _pinned = bool(libs)
    return _pinned


# ---- the kernel ---------------------------------------------------------------------

cdef inline Py_ssize_t _column_chunk(Py_ssize_t N, int nthreads) noexcept nogil:
    """The width of each block when N columns are split for nthreads: a multiple of 16
    (whole vector tiles of the gemm's kernel), and all N columns in one block when there
    are fewer than 16 per thread."""
    cdef Py_ssize_t n = nthreads if N >= 16 * nthreads else 1
    return ((N + n - 1) // n + 15) // 16 * 16


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _gemm_rows(char ta, char tb, int M, int N, int K, real alpha,
                     real* a, int lda, real* b, int ldb, real beta,
                     real* c, int nthreads, const real* bias=NULL) noexcept nogil:
    """Row-major C (M, N) = alpha * op(A) @ op(B) + beta * C (+ bias on every row, when
    given: each block adds it to the part of C it just wrote, while that is in cache),
    split into nthreads blocks of C's rows (M >= N) or of its columns (M < N), run by the
    team.

    a: A's storage; ta = 'N' when it is (M, K) row-major, 'T' when it is (K, M).
    b: B's storage; tb = 'N' when it is (K, N) row-major, 'T' when it is (N, K).

    Each block's gemm packs the operand it shares with the others again, so the split
    runs along C's longer side: splitting rows repacks B (K x N), splitting columns
    repacks A (M x K), and the smaller is repacked. That matters most when the team is
    smaller than the split (a busy machine: one thread runs every block)."""
    cdef int chunk, i, r0, rows, nchunks
    cdef Py_ssize_t r, j
    cdef real* crow
    cdef char fa, fb
    cdef real* a_block
    cdef real* b_block
    # the flags as BLAS reads them, 'N' or 'T' (the operand swap is rowmajor_gemm's)
    fb = b'N' if tb == b'N' else b'T'
    fa = b'N' if ta == b'N' else b'T'
    # NOTE: the split follows the configured count and the shapes, the team only runs it:
    # OpenBLAS picks its kernel by block shape, so another split could change the bits
    if M >= N:
        nchunks = nthreads if M >= nthreads else 1
        chunk = (M + nchunks - 1) // nchunks
        for i in prange(nchunks, nogil=True, num_threads=team_of(nchunks), schedule="static"):
            r0 = i * chunk
            rows = M - r0 if M - r0 < chunk else chunk
            if rows > 0:
                # rows r0.. of op(A): row offset in (M, K) storage, column offset in (K, M)
                a_block = a + (<Py_ssize_t>r0 * lda if ta == b'N' else r0)
                rowmajor_gemm(fa, fb, rows, N, K, alpha, a_block, lda, b, ldb,
                              beta, c + <Py_ssize_t>r0 * N, N)
                if bias != NULL:
                    for r in range(r0, r0 + rows):
                        crow = c + r * N
                        for j in range(N):
                            crow[j] = crow[j] + bias[j]
    else:
        chunk = <int>_column_chunk(N, nthreads)
        nchunks = (N + chunk - 1) // chunk
        for i in prange(nchunks, nogil=True, num_threads=team_of(nchunks), schedule="static"):
            r0 = i * chunk
            rows = N - r0 if N - r0 < chunk else chunk          # here: columns
            # columns r0.. of op(B): column offset in (K, N) storage, row offset in (N, K)
            b_block = b + (r0 if tb == b'N' else <Py_ssize_t>r0 * ldb)
            rowmajor_gemm(fa, fb, M, rows, K, alpha, a, lda, b_block, ldb,
                          beta, c + r0, N)
            if bias != NULL:
                for r in range(M):
                    crow = c + r * N
                    for j in range(r0, r0 + rows):
                        crow[j] = crow[j] + bias[j]


cdef tuple _gemm_storage(object x):
    """(C-contiguous storage, transposed?) for a 2-D array: a transposed view of a
    contiguous array is passed as that array plus a 'T' flag, anything else is copied."""
    if x.flags.c_contiguous:
        return x, False
    if x.flags.f_contiguous:
        return x.T, True
    return np.ascontiguousarray(x), False


def gemm(a, b, out=None, double beta=0.0, int num_threads=1, bias=None):
    """out = a @ b (+ beta * out) (+ bias on every row) for 2-D float32/float64 arrays of
    one dtype.

    a (M, K) and b (K, N) may be contiguous or transposed views of contiguous arrays;
    `out` (M, N), when given, must be C-contiguous; `bias`, when given, a 1-D array of N
    of the same dtype (a linear layer's bias, added by each block as it finishes: no
    second pass over out)."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        raise TypeError(f"gemm takes numpy arrays, got {type(a).__name__} and {type(b).__name__}")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"gemm takes 2-D arrays, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: shapes {a.shape} and {b.shape} do not multiply")
    if a.dtype != b.dtype or a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8):
        raise TypeError(f"gemm takes float32 or float64 arrays of one dtype, got {a.dtype} and {b.dtype}")
    cdef int M = a.shape[0], K = a.shape[1], N = b.shape[1]
    if out is None:
        out = np.empty((M, N), dtype=a.dtype)
        beta = 0.0
    elif (not isinstance(out, np.ndarray) or out.shape != (M, N) or out.dtype != a.dtype
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"gemm: out must be a writeable C-contiguous {a.dtype} array of shape "
                         f"{(M, N)}")
    if bias is not None:
        if (not isinstance(bias, np.ndarray) or bias.ndim != 1 or bias.shape[0] != N
                or bias.dtype != a.dtype):
            raise ValueError(f"gemm: bias must be a 1-D {a.dtype} array of {N}, got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} "
                             f"{getattr(bias, 'shape', '')}")
        bias = np.ascontiguousarray(bias)
    if M == 0 or N == 0:
        return out
    if K == 0:
        if beta == 0.0:
            out[...] = 0
        else:
            out *= beta
        if bias is not None:
            out += bias
        return out
    a_st, ta = _gemm_storage(a)
    b_st, tb = _gemm_storage(b)
    # leading dimensions of the row-major storages
    cdef int lda = a_st.shape[1], ldb = b_st.shape[1]
    # NOTE: not bounded_threads: the row split can change float32 bits (OpenBLAS picks its
    # kernel by block shape), so a count above that bound's 256 splits as it always did
    cdef int nthreads = num_threads
    if <double>M * N * K < _PARALLEL_MIN_FLOPS * MT_PARALLEL_MIN_SCALE or nthreads < 1:
        nthreads = 1
    cdef char cta = b'T' if ta else b'N'
    cdef char ctb = b'T' if tb else b'N'
    # NOTE: the operands are const views: a read-only array (a broadcast view, a
    # checkpoint's buffer) is a fine operand; only `out` is written
    cdef const float[:, ::1] fa, fb
    cdef float[:, ::1] fc
    cdef const double[:, ::1] da, db
    cdef double[:, ::1] dc
    cdef const float[::1] fbias
    cdef const double[::1] dbias
    cdef const float* fbias_p = NULL
    cdef const double* dbias_p = NULL
    if a.dtype.itemsize == 4:
        fa, fb, fc = a_st, b_st, out
        if bias is not None:
            fbias = bias
            fbias_p = &fbias[0]
        _gemm_rows[float](cta, ctb, M, N, K, 1.0, <float*>&fa[0, 0], lda, <float*>&fb[0, 0], ldb,
                          <float>beta, &fc[0, 0], nthreads, fbias_p)
    else:
        da, db, dc = a_st, b_st, out
        if bias is not None:
            dbias = bias
            dbias_p = &dbias[0]
        _gemm_rows[double](cta, ctb, M, N, K, 1.0, <double*>&da[0, 0], lda, <double*>&db[0, 0],
                           ldb, beta, &dc[0, 0], nthreads, dbias_p)
    return out


cdef enum:
    _SUM_TILE = 32     # float32 columns summed in registers at once (8 SSE registers)
    _SUM_BAND = 16     # rows a block reads before moving to its next tile of columns


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _column_sum(const real* g, real* out, Py_ssize_t M, Py_ssize_t N,
                      int nthreads) noexcept nogil:
    """out[j] = sum over the rows i of g[i, j], the rows added in order (numpy's order for
    a sum over axis 0), split into blocks of columns: the bits do not depend on the
    thread count. Each block goes down the rows a band at a time (a band stays in cache),
    a tile of columns at a time (a tile's sums stay in registers)."""
    cdef Py_ssize_t chunk, c0, c1, j, r0, rows
    cdef Py_ssize_t tile = _SUM_TILE * 4 // <Py_ssize_t>sizeof(real)
    cdef int nchunks, k
    chunk = _column_chunk(N, nthreads)
    nchunks = <int>((N + chunk - 1) // chunk)
    for k in prange(nchunks, nogil=True, num_threads=team_of(nchunks), schedule="static"):
        c0 = k * chunk
        c1 = N if c0 + chunk > N else c0 + chunk
        for j in range(c0, c1):
            out[j] = 0
        r0 = 0
        while r0 < M:
            rows = M - r0 if M - r0 < _SUM_BAND else _SUM_BAND
            j = c0
            while j + tile <= c1:
                _column_tile(g + r0 * N + j, out + j, rows, N)
                j = j + tile
            if j < c1:
                _column_rest(g + r0 * N + j, out + j, rows, N, c1 - j)
            r0 = r0 + rows


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _column_tile(const real* g, real* out, Py_ssize_t M, Py_ssize_t N) noexcept nogil:
    """out[t] += the rows of a tile of columns of g (row stride N), in order: 128 bytes of
    columns (32 float32 or 16 float64), their sums kept in registers down the rows."""
    cdef real acc[_SUM_TILE]
    cdef Py_ssize_t i, t
    cdef const real* row
    for t in range(_SUM_TILE * 4 // <Py_ssize_t>sizeof(real)):
        acc[t] = out[t]
    for i in range(M):
        row = g + i * N
        for t in range(_SUM_TILE * 4 // <Py_ssize_t>sizeof(real)):
            acc[t] = acc[t] + row[t]
    for t in range(_SUM_TILE * 4 // <Py_ssize_t>sizeof(real)):
        out[t] = acc[t]


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _column_rest(const real* g, real* out, Py_ssize_t M, Py_ssize_t N,
                              Py_ssize_t width) noexcept nogil:
    """out[t] += the rows of the last columns of a block (fewer than a tile), in order."""
    cdef Py_ssize_t i, t
    for i in range(M):
        for t in range(width):
            out[t] = out[t] + g[i * N + t]


_COLUMN_SUM_PARALLEL_MIN = 1 << 16


def column_sum(g, int num_threads=1):
    """The sum over the rows of a 2-D float32/float64 array (a linear layer's db from its
    upstream gradient), as np.sum(g, axis=0) adds them (rows in order), on the team."""
    if not isinstance(g, np.ndarray) or g.ndim != 2 or g.dtype.kind != "f" \
            or g.dtype.itemsize not in (4, 8):
        raise TypeError(f"column_sum takes a 2-D float32 or float64 array, got "
                        f"{getattr(g, 'dtype', type(g).__name__)} {getattr(g, 'shape', '')}")
    g = np.ascontiguousarray(g)
    cdef Py_ssize_t M = g.shape[0], N = g.shape[1]
    out = np.empty(N, dtype=g.dtype)
    if N == 0:
        return out
    cdef int nthreads = threads_for(<double>M * N, _COLUMN_SUM_PARALLEL_MIN, num_threads)
    cdef const float[:, ::1] fg
    cdef float[::1] fo
    cdef const double[:, ::1] dg
    cdef double[::1] do
    if M == 0:
        out[...] = 0
        return out
    if g.dtype.itemsize == 4:
        fg, fo = g, out
        _column_sum[float](&fg[0, 0], &fo[0], M, N, nthreads)
    else:
        dg, do = g, out
        _column_sum[double](&dg[0, 0], &do[0], M, N, nthreads)
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def batched_gemm(a, b, out=None, int num_threads=1):
    """out[i] = a[i] @ b[i] for 3-D arrays (batch, M, K) @ (batch, K, N); each of a[i],
    b[i] contiguous or a transposed view. Threads take whole matrices."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        raise TypeError(f"batched_gemm takes numpy arrays, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"batched_gemm: shapes {a.shape} and {b.shape} do not multiply")
    if a.dtype != b.dtype or a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8):
        raise TypeError(f"batched_gemm takes float32 or float64 arrays of one dtype, got {a.dtype} and {b.dtype}")
    cdef int L = a.shape[0], M = a.shape[1], K = a.shape[2], N = b.shape[2]
    if out is None:
        out = np.empty((L, M, N), dtype=a.dtype)
    elif (not isinstance(out, np.ndarray) or out.shape != (L, M, N) or out.dtype != a.dtype
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"batched_gemm: out must be a writeable C-contiguous {a.dtype} array "
                         f"of shape {(L, M, N)}")
    if L == 0 or M == 0 or N == 0:
        return out
    if K == 0:
        out[...] = 0
        return out
    # each matrix as storage + flag: the last two axes contiguous, or swapped
    ta = not (a.strides[2] == a.itemsize and a.strides[1] == K * a.itemsize)
    tb = not (b.strides[2] == b.itemsize and b.strides[1] == N * b.itemsize)
    a_st = np.ascontiguousarray(a) if not ta else np.ascontiguousarray(a.transpose(0, 2, 1))
    b_st = np.ascontiguousarray(b) if not tb else np.ascontiguousarray(b.transpose(0, 2, 1))
    cdef int lda = a_st.shape[2], ldb = b_st.shape[2]
    cdef char fa = b'T' if ta else b'N'
    cdef char fb = b'T' if tb else b'N'
    cdef int nthreads = threads_for(<double>L * M * N * K, _PARALLEL_MIN_FLOPS, num_threads)
    cdef Py_ssize_t i, sa = <Py_ssize_t>M * K, sb = <Py_ssize_t>K * N, sc = <Py_ssize_t>M * N
    cdef float alpha_f = 1, beta_f = 0
    cdef double alpha_d = 1, beta_d = 0
    cdef const float[:, :, ::1] fa3, fb3
    cdef float[:, :, ::1] fc3
    cdef const double[:, :, ::1] da3, db3
    cdef double[:, :, ::1] dc3
    if a.dtype.itemsize == 4:
        fa3, fb3, fc3 = a_st, b_st, out
        for i in prange(L, nogil=True, num_threads=nthreads, schedule="static"):
            rowmajor_gemm(fa, fb, M, N, K, alpha_f, &fa3[i, 0, 0], lda, &fb3[i, 0, 0], ldb,
                          beta_f, &fc3[i, 0, 0], N)
    else:
        da3, db3, dc3 = a_st, b_st, out
        for i in prange(L, nogil=True, num_threads=nthreads, schedule="static"):
            rowmajor_gemm(fa, fb, M, N, K, alpha_d, &da3[i, 0, 0], lda, &db3[i, 0, 0], ldb,
                          beta_d, &dc3[i, 0, 0], N)
    return out


# ---- which BLAS: chosen once, here --------------------------------------------------

_choice = _blas_choice.choose()
use_gemm(_choice["sgemm"], _choice["dgemm"])


def gemm_pointers():
    """(sgemm, dgemm) addresses of the chosen BLAS (0: scipy's cython_blas), for the other
    extensions that cimport gemm: each calls use_gemm(*gemm_pointers()) at import."""
    return _choice["sgemm"], _choice["dgemm"]


def _use_for_benchmark(name):
    """Point this module's gemm (not attention's) at 'openblas' or 'mkl' for the rest of
    the process: benchmarks/bench_blas.py times both through the same entry. Returns the
    choice dict; raises ValueError when that library cannot be used."""
    choice = _benchmark_choices.get(name)
    if choice is None:
        choice = _blas_choice.choose(name)
        if choice["name"] != name:
            raise ValueError(f"BLAS {name!r} is not available here: {choice['reason']}")
        _benchmark_choices[name] = choice
    use_gemm(choice["sgemm"], choice["dgemm"])
    return choice


_benchmark_choices = {}


def blas_choice():
    """The BLAS behind gemm: name ('openblas' or 'mkl'), version, path, request
    (MICROTENSOR_BLAS) and reason. See microtensor/runtime/_blas_choice.py."""
    return {k: v for k, v in _choice.items() if k not in ("sgemm", "dgemm")}


# Pin before any gemm runs inside a parallel region.
pin_blas_threads()
