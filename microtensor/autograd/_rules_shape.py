"""Create-graph rules of the core's shape, indexing and matmul ops (ops_shape.pxi,
the indexing and matmul nodes): reshape, permute, expand, cat, tril/triu, indexing
(whose gradient is graph_rules.add_at, the differentiable scatter) and
matmul.
"""
import numpy as np

import microtensor._core as C
from microtensor._core import Tensor, Node, wrap, attach, needs_graph
from microtensor.autograd.graph_rules import register, _wants, _live, _sum_to, add_at


# ---- shapes (ops_shape.pxi) -----------------------------------------------------------

@register(C.ReshapeBackward)
def _reshape(node, g):
    """y = x.reshape(shape);  dx = g.reshape(x.shape)"""
    return (C.reshape(g, node.shape),)


@register(C.PermuteBackward)
def _permute(node, g):
    """y = x.permute(dims);  dx = g.permute(inverse(dims))"""
    return (C.permute(g, tuple(int(d) for d in node.inverse)),)


@register(C.ExpandBackward)
def _expand(node, g):
    """y = x.expand(sizes);  dx = unbroadcast(g)"""
    return (_sum_to(g, node.shape),)


@register(C.CatBackward)
def _cat(node, g):
    """y = cat(xs, dim);  dx_i = the slice of g that x_i filled"""
    return tuple(C.getitem(g, (slice(None),) * node.dim + (slice(start, stop),))
                 if _wants(node, i) else None
                 for i, (start, stop) in enumerate(node.bounds))


@register(C.TrilBackward)
def _tril(node, g):
    """y = tril(x, k) (or triu);  dx = tril(g, k)"""
    return ((C.triu if node.upper else C.tril)(g, node.k),)


@register(C.IndexBackward)
def _index(node, g):
    """y = x[key];  dx = zeros, then dx[key] += g"""
    return (add_at(g, node.key, node.shape, node.basic),)


@register(C.MatmulBackward)
def _matmul(node, g):
    """y = a @ b;  da = g @ b^T,  db = a^T @ g   (1-D operands and batch dims as numpy)"""
    a, b = _live(node, 0, node.a), _live(node, 1, node.b)
    a = a if isinstance(a, Tensor) else wrap(a)
    b = b if isinstance(b, Tensor) else wrap(b)
    a1, b1 = a.ndim == 1, b.ndim == 1
    if a1 and b1:                        # a dot product: g is 0-d
        return (C.mul(g, b) if _wants(node, 0) else None,
                C.mul(g, a) if _wants(node, 1) else None)
    a2 = C.unsqueeze(a, 0) if a1 else a
    b2 = C.unsqueeze(b, -1) if b1 else b
    if a1:
        g = C.unsqueeze(g, -2)
    if b1:
        g = C.unsqueeze(g, -1)
    da = db = None
    if _wants(node, 0):
        da = C.matmul(g, C.transpose(b2, -1, -2))
        if a1:
            da = C.squeeze(da, -2)
        da = _sum_to(da, a.shape)
    if _wants(node, 1):
        db = C.matmul(C.transpose(a2, -1, -2), g)
        if b1:
            db = C.squeeze(db, -1)
        db = _sum_to(db, b.shape)
    return (da, db)
