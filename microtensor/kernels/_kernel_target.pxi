# Which CPU this copy of the fused kernels is for, and whether this CPU runs it.
#
# The kernels are compiled three times: _fused and _fused_attention for any x86-64 (or
# any other platform), _fused_avx2 / _fused_attention_avx2 for AVX2 + FMA, and
# _fused_avx512 / _fused_attention_avx512 for AVX-512. A per-CPU module defines
# MT_KERNEL_TARGET and mt_cpu_runs_target() in its first lines and then includes the
# kernels' source. setup.py compiles only the kernels' own functions for the wider
# instruction set (`#pragma GCC target` around them, see KERNEL_TARGETS there): this
# module's import code, Cython's helpers and these lines stay plain x86-64, so importing
# any build is safe on every CPU, and a build the CPU cannot run refuses every call
# (microtensor.runtime._blas_choice.refuse_kernel_build) instead of executing an unknown instruction.
# The baseline build gets the defaults below.
cdef extern from *:
    """
    #ifndef MT_KERNEL_TARGET
    #define MT_KERNEL_TARGET "baseline"
    static int mt_cpu_runs_target(void) { return 1; }
    #endif
    """
    const char* MT_KERNEL_TARGET
    int mt_cpu_runs_target() noexcept nogil

TARGET = (<bytes>MT_KERNEL_TARGET).decode()
CPU_RUNS_THIS_BUILD = bool(mt_cpu_runs_target())
