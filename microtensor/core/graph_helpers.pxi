# Included in core/_core.pyx. What the create-graph rules share: a node's `create_graph(self,
# g)` method, beside its `backward`, computes the same gradients with differentiable
# ops, so that create_graph=True can differentiate them again (the engine's entry point
# is microtensor/autograd/higher_order.py). The rules of the Python nodes (nn.functional,
# ops/extra.py, ...) import these from microtensor.autograd.graph_rules.
#
# A rule reads the live input tensors (node.inputs) wherever the gradient depends on an
# input's value, so that the second derivative flows back into that input; the arrays a
# node saved are fine for constants only (masks, indices, shapes, exponents).


def _wants(node, i):
    """Whether input i of node is a tensor that requires grad."""
    t = node.inputs[i] if i < len(node.inputs) else None
    return t is not None and t.requires_grad


def _live(node, i, saved):
    """Input i as the live tensor when it is one (so gradients reach it), else the
    constant the node saved (a numpy array or a Python scalar)."""
    t = node.inputs[i] if i < len(node.inputs) else None
    return t if t is not None else saved


def _keepdim(g, in_shape, dims, keepdim):
    """A reduced gradient with its reduced dims put back as size 1."""
    if keepdim or not dims:
        return g
    shape = tuple(1 if i in dims else s for i, s in enumerate(in_shape))
    return reshape(g, shape)


def _const(a, dtype):
    """A constant array in the gradient's dtype (a float64 array would promote)."""
    return np.asarray(a, dtype=dtype)


# ---- indexing's gradient, as an op ---------------------------------------------------------

class IndexAddBackward(Node):
    """y = zeros(shape); y[key] += x  (the gradient of indexing, as an op);  dx = g[key]

    Indexing's backward scatters; the backward of that scatter gathers again, so the
    two rules close the loop for every order."""

    def backward(self, g):
        return (np.asarray(g)[self.key],)

    def create_graph(self, g):
        return (getitem(g, self.key),)


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
