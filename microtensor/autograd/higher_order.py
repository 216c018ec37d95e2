"""Gradients of gradients: the backward pass that `create_graph=True` runs.

A first-order backward rule (`Node.backward`) works on numpy arrays: fast, but what it
returns has no history. With `create_graph=True` the engine calls `create_graph_rule`
below instead, and every node's gradient is computed by *differentiable tensor ops*, so
the gradients it returns have a `grad_fn` and can be differentiated again, to any order.

Each node type has one rule, its `create_graph(self, g)` method (one gradient per
input), written beside its `backward` in the op's own file: the core's ops in their
.pxi family files (ops/pointwise.pxi, ops/unary.pxi, ops/reduce.pxi, ops/shape.pxi,
ops/matmul.pxi), the others beside their Python nodes.

A rule reads `node.inputs` (the live input tensors) wherever the gradient depends on an
input's value, so that the second derivative flows back into that input. The arrays a
node saved in forward are fine for constants only: masks, indices, shapes, exponents.
(A rule that multiplies by a saved array instead of the live tensor gives the right
first derivative and a silently wrong second one; tests/test_higher_order.py shows that
gradgradcheck catches exactly that.)

Most rules are the node's own backward formula with numpy swapped for tensor ops. Every
fused op (a FusedNode: linear, embedding, dropout, gelu, silu, layer_norm, rms_norm,
attention, rope, cumprod, ...) has no hand-written rule: its rule runs the op's declared
composite again as primitives and differentiates that (`_through_primitives`), which is
slower but short and obviously right. An
mt.autograd.Function runs its own backward with grad mode on (its `create_graph`
method, in autograd/function.py), so it is as differentiable as the ops it is written
with; a node with no rule at all is once differentiable: its gradient is correct, and
differentiating it again raises an error naming the node.

This module holds the entry point and the once-differentiable fallback; where a rule is
found and the helpers rules share are in `graph_rules.py`.
"""
import numpy as np

import microtensor.core._core as C
from microtensor.core._core import Tensor, Node, wrap, attach
# where a rule is found, and the helpers the rules share
from microtensor.autograd.graph_rules import (  # noqa: F401
    rule_for, IndexAddBackward, add_at, _wants, _live, _keepdim,
    _const, _through_primitives, _reroot,
)


def create_graph_rule(node, grad_output):
    """The engine's entry point: one differentiable gradient (or None) per node input."""
    rule = rule_for(type(node))
    if rule is None:
        return _once_differentiable(node, grad_output, f"{node.name()} has no create_graph rule "
                                    f"(give it a create_graph(self, g) method beside its backward)")
    grads = tuple(rule(node, grad_output))
    out = []
    for i, inp in enumerate(node.inputs):
        g = grads[i] if i < len(grads) else None
        if g is None or inp is None or not inp.requires_grad:
            out.append(None)
            continue
        if not isinstance(g, Tensor):
            g = wrap(np.asarray(g, dtype=inp._data.dtype))
        elif g._data.dtype != inp._data.dtype:
            g = C._cast(g, inp._data.dtype)
        out.append(g)
    return tuple(out)


# ---- once-differentiable nodes ---------------------------------------------------------

class NotDifferentiableTwiceBackward(Node):
    """Stands behind a gradient that was computed by numpy code: differentiating it
    again raises (it would otherwise be silently treated as a constant)."""

    def backward(self, g):
        raise RuntimeError(self.message)

    def create_graph(self, g):
        raise RuntimeError(self.message)


def _once_differentiable(node, g, message):
    """First-order gradients from the node's numpy rule, marked so that a second
    differentiation raises `message` instead of returning a wrong (zero) answer."""
    grads = node.backward(g._data)
    sources = tuple(t for t in (g,) + tuple(node.inputs) if t is not None and t.requires_grad)
    out = []
    for inp, gi in zip(node.inputs, grads):
        if gi is None or inp is None:
            out.append(None)
            continue
        if hasattr(gi, "dense"):
            gi = gi.dense()
        t = wrap(np.asarray(gi, dtype=inp._data.dtype))
        if sources and C.is_grad_enabled():
            mark = NotDifferentiableTwiceBackward()
            mark.message = message
            attach(t, mark, sources)
        out.append(t)
    return tuple(out)


C.register_create_graph_rule(create_graph_rule)
