"""The bottom layer, the machine: what the engine sets up around its kernels (OpenMP's
waiting policy, glibc malloc's thresholds, which BLAS serves matmul, what the CPU runs)
and the build's configuration. It imports nothing of microtensor's above it: the kernels
read it, and the report of all of it (mt.show_config()) is microtensor/buildinfo.py."""
