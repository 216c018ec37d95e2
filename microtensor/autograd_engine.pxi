# The autograd engine: the graph node type, grad mode and the backward traversal.
#
# Every differentiable op makes one Node. A node keeps the input tensors it read and
# whatever it saved in forward; `backward(grad_output)` returns one gradient (a numpy
# array, or None) per input. The traversal below walks the graph in topological order
# with an explicit work list, never recursion, so a chain of 20,000 ops is fine.

import traceback as _traceback

cdef bint _grad_enabled = True
cdef bint _anomaly_enabled = False
cdef object _backward_profiler = None   # set by microtensor.profiler while profiling


def set_backward_profiler(fn):
    """While `fn` is set, the engine calls fn(node, grad) instead of node.backward(grad)
    (fn must call node.backward itself); pass None to switch it off."""
    global _backward_profiler
    _backward_profiler = fn


cdef class Node:
    """A node of the computation graph: the backward rule of one op application."""

    def __cinit__(self):
        self.inputs = ()
        self.freed = False
        self._hooks = None
        self._retained = None
        self._trace = None

    cpdef tuple backward(self, object grad_output):
        raise NotImplementedError(f"{type(self).__name__} has no backward rule")

    cpdef release(self):
        """Drop what forward saved (called after backward without retain_graph)."""
        d = getattr(self, "__dict__", None)
        if d is not None:
            d.clear()

    def name(self):
        return type(self).__name__

    @property
    def next_functions(self):
        """((node, 0), ...) per input, as in torch; a leaf shows as AccumulateGrad."""
        out = []
        for t in self.inputs:
            if t is None or not (<Tensor>t)._requires_grad:
                out.append((None, 0))
            elif (<Tensor>t)._node is not None:
                out.append(((<Tensor>t)._node, 0))
            else:
                out.append((AccumulateGrad(t), 0))
        return tuple(out)

    @property
    def metadata(self):
        return {"trace": self._trace}

    def register_hook(self, fn):
        raise NotImplementedError("register hooks on tensors: t.register_hook(fn)")

    def __repr__(self):
        return f"<{self.name()}>"


class AccumulateGrad:
    """Stands for a leaf tensor in `next_functions`, as torch's AccumulateGrad does."""
    def __init__(self, variable):
        self.variable = variable
        self.next_functions = ()

    def name(self):
        return "AccumulateGrad"

    def __repr__(self):
        return "<AccumulateGrad>"


cdef class SliceGrad:
    """A gradient that is zero except on `grad_input[key]` (the backward of slicing).

    The engine adds it straight into the input's gradient buffer, so taking three
    slices of one tensor (the q, k, v split) costs one buffer, not three zero-filled
    full-size arrays and two additions."""
    cdef public object key, value
    cdef public tuple shape
    cdef public object dtype

    def __init__(self, key, value, shape, dtype):
        self.key, self.value, self.shape, self.dtype = key, value, shape, dtype

    def dense(self):
        out = np.zeros(self.shape, dtype=self.dtype)
        out[self.key] = self.value
        return out


cdef inline bint _needs_graph(tuple inputs):
    """True when grad mode is on and some input requires grad."""
    if not _grad_enabled:
        return False
    for t in inputs:
        if t is not None and (<Tensor>t)._requires_grad:
            return True
    return False


cdef inline Tensor _attach(Tensor out, Node node, tuple inputs):
    """Make `out` the result of `node` applied to `inputs`."""
    node.inputs = inputs
    out._node = node
    out._requires_grad = True
    if _anomaly_enabled:
        node._trace = "".join(_traceback.format_stack())
    return out


def set_grad_enabled_(bint mode):
    global _grad_enabled
    prev = _grad_enabled
    _grad_enabled = mode
    return prev


def is_grad_enabled():
    """True when operations record a graph for backward."""
    return _grad_enabled


def set_anomaly_enabled_(bint mode):
    global _anomaly_enabled
    prev = _anomaly_enabled
    _anomaly_enabled = mode
    return prev


def is_anomaly_enabled():
    return _anomaly_enabled


class _GradMode:
    """Base of no_grad / enable_grad: a context manager that also decorates functions."""
    mode = True

    def __enter__(self):
        self._prev = set_grad_enabled_(self.mode)
        return self

    def __exit__(self, *exc):
        set_grad_enabled_(self._prev)
        return False

    def __call__(self, fn):
        import functools
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            prev = set_grad_enabled_(mode)
            try:
                return fn(*args, **kwargs)
            finally:
                set_grad_enabled_(prev)
        return wrapper


