"""F's distances: normalize, cosine_similarity and pairwise_distance along a dim, each a
composition of differentiable ops (vector_norm, sum, mul, div, clamp), so their gradients
and second gradients come from those ops' rules.
"""
import microtensor.core._core as _core
from microtensor.core._core import register_ops
from microtensor.ops.linalg import vector_norm


def normalize(input, p=2.0, dim=1, eps=1e-12):
    """x / max(||x||_p, eps) along dim"""
    norm = vector_norm(input, p, dim, keepdim=True)
    return _core.div(input, _core.clamp(norm, min=eps))


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """x1 . x2 / max(||x1|| ||x2||, eps) along dim (broadcasting x1 against x2)"""
    dot = _core.sum(_core.mul(x1, x2), dim=dim)
    norms = _core.mul(vector_norm(x1, 2, dim), vector_norm(x2, 2, dim))
    return _core.div(dot, _core.clamp(norms, min=eps))


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """||x1 - x2 + eps||_p over the last dim"""
    return vector_norm(_core.add(_core.sub(x1, x2), eps), p, -1, keepdim)


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("fused", globals(), "cosine_similarity normalize pairwise_distance", scope="F")
