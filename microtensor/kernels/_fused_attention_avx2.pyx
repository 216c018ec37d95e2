# cython: embedsignature=True, wraparound=True
"""The attention kernels of kernels/_fused_attention.pyx compiled for AVX2 + FMA (see kernels/_fused_avx2.pyx:
the row softmax and its backward get 8-wide; the matrix products are BLAS either way; the
import code stays plain x86-64)."""
cdef extern from *:
    # this build's target and its CPU check, read by kernels/_kernel_target.pxi (included by
    # kernels/_fused_attention.pyx); plain x86-64 code, run at import
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    #define MT_KERNEL_TARGET "avx2,fma"
    static int mt_cpu_runs_target(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    #endif
    """

include "_fused_attention.pyx"

if not CPU_RUNS_THIS_BUILD:
    from microtensor.runtime._blas_choice import refuse_kernel_build
    refuse_kernel_build(globals(), "AVX2 and FMA")
