"""The engine's core: the Tensor, the graph Node and the backward engine, grad mode,
version counters, the op registry and the errors (one Cython extension, `_core`, built
from `_core.pyx` and the include files beside it and in ../ops), and the Python-level
pieces that stand next to it: torch-style dtypes, the Generator, torch's global switches."""
