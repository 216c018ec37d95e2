# cython: embedsignature=True, wraparound=True
"""The attention kernels of _fused_attention.pyx compiled for AVX-512 (see _fused_avx512.pyx:
the row softmax and its backward with AVX-512's instructions at 256 bits; the matrix
products are BLAS either way)."""
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

include "_fused_attention.pyx"
