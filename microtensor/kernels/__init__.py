"""The C-level kernels: the one gemm (`_blas`), the fused kernels (`_fused`,
`_fused_attention`) with their per-CPU builds (`*_avx2`, `*_avx512`, the best one the CPU
runs chosen at import, `_choice.py`), the step arena, and what they share (`_common.pxd`)."""
