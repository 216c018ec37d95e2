"""Rotary position embedding (RoPE) as one op: `F.rotary_embedding(x, cos, sin)`.

RoPE treats the last dim of x as d/2 pairs (x_i, x_{i+d/2}) and rotates pair i at
position t by an angle theta_{t,i}; a dot product of two rotated vectors then depends
only on the distance between their positions. Callers pass the tables
cos = cos(theta), sin = sin(theta), each (..., T, d) with the angle of pair i in
columns i and i + d/2 (models/positional.py's RotaryEmbedding builds them).

It is one op because as primitives it is eight (two slices, a negation, a cat, two
products, a sum, ...) on both q and k of every layer:
    y = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
rotate_half is the linear map R = [[0, -I], [I, 0]], whose transpose is
R^T = [[0, I], [-I, 0]], i.e. R^T [u1, u2] = [u2, -u1]; hence
    dx = g * cos + R^T (g * sin)
The tables are constants: no gradient flows into them. As in the core, the Backward
node (the rule) sits right above its forward function.
"""
import numpy as np

from microtensor.core._core import Tensor, wrap, needs_graph, attach, ShapeError, register_ops
from microtensor.autograd.graph_rules import FusedNode
import microtensor.core._core as _core
from microtensor.ops._common import declare_saved

__all__ = ["rotary_embedding"]


def rope_rotate(x, cos, sin):
    """y = x*cos + [-x2, x1]*sin   (x1, x2 the two halves of the last dim)"""
    half = x.shape[-1] // 2
    y = x * cos
    y[..., :half] -= x[..., half:] * sin[..., :half]
    y[..., half:] += x[..., :half] * sin[..., half:]
    return y


def rope_rotate_backward(grad_output, cos, sin):
    """dx = g*cos + [g2, -g1]*sin  (R^T applied to g*sin)"""
    half = grad_output.shape[-1] // 2
    gs = grad_output * sin
    dinp = grad_output * cos
    dinp[..., :half] += gs[..., half:]
    dinp[..., half:] -= gs[..., :half]
    return dinp


def _table(t, name, x):
    """A cos or sin table as a numpy array in x's dtype, checked against x's shape."""
    if isinstance(t, Tensor):
        if t.requires_grad:
            raise ValueError(f"rotary_embedding: {name} is a constant table, but it requires "
                             "grad (pass it detached)")
        t = t._data
    a = np.asarray(t, dtype=x._data.dtype)
    if a.ndim == 0 or a.shape[-1] != x.shape[-1]:
        raise ShapeError(f"rotary_embedding: {name} of shape {a.shape} does not fit x of shape "
                         f"{tuple(x.shape)} (its last dim must be the head dim {x.shape[-1]})")
    try:
        shape = np.broadcast_shapes(a.shape, tuple(x.shape))
    except ValueError:
        shape = None
    if shape != tuple(x.shape):
        raise ShapeError(f"rotary_embedding: {name} of shape {a.shape} does not broadcast to x "
                         f"of shape {tuple(x.shape)}")
    return a


class RopeBackward(FusedNode):
    """dx = g * cos + R^T (g * sin),  R^T [u1, u2] = [u2, -u1]"""

    def backward(self, grad_output):
        return (rope_rotate_backward(grad_output, self.cos, self.sin),)

    def composite(self, x):
        """y = x cos + R x sin,  R [u1, u2] = [-u2, u1]"""
        half = x.shape[-1] // 2
        rotated = _core.cat([_core.neg(x[..., half:]), x[..., :half]], -1)
        return _core.add(_core.mul(x, self.cos), _core.mul(rotated, self.sin))


declare_saved(RopeBackward)        # it reads only its own tables


def rotary_embedding(x, cos, sin):
    """y = x * cos + rotate_half(x) * sin over the last dim of x (..., T, d), d even;
    cos and sin broadcast to x's shape (typically (T, d)) and are constants."""
    if not isinstance(x, Tensor):
        raise TypeError(f"rotary_embedding: x must be a Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ShapeError(f"rotary_embedding rotates pairs of dims, so the last dim of x must "
                         f"be even, got shape {tuple(x.shape)}")
    if x._data.dtype.kind != "f":
        raise TypeError(f"rotary_embedding: x must be a floating tensor, got {x.dtype}")
    cos, sin = _table(cos, "cos", x), _table(sin, "sin", x)
    out = wrap(rope_rotate(x._data, cos, sin))
    if needs_graph((x,)):
        node = RopeBackward()
        node.cos, node.sin = cos, sin
        attach(out, node, (x,))
    return out


# ---- the registry rows: F.<name> (a scoped row: no mt. function, no Tensor method) ----

register_ops("fused", globals(), "rotary_embedding", scope="F")
