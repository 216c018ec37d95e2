"""mt.linalg: the norms of torch.linalg (vector, matrix (Frobenius) and the general
`norm`). The implementations live in microtensor.ops.linalg."""
from microtensor.ops.linalg import vector_norm, matrix_norm, linalg_norm as norm

__all__ = ["norm", "vector_norm", "matrix_norm"]
