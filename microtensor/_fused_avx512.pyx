# cython: embedsignature=True, wraparound=True
"""The kernels of _fused.pyx compiled a third time, for x86-64 CPUs with AVX-512.

Same source as _fused_avx2.pyx under a wider `#pragma GCC target`: AVX-512 F/BW/VL/DQ
with FMA. Vectors stay 256 bits wide by preference (gcc's own choice for the Intel
CPUs that have AVX-512): with 512-bit vectors the row kernels with 8 running sums
(layer_norm, the row sums) came out up to 1.6x slower on a Sapphire Rapids-class Xeon,
while the instructions AVX-512 adds (masked tails, exponent scaling, more registers)
make GELU about 28% faster and softmax and cross-entropy 13-15% faster than the AVX2
build at either width (benchmarks/bench_kernels.py; docs/BENCHMARKS.md).
microtensor/nn/_functional_common.py loads it when the CPU reports AVX-512 F, BW, VL
and DQ (MICROTENSOR_KERNELS=avx2 or =baseline asks for a narrower build).
"""
cdef extern from *:
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    #pragma GCC target ("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=256")
    #define MT_FUSED_TARGET "avx512"
    #else
    #define MT_FUSED_TARGET "baseline"
    #endif
    """
    const char* MT_FUSED_TARGET

TARGET = (<bytes>MT_FUSED_TARGET).decode()

include "_fused.pyx"
