# cython: embedsignature=True, wraparound=True
"""The attention kernels of _fused_attention.pyx compiled for AVX2 + FMA (see _fused_avx2.pyx:
the row softmax and its backward get 8-wide; the matrix products are BLAS either way)."""
cdef extern from *:
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    #pragma GCC target ("avx2,fma")
    #define MT_FUSED_TARGET "avx2,fma"
    #else
    #define MT_FUSED_TARGET "baseline"
    #endif
    """
    const char* MT_FUSED_TARGET

TARGET = (<bytes>MT_FUSED_TARGET).decode()

include "_fused_attention.pyx"
