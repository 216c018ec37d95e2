"""Skip connections in a module's graph, and the gradient along the skip path alone.

A skip connection is an addition z = s + b whose branch b was computed from the stream
s through something with parameters. For a module y = M(x) that contains such
additions, dL/dx splits into the part that came along the skip path (every branch
cut) and the part that came through the branches.

The skip part is carried by the engine's own backward pass: while a split is pending,
the engine's per-node hooks (`_core.set_backward_profiler`, and under create_graph
`_core.register_create_graph_rule`) route every node through `_traverse`, which runs
the node's rule once for the real gradient and, for a node on the skip path, once more
for the skip gradient, passing the result only along uncut edges. The engine's order
(every consumer before its producer) makes each skip gradient complete when its node
runs, exactly as it does for the real one.
"""
import numpy as np

from microtensor.core import _core


def _reaches(start, target, region):
    """(does the graph above tensor `start` contain tensor `target`,
        does it touch a leaf that requires grad other than `target`), inside `region`."""
    target_node = target._node
    found, touches_param = False, False
    work = [start]
    seen = set()
    while work:
        t = work.pop()
        if t is target or (target_node is not None and t._node is target_node):
            found = True
            continue
        node = t._node
        if node is None:
            if t._requires_grad:
                touches_param = True
            continue
        if node in seen or node not in region:
            continue
        seen.add(node)
        for inp in node.inputs:
            if inp is not None and inp._requires_grad:
                work.append(inp)
    return found, touches_param


def residual_adds(region_nodes):
    """The additions z = s + b inside a region where the branch b was computed from the
    stream s (s is an ancestor of b) through something with parameters: the skip
    connections. Returns [(add_node, index of s, index of b)]."""
    region = set(region_nodes)
    found = []
    for node in region_nodes:
        if node.name() != "AddBackward" or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or not (a._requires_grad and b._requires_grad):
            continue
        if a is b or (a._node is not None and a._node is b._node):
            continue                                  # x + x is a doubling, not a skip
        if tuple(a.shape) != tuple(b.shape):
            continue
        for s_index, (s, branch) in enumerate(((a, b), (b, a))):
            reached, has_params = _reaches(branch, s, region)
            if reached and has_params:
                found.append((node, s_index, 1 - s_index))
                break
    return found


class SkipPath:
    """The skip path from y back to x inside a region: the nodes from which x can be
    reached without crossing a residual branch (the edge (add node, branch index))."""

    def __init__(self, y, x, region_nodes, adds):
        self.x = x
        self.cut = {(node, b_index) for node, _, b_index in adds}
        region = set(region_nodes)
        on_path = {}
        # iterative post-order: a node is on the path if one of its kept inputs is x or
        # is on the path
        for root in region_nodes:
            if root in on_path:
                continue
            stack = [(root, False)]
            while stack:
                node, expanded = stack.pop()
                if node in on_path:
                    continue
                if not expanded:
                    stack.append((node, True))
                    for _, inp in self.edges(node):
                        m = inp._node
                        if m is not None and m in region and m not in on_path and not self.is_x(inp):
                            stack.append((m, False))
                    continue
                on_path[node] = any(self.is_x(inp) or (inp._node is not None
                                                       and on_path.get(inp._node, False))
                                    for _, inp in self.edges(node))
        self.nodes = {node for node, hit in on_path.items() if hit}
        self.y_node = y._node if y._node in self.nodes else None

    def is_x(self, t):
        return t is self.x or (self.x._node is not None and t._node is self.x._node)

    def edges(self, node):
        for i, inp in enumerate(node.inputs):
            if inp is None or not inp._requires_grad or (node, i) in self.cut:
                continue
            yield i, inp


class SkipStream:
    """One skip gradient travelling with a backward pass: seeded with dL/dy at y, it
    reaches x as `grad_x` (zeros when no uncut path leads from y to x)."""

    def __init__(self, path, grad_y):
        self.path = path
        self.dtype = np.asarray(grad_y).dtype
        self.pending = {} if path.y_node is None else {path.y_node: np.asarray(grad_y)}
        self.grad_x = None

    @property
    def done(self):
        return not self.pending

    def result(self):
        if self.grad_x is None:
            return np.zeros(self.path.x.shape, dtype=self.dtype)
        return np.asarray(self.grad_x)

    def step(self, node):
        """The engine is about to run `node`: if skip gradient waits there, run the
        node's rule on it and pass what comes out along the uncut edges."""
        g = self.pending.pop(node, None)
        if g is None:
            return
        grads = _core.sum_to_inputs(node, tuple(node.backward(g)))   # as the engine hands them on
        for i, inp in self.path.edges(node):
            gi = grads[i]
            if gi is None:
                continue
            if isinstance(gi, _core.SliceGrad):    # a slice's gradient, made dense here
                gi = gi.dense()
            if self.path.is_x(inp):
                self.grad_x = gi if self.grad_x is None else self.grad_x + gi
            elif inp._node in self.path.nodes:
                m = inp._node
                self.pending[m] = gi if m not in self.pending else self.pending[m] + gi


_streams = []        # the skip streams of the backward pass now running
_below = [None]      # the per-node hook that was on when the streams started (a profiler's,
                     # a BackwardTrace's): it keeps running inside ours, and comes back after


def _step_streams(node):
    """Run the skip rules waiting at `node` (before the engine runs the node's own rule
    and frees its saved values); let go of the engine's hooks when none is left."""
    try:
        for stream in list(_streams):
            stream.step(node)
            if stream.done:
                _streams.remove(stream)
    except BaseException:
        _streams.clear()
        _restore_hooks()
        raise
    if not _streams:
        _restore_hooks()


def _traverse(node, grad):
    """The engine's per-node hook while skip streams are pending (see the module doc)."""
    outer = _below[0]            # read first: the last stream's step puts it back
    _step_streams(node)
    return outer(node, grad) if outer is not None else node.backward(grad)


def _traverse_create_graph(node, grad):
    """The same under create_graph=True, around the engine's create-graph rule."""
    from microtensor.autograd import higher_order
    _step_streams(node)
    return higher_order.create_graph_rule(node, grad)


def _install_hooks():
    current = _core.get_backward_profiler()
    if current is not _traverse:
        _below[0] = current
    _core.set_backward_profiler(_traverse)
    _core.register_create_graph_rule(_traverse_create_graph)


def _restore_hooks():
    from microtensor.autograd import higher_order
    if _core.get_backward_profiler() is _traverse:
        _core.set_backward_profiler(_below[0])
    _below[0] = None
    _core.register_create_graph_rule(higher_order.create_graph_rule)


def start_stream(path, grad_y):
    """Carry dL/dy along `path` during the backward pass now running (called from a
    tensor hook at y, which the engine runs just before y's node). Returns the stream."""
    stream = SkipStream(path, grad_y)
    if not stream.done:
        _streams.append(stream)
        _install_hooks()
    return stream


def stop_stream(stream):
    """Forget `stream` (x's hook has read it; normally it finished already)."""
    if stream in _streams:
        _streams.remove(stream)
        if not _streams:
            _restore_hooks()