class no_grad(_GradMode):
    """`with mt.no_grad():` runs operations without recording a graph."""
    mode = False


class enable_grad(_GradMode):
    """`with mt.enable_grad():` turns graph recording back on inside no_grad."""
    mode = True


class set_grad_enabled(_GradMode):
    def __init__(self, mode):
        self.mode = bool(mode)
        self._prev = set_grad_enabled_(self.mode)

    def __enter__(self):
        return self


class AnomalyError(RuntimeError):
    """A NaN or Inf appeared in backward (raised under detect_anomaly)."""


class detect_anomaly:
    """Within this context the first NaN or Inf produced in backward raises an error
    naming the op that produced it and where that op was created in forward."""

    def __init__(self, check_nan=True):
        self.check_nan = check_nan

    def __enter__(self):
        self._prev = set_anomaly_enabled_(self.check_nan)
        return self

    def __exit__(self, *exc):
        set_anomaly_enabled_(self._prev)
        return False


cdef object _as_grad_array(object g, Tensor t):
    """Check one gradient coming out of a backward rule against its input tensor."""
    if type(g) is SliceGrad:
        if (<SliceGrad>g).shape != t._data.shape:
            raise RuntimeError(f"internal error: slice gradient for shape {(<SliceGrad>g).shape} "
                               f"reached an input of shape {t._data.shape}")
        return g
    if g.dtype != t._data.dtype:
        g = g.astype(t._data.dtype)
    if g.shape != t._data.shape:
        raise RuntimeError(
            f"internal error: gradient of shape {g.shape} for an input of shape "
            f"{t._data.shape}")
    return g


cdef object _run_tensor_hooks(list hooks, object g):
    for hook in hooks:
        r = hook(Tensor._wrap(g))
        if r is not None:
            g = r._data if isinstance(r, Tensor) else np.asarray(r)
    return g


cdef _accumulate_leaf(Tensor t, object g):
    """t.grad += g (the first time: a private copy of g, since g may be shared)."""
    if t._grad is None:
        t._grad = Tensor._wrap(np.array(g, dtype=t._data.dtype, order="C", copy=True))
    else:
        gd = (<Tensor>t._grad)._data
        if gd.flags.writeable:
            np.add(gd, g, out=gd, casting="unsafe")
        else:
            t._grad = Tensor._wrap(gd + g)


cdef object _sum_into(dict pending, set owned, Node m, object gi):
    """pending[m] += gi, in place when the engine owns pending[m]'s buffer
    (a gradient handed over by a backward rule may be shared, so it is never written)."""
    prev = pending.get(m)
    if type(gi) is SliceGrad:
        if prev is None:
            pending[m] = (<SliceGrad>gi).dense()
            owned.add(m)
            return
        if m not in owned:
            prev = np.array(prev, copy=True)
            pending[m] = prev
            owned.add(m)
        prev[(<SliceGrad>gi).key] += (<SliceGrad>gi).value
        return
    if prev is None:
        pending[m] = gi
    elif m in owned:
        np.add(prev, gi, out=prev)
    else:
        pending[m] = prev + gi
        owned.add(m)


cdef _check_anomaly(Node node, tuple grads):
    for g in grads:
        if g is not None and g.dtype.kind == "f" and not np.isfinite(g).all():
            what = "NaN" if np.isnan(g).any() else "Inf"
            where = node._trace or "(the op was created before detect_anomaly was on)\n"
            raise AnomalyError(
                f"Function '{node.name()}' returned {what} values in its gradient.\n"
                f"The op was created in the forward pass here:\n{where}")


