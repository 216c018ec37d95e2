"""What create-graph rules share, and where the engine finds one; DifferentiableRule, the
node whose one rule serves first order and create_graph alike, and FusedNode, the node of
a fused op whose create-graph rule is its declared composite of primitives.

Every node's rule is its `create_graph(self, g)` method, written beside its `backward`
in the op's own file (ops/pointwise.pxi, ops/activations.py, ops/extra.py, ...):
the same gradients as `backward`, computed with differentiable ops so that
create_graph=True can differentiate them again. `rule_for` finds it. Also here, for the
rules written in Python: the helpers on inputs, shapes and constants and `add_at` (the
differentiable scatter that is indexing's gradient), which live in the core
(core/graph_helpers.pxi) because its own nodes' rules use them too; and `_through_primitives`,
which differentiates an op by running its forward again as differentiable primitives
(the rule of the fused ops whose backward formula is long).
"""
import numpy as np

import microtensor.core._core as C
from microtensor.core._core import (  # noqa: F401  (the helpers the rules share)
    _wants, _live, _keepdim, _const, IndexAddBackward, add_at,
)


class DifferentiableRule(C.Node):
    """A node whose gradient is written once: `create_graph(g)`, in differentiable ops.
    First order runs that same rule with grad recording off and hands the engine its
    arrays (each in its input's dtype); create_graph=True runs it recording, so the
    gradients can be differentiated again. For the ops where a numpy or Cython backward
    is not measurably faster than the rule itself (the ops written in Python)."""

    def backward(self, g):
        with C.no_grad():
            grads = self.create_graph(C.wrap(np.asarray(g)))
        out = []
        for t, r in zip(self.inputs, grads):
            if r is None or t is None:
                out.append(None)
            else:
                out.append(r._data.astype(t._data.dtype, copy=False))
        return tuple(out)

    def create_graph(self, g):
        raise NotImplementedError(f"{type(self).__name__}: a DifferentiableRule writes its "
                                  "gradient as create_graph(self, g)")


def rule_for(node_type):
    """The create-graph rule of a node type, or None: its `create_graph` method."""
    if callable(getattr(node_type, "create_graph", None)):
        return _method_rule
    return None


def _method_rule(node, g):
    return node.create_graph(g)


class FusedNode(C.Node):
    """A fused op's node: its first order is a hand-written kernel (`backward`), measurably
    faster than differentiating the op's composite, and beside it the op is declared as
    a plain composite of primitives, `composite(*inputs)` (the node's inputs, None where
    absent). The composite gives the create-graph rule (the engine differentiates it, see
    _through_primitives) and is the reference the op's tests compare the kernel against
    (tests/test_composites.py): the derivative is never written a second time by hand."""

    def create_graph(self, g):
        return _through_primitives(self.composite, self.inputs, g)

    def composite(self, *inputs):
        raise NotImplementedError(f"{type(self).__name__}: a FusedNode declares its op as "
                                  "composite(self, *inputs)")


# ---- the rule written from primitives -------------------------------------------------

def _through_primitives(forward, inputs, grad_output):
    """Gradients of forward(*inputs) for grad_output, as differentiable tensors.

    forward runs on detached aliases of the inputs (leaves, so the local backward below
    walks only this op's small graph, never the model upstream of it); the gradients it
    returns are then re-rooted onto the live inputs: every node of their graph that read
    an alias reads the live tensor instead (same data, same version counter)."""
    aliases = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    g = grad_output
    g_alias = g.detach().requires_grad_() if g.requires_grad else g
    with C.enable_grad():
        out = forward(*aliases)
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    grads = C.run_backward([out], [g_alias], True, [aliases[i] for i in wanted], False, True)
    swap = {id(a): t for a, t in zip(aliases, inputs) if a is not None}
    swap[id(g_alias)] = g
    _reroot([r for r in grads if r is not None], swap)
    result = [None] * len(inputs)
    for i, r in zip(wanted, grads):
        # NOTE: a gradient that is the upstream gradient itself (y = x + b: db = g) comes
        # back as g's alias, a leaf with no node to re-root: hand on the live g instead
        result[i] = r if r is None else swap.get(id(r), r)
    return tuple(result)


def _reroot(tensors, swap):
    """Replace, in the graph behind `tensors`, every input tensor t with swap[id(t)]."""
    stack = [t._node for t in tensors if t._node is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        old = node.inputs
        for t in old:                 # descend before swapping: never into the live graph
            if t is not None and t._node is not None and id(t) not in swap:
                stack.append(t._node)
        if any(t is not None and id(t) in swap for t in old):
            C.replace_inputs(node, tuple(None if t is None else swap.get(id(t), t) for t in old))
