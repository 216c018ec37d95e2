# cython: embedsignature=True, wraparound=True
"""The kernels of kernels/_fused.pyx compiled a second time for x86-64 CPUs with AVX2 and FMA.

The build's baseline target (SSE2) leaves the elementwise kernels (exp polynomials,
GELU, cross-entropy rows) 4 floats wide and without fused multiply-add; with AVX2+FMA
gcc makes them 8 wide with FMA, several times faster. This module is the same source,
its kernel functions compiled for AVX2+FMA (setup.py's KERNEL_TARGETS); its import code
stays plain x86-64, so importing it is safe on any CPU, and on a CPU without AVX2 and
FMA every function it exports raises instead of running (CPU_RUNS_THIS_BUILD is False).
microtensor/kernels/_choice.py loads it only where the CPU runs it (else `_fused`);
on other architectures or compilers it is a plain second copy.
"""
cdef extern from *:
    # this build's target and its CPU check, read by kernels/_kernel_target.pxi (included by
    # kernels/_fused.pyx); plain x86-64 code, run at import
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    #define MT_KERNEL_TARGET "avx2,fma"
    static int mt_cpu_runs_target(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    #endif
    """

include "_fused.pyx"

if not CPU_RUNS_THIS_BUILD:
    from microtensor.runtime._blas_choice import refuse_kernel_build
    refuse_kernel_build(globals(), "AVX2 and FMA")
