# cython: embedsignature=True, wraparound=True
"""The kernels of _fused.pyx compiled a second time for x86-64 CPUs with AVX2 and FMA.

The build's baseline target (SSE2) leaves the elementwise kernels (exp polynomials,
GELU, cross-entropy rows) 4 floats wide and without fused multiply-add; with AVX2+FMA
gcc makes them 8 wide with FMA, several times faster. This module is the same source
under `#pragma GCC target`; microtensor/nn/functional.py imports it only when the CPU
reports AVX2 and FMA (else `_fused`), so the package still runs on any x86-64 and on
other architectures (where the pragma is skipped and this is a plain second copy).
"""
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

include "_fused.pyx"
