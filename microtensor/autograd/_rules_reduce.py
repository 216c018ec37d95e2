"""Create-graph rules of the core's reductions (ops_reduce.pxi): sum, mean, var, amax
and max along a dim.
"""
import numpy as np

import microtensor._core as C
from microtensor.autograd.graph_rules import register, _keepdim, _const


# ---- reductions (ops_reduce.pxi) ------------------------------------------------------

@register(C.SumBackward)
def _sum(node, g):
    """y = sum(x, dims);  dx = broadcast(g)"""
    return (C.expand(_keepdim(g, node.shape, node.dims, node.keepdim), node.shape),)


@register(C.MeanBackward)
def _mean(node, g):
    """y = mean(x, dims);  dx = broadcast(g) / n"""
    g = C.div(_keepdim(g, node.shape, node.dims, node.keepdim), float(node.n))
    return (C.expand(g, node.shape),)


@register(C.VarBackward)
def _var(node, g):
    """y = sum((x - mean)^2) / (n - correction);  dx = g * 2 (x - mean) / (n - correction)"""
    x = node.inputs[0]
    centered = C.sub(x, C.mean(x, node.dims, True))
    g = _keepdim(g, x.shape, node.dims, node.keepdim)
    return (C.mul(C.mul(g, 2.0 / node.denom), centered),)


@register(C.AmaxBackward)
def _amax(node, g):
    """y = max over dims;  dx = g / (number of ties) at every maximal element"""
    out = node.out
    if not node.keepdim and node.dims:
        out = np.expand_dims(out, node.dims)
    g = _keepdim(g, node.x.shape, node.dims, node.keepdim)
    hit = C._max_hits(node.x, out, node.evenly)
    count = hit.sum(axis=node.dims, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (C.mul(C.div(g, _const(count, g.dtype)), _const(hit, g.dtype)),)


@register(C.MaxDimBackward)
def _max_dim(node, g):
    """values = x.max(dim);  dx = g at the index of each maximum, 0 elsewhere"""
    idx = node.indices
    if not node.keepdim:
        g = C.unsqueeze(g, node.dim)
        idx = np.expand_dims(idx, node.dim)
    positions = np.arange(node.shape[node.dim]).reshape(
        [-1 if i == node.dim else 1 for i in range(len(node.shape))])
    return (C.where(positions == idx, g, 0.0),)
