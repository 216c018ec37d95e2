"""What create-graph rules share, and where the engine finds one.

A node's rule is its `create_graph(self, g)` method, written beside its `backward` in
the op's own file (nn/_activations_fn.py, ops_extra.py, ...). The core's Cython nodes
take theirs from RULES (keyed by the node class; `register`), filled by the
autograd/_rules_*.py modules. `rule_for` finds either. Also here: small helpers on inputs,
shapes and constants; `add_at`, the differentiable scatter that is indexing's gradient;
and `_through_primitives`, which differentiates an op by running its forward again as
differentiable primitives (the rule of the fused ops whose backward formula is long).
"""
import numpy as np

import microtensor._core as C
from microtensor._core import Tensor, Node, wrap, attach, needs_graph

RULES = {}


def register(*node_types):
    """@register(NodeClass, ...) adds a rule for those node types (classes, never names:
    a rule beside its node is a `create_graph(self, g)` method instead)."""
    for t in node_types:
        if not isinstance(t, type):
            raise TypeError(f"register takes node classes, got {t!r}")

    def add(rule):
        for t in node_types:
            RULES[t] = rule
        return rule
    return add


def rule_for(node_type):
    """The create-graph rule of a node type, or None: the one in RULES, else the node's
    own `create_graph(g)` method (a rule written beside its backward)."""
    rule = RULES.get(node_type)
    if rule is None and callable(getattr(node_type, "create_graph", None)):
        return _method_rule
    return rule


def _method_rule(node, g):
    return node.create_graph(g)


# ---- helpers -----------------------------------------------------------------------

def _wants(node, i):
    t = node.inputs[i] if i < len(node.inputs) else None
    return t is not None and t.requires_grad


def _live(node, i, saved):
    """Input i as the live tensor when it is one (so gradients reach it), else the
    constant the node saved (a numpy array or a Python scalar)."""
    t = node.inputs[i] if i < len(node.inputs) else None
    return t if t is not None else saved


def _shape_of(x):
    return tuple(x.shape) if isinstance(x, (np.ndarray, Tensor)) else ()


def _sum_to(g, shape):
    """unbroadcast for tensors: sum g down to `shape` (differentiable: a sum)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    extra = g.ndim - len(shape)
    if extra > 0:
        g = C.sum(g, tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = C.sum(g, axes, True)
    return g


def _keepdim(g, in_shape, dims, keepdim):
    """A reduced gradient with its reduced dims put back as size 1."""
    if keepdim or not dims:
        return g
    shape = tuple(1 if i in dims else s for i, s in enumerate(in_shape))
    return C.reshape(g, shape)


def _const(a, dtype):
    """A constant array in the gradient's dtype (a float64 array would promote)."""
    return np.asarray(a, dtype=dtype)


# ---- indexing's gradient, as an op ---------------------------------------------------

class IndexAddBackward(Node):
    """y = zeros(shape); y[key] += x  (the gradient of indexing, as an op);  dx = g[key]

    Indexing's backward scatters; the backward of that scatter gathers again, so the
    two rules close the loop for every order."""

    def backward(self, g):
        return (np.asarray(g)[self.key],)

    def create_graph(self, g):
        return (C.getitem(g, self.key),)


def add_at(x, key, shape, basic):
    """zeros(shape) with x added at [key] (repeated indices accumulate), differentiably:
    the gradient of indexing, of embedding and of scatter."""
    out = np.zeros(shape, dtype=x._data.dtype)
    if basic:
        out[key] = x._data
    else:
        np.add.at(out, key, x._data)
    out = wrap(out)
    if needs_graph((x,)):
        node = IndexAddBackward()
        node.key = key
        attach(out, node, (x,))
    return out


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
        result[i] = r
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
