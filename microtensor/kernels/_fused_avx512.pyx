# cython: embedsignature=True, wraparound=True
"""The kernels of kernels/_fused.pyx compiled a third time, for x86-64 CPUs with AVX-512.

Same source as kernels/_fused_avx2.pyx with a wider target in setup.py's KERNEL_TARGETS: AVX-512
F/BW/VL/DQ with FMA. Vectors stay 256 bits wide by preference (gcc's own choice for the
Intel CPUs that have AVX-512): with 512-bit vectors the row kernels with 8 running sums
(layer_norm, the row sums) came out up to 1.6x slower on a Sapphire Rapids-class Xeon,
while the instructions AVX-512 adds (masked tails, exponent scaling, more registers)
make GELU about 28% faster and softmax and cross-entropy 13-15% faster than the AVX2
build at either width (benchmarks/bench_kernels.py; docs/BENCHMARKS.md).
Only the kernel functions are compiled for AVX-512: importing the module is safe on any
x86-64, and where the CPU lacks AVX-512 every function it exports raises instead.
microtensor/kernels/_choice.py loads it when the CPU reports AVX-512 F, BW, VL
and DQ (MICROTENSOR_KERNELS=avx2 or =baseline asks for a narrower build).
"""
cdef extern from *:
    # this build's target and its CPU check, read by kernels/_kernel_target.pxi (included by
    # kernels/_fused.pyx); plain x86-64 code, run at import
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

include "_fused.pyx"

if not CPU_RUNS_THIS_BUILD:
    from microtensor.runtime._blas_choice import refuse_kernel_build
    refuse_kernel_build(globals(), "AVX-512 (F, BW, VL, DQ), AVX2 and FMA")
