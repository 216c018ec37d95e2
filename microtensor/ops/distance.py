"""F's distances: normalize, cosine_similarity and pairwise_distance along a dim, each a
composition of differentiable ops (vector_norm, sum, mul, div, clamp), so their gradients
and second gradients come from those ops' rules; cosine_similarity's clamp of a norm at
eps is one small rule of its own (torch's gradient passes through that clamp).
"""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import register_ops, wrap, needs_graph, attach, ShapeError
from microtensor.autograd.graph_rules import DifferentiableRule
from microtensor.ops._common import _tensor, declare_saved
from microtensor.ops.linalg import vector_norm


def normalize(input, p=2.0, dim=1, eps=1e-12):
    """x / max(||x||_p, eps) along dim"""
    norm = vector_norm(input, p, dim, keepdim=True)
    return _core.div(input, _core.clamp(norm, min=eps))


class _NormClampedAtEps(DifferentiableRule):
    """y = max(n, eps);  dn = g   (the value clamped, the gradient passed as if it were not)"""

    def create_graph(self, g):
        """dn = g: torch clamps its norms in place under no_grad, so its graph never sees the
        clamp, and a norm below eps still passes its gradient on"""
        return (g,)


declare_saved(_NormClampedAtEps)            # reads nothing


def _norm_clamped_at_eps(norm, eps):
    out = wrap(np.maximum(norm._data, np.asarray(eps, dtype=norm._data.dtype)))
    if needs_graph((norm,)):
        attach(out, _NormClampedAtEps(), (norm,))
    return out


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """sum(x1 / max(||x1||, eps) * x2 / max(||x2||, eps)) along dim, x1 and x2 broadcast
    first (torch 2.13's formula: each norm clamped on its own, so tiny vectors still give
    +-1 and huge ones never overflow a product of norms; |result| <= 1 up to rounding)"""
    x1, x2 = _tensor(x1, "cosine_similarity", "x1"), _tensor(x2, "cosine_similarity", "x2")
    try:
        shape = np.broadcast_shapes(x1.shape, x2.shape)
    except ValueError:
        raise ShapeError(f"cosine_similarity: x1 of shape {tuple(x1.shape)} and x2 of shape "
                         f"{tuple(x2.shape)} cannot be broadcast together") from None
    # broadcast before the norms, as torch: a norm along a broadcast dim counts each copy
    x1 = x1 if tuple(x1.shape) == shape else _core.expand(x1, *shape)
    x2 = x2 if tuple(x2.shape) == shape else _core.expand(x2, *shape)
    n1 = _norm_clamped_at_eps(vector_norm(x1, 2, dim, keepdim=True), eps)
    n2 = _norm_clamped_at_eps(vector_norm(x2, 2, dim, keepdim=True), eps)
    return _core.sum(_core.mul(_core.div(x1, n1), _core.div(x2, n2)), dim=dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """||x1 - x2 + eps||_p over the last dim"""
    return vector_norm(_core.add(_core.sub(x1, x2), eps), p, -1, keepdim)


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("fused", globals(), "cosine_similarity normalize pairwise_distance", scope="F")
