# cython: embedsignature=True, wraparound=True
"""The attention kernels of kernels/_fused_attention.pyx compiled for AVX-512 (see kernels/_fused_avx512.pyx:
the row softmax and its backward with AVX-512's instructions at 256 bits; the matrix
products are BLAS either way; the import code stays plain x86-64)."""
cdef extern from *:
    # this build's target and its CPU check, read by kernels/_kernel_target.pxi (included by
    # kernels/_fused_attention.pyx); plain x86-64 code, run at import
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    #define MT_KERNEL_TARGET "avx512"
    static int mt_cpu_runs_target(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    }
    #endif
    """

include "_fused_attention.pyx"

if not CPU_RUNS_THIS_BUILD:
    from microtensor.runtime._blas_choice import refuse_kernel_build
    refuse_kernel_build(globals(), "AVX-512 (F, BW, VL, DQ), AVX2 and FMA")
