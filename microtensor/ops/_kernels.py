"""The build of the fused kernels F's ops run: `fused` (norms, softmax, GELU, SiLU,
cross-entropy, embedding, dropout) and `attention`, the widest build this CPU runs,
loaded once (microtensor/kernels/_choice.py). Every op reads them here at call
time (`_kernels.fused.softmax_forward`), so the tests and benchmarks/bench_kernels.py can
run every op on another build by setting these two names."""
from microtensor.kernels._choice import loaded_kernels

fused, attention = loaded_kernels()
