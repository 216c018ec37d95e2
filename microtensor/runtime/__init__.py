"""What the engine sets up around its kernels: OpenMP's waiting policy, glibc malloc's
thresholds, which BLAS serves matmul, and the build's configuration (mt.show_config())."""