def run_backward(list outputs, list grad_outputs, bint retain_graph,
                 list inputs=None, bint accumulate=True):
    """Back-propagate `grad_outputs` from `outputs`.

    With `accumulate`, leaves add their gradient into `.grad` (loss.backward()).
    With `inputs`, the gradients reaching those tensors are returned instead
    (mt.autograd.grad), and no `.grad` is touched.
    """
    cdef Node node, m
    cdef Tensor t
    cdef dict deps = {}        # node -> number of consumers still to report
    cdef dict pending = {}     # node -> gradient summed so far
    cdef dict leaf_grads = {}  # id(leaf) -> [leaf, gradient]
    cdef list stack = []
    cdef list ready = []
    cdef set owned = set()     # nodes whose pending buffer the engine allocated
    cdef dict captured = None  # id(tensor) -> gradient, for autograd.grad
    cdef set capture_nodes = None
    cdef object g

    if inputs is not None:
        captured = {}
        capture_nodes = set()
        for t in inputs:
            if t._node is not None:
                capture_nodes.add(t._node)

    # 1) seed: gradients at the outputs
    for t, g in zip(outputs, grad_outputs):
        if not t._requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        if t._node is None:
            if id(t) in leaf_grads:
                leaf_grads[id(t)][1] = leaf_grads[id(t)][1] + g
            else:
                leaf_grads[id(t)] = [t, g]
            continue
        node = t._node
        if node in pending:
            pending[node] = pending[node] + g
        else:
            pending[node] = g
            if node not in deps:
                deps[node] = 0
                stack.append(node)

    # 2) count, for every reachable node, how many consumers will send it a gradient
    while stack:
        node = stack.pop()
        for inp in node.inputs:
            if inp is None:
                continue
            t = <Tensor>inp
            if t._node is None or not t._requires_grad:
                continue
            m = t._node
            if m in deps:
                deps[m] += 1
            else:
                deps[m] = 1
                stack.append(m)

    # 3) Kahn's algorithm: a node runs once all its consumers have reported
    for node, n in deps.items():
        if n == 0:
            ready.append(node)
    while ready:
        node = ready.pop()
        g = pending.pop(node, None)
        owned.discard(node)
        if g is None:
            # reached only through inputs that produced no gradient
            _release_inputs(node, deps, ready)
            continue
        if node._hooks:
            g = _run_tensor_hooks(node._hooks, g)
        if node._retained is not None and accumulate:
            _accumulate_leaf(<Tensor>node._retained, g)
        if capture_nodes is not None and node in capture_nodes:
            captured[id(node)] = g
        if node.freed:
            raise RuntimeError(
                f"Trying to backward through the graph a second time (at {node.name()}), "
                "but the saved intermediate values have already been freed. Specify "
                "retain_graph=True when calling .backward() or autograd.grad() the first time.")
        if _backward_profiler is None:
            grads = node.backward(g)
        else:
            grads = _backward_profiler(node, g)
        if _anomaly_enabled:
            _check_anomaly(node, grads)
        if not retain_graph:
            node.release()
            node.freed = True
        for inp, gi in zip(node.inputs, grads):
            if inp is None:
                continue
            t = <Tensor>inp
            if not t._requires_grad:
                continue
            if t._node is None:
                if gi is None:
                    continue
                gi = _as_grad_array(gi, t)
                if type(gi) is SliceGrad:
                    gi = (<SliceGrad>gi).dense()
                key = id(t)
                if key in leaf_grads:
                    leaf_grads[key][1] = leaf_grads[key][1] + gi
                else:
                    leaf_grads[key] = [t, gi]
                continue
            m = t._node
            if gi is not None:
                _sum_into(pending, owned, m, _as_grad_array(gi, t))
            deps[m] -= 1
            if deps[m] == 0:
                ready.append(m)

    # 4) leaves: hooks, then accumulate (or capture)
    for key, (t, g) in leaf_grads.items():
        if t._hooks:
            g = _run_tensor_hooks(t._hooks, g)
        if captured is not None:
            captured[key] = g
        elif accumulate:
            _accumulate_leaf(t, g)
    if inputs is None:
        return None
    result = []
    for t in inputs:
        if t._node is not None:
            g = captured.get(id(t._node))
        else:
            g = captured.get(id(t))
        result.append(None if g is None else Tensor._wrap(g))
    return result


cdef _release_inputs(Node node, dict deps, list ready):
    """A node with no gradient still counts as having reported to its inputs."""
    cdef Tensor t
    for inp in node.inputs:
        if inp is None:
            continue
        t = <Tensor>inp
        if t._node is not None and t._requires_grad:
            deps[t._node] -= 1
            if deps[t._node] == 0:
                ready.append(t._node)


# ---- the pieces a Python-level op needs (nn.functional, autograd.Function) --------

def wrap(array):
    """A tensor around a numpy array: no copy, no graph."""
    return Tensor._wrap(array)


def needs_graph(tuple inputs):
    """True when grad mode is on and some input tensor requires grad."""
    return _needs_graph(inputs)


def attach(Tensor out, Node node, tuple inputs):
    """Record that `out` = node(inputs): backward will call node.backward(grad)."""
    return _attach(out, node, inputs)
