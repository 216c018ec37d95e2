# The autograd engine: the graph node type and the backward traversal.
#
# Every differentiable op makes one Node. A node keeps the input tensors it read and
# whatever it saved in forward; `backward(grad_output)` returns one gradient (a numpy
# array, or None) per input. The traversal below walks the graph in topological order
# with an explicit work list, never recursion, so a chain of 20,000 ops is fine.

import traceback as _traceback


cdef object _backward_profiler = None   # set by microtensor.profiler while profiling
cdef object _create_graph_rule = None   # set by microtensor.autograd.higher_order
def set_backward_profiler(fn):
    """While `fn` is set, the engine calls fn(node, grad) instead of node.backward(grad)
    (fn must call node.backward itself); pass None to switch it off."""
    global _backward_profiler
    _backward_profiler = fn


def get_backward_profiler():
    return _backward_profiler


def register_create_graph_rule(fn):
    """fn(node, grad_output: Tensor) -> tuple of Tensors (or None), one per input, built
    from differentiable ops: the backward pass that `create_graph=True` runs."""
    global _create_graph_rule
    _create_graph_rule = fn


def get_create_graph_rule():
    return _create_graph_rule


cdef class Node:
    """A node of the computation graph: the backward rule of one op application."""

    def __cinit__(self):
        self.inputs = ()
        self.freed = False
        self._hooks = None
        self._retained = None
        self._trace = None
        self._saved_versions = None
        self._saves = _SAVES_UNSET

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


cdef inline bint _needs_graph(tuple inputs):
    """True when grad mode is on and some input requires grad."""
    if not mt_grad_on():
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
    cdef int mask = _saved_mask(node)
    if mask != 0:
        _record_versions(out, node, inputs, mask)
    if mt_anomaly():
        node._trace = "".join(_traceback.format_stack())
    return out


cdef object _run_tensor_hooks(list hooks, object g, bint create_graph):
    """Run a tensor's hooks on its gradient. A hook's result replaces the gradient, and
    it is checked here, where Python code hands it back, before any kernel sees it."""
    cdef tuple shape
    for hook in list(hooks):
        gt = g if create_graph else Tensor._wrap(g)
        r = hook(gt)
        if r is None:
            continue
        if create_graph:
            if not isinstance(r, Tensor):
                r = Tensor._wrap(np.asarray(r, dtype=(<Tensor>g)._data.dtype))
            if (<Tensor>r)._data.shape != (<Tensor>g)._data.shape:
                raise RuntimeError(
                    f"hook '{getattr(hook, '__name__', hook)}' returned a gradient of shape "
                    f"{(<Tensor>r)._data.shape}, but the gradient has shape {(<Tensor>g)._data.shape}")
            g = r
            continue
        r = r._data if isinstance(r, Tensor) else r
        try:
            r = np.asarray(r)
        except Exception:
            raise TypeError(f"hook '{getattr(hook, '__name__', hook)}' returned "
                            f"{type(r).__name__}, expected a tensor") from None
        if r.shape != g.shape:
            raise RuntimeError(
                f"hook '{getattr(hook, '__name__', hook)}' returned a gradient of shape {r.shape}, "
                f"but the gradient has shape {g.shape}")
        if r.dtype.kind not in "fiub":
            raise TypeError(f"hook '{getattr(hook, '__name__', hook)}' returned a gradient of "
                            f"dtype {r.dtype}, expected a floating point tensor")
        g = np.ascontiguousarray(r, dtype=g.dtype)
    return g


cdef object _gsum(object a, object b):
    """a + b for two gradients (arrays, or tensors under create_graph)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return add(a, b)
    return np.asarray(a + b)       # two 0-d arrays add up to a numpy scalar: keep an array


cdef object _sum_into(dict pending, set owned, Node m, object gi):
    """pending[m] += gi, in place when the engine owns pending[m]'s buffer
    (a gradient handed over by a backward rule may be shared, so it is never written)."""
    if type(gi) is RowsGrad:
        gi = gi.dense()                      # a row gather of a node's output (not a leaf)
    prev = pending.get(m)
    if type(prev) is _SlicePile:
        if type(gi) is SliceGrad:
            (<_SlicePile>prev).add(<SliceGrad>gi)
            return
        prev = (<_SlicePile>prev).dense()
        pending[m] = prev
        owned.add(m)
    if type(gi) is SliceGrad:
        if prev is None:
            pending[m] = _SlicePile(gi)      # made into one buffer when m runs
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
    elif isinstance(gi, Tensor):
        pending[m] = add(prev, gi)
    elif m in owned:
        np.add(prev, gi, out=prev)
    else:
        pending[m] = np.asarray(prev + gi)    # (0-d + 0-d gives a numpy scalar)
        owned.add(m)


cdef _check_anomaly(Node node, tuple grads):
    for g in grads:
        if isinstance(g, Tensor):
            g = (<Tensor>g)._data
        elif isinstance(g, SliceGrad):
            g = (<SliceGrad>g).value
        if g is not None and g.dtype.kind == "f" and not np.isfinite(g).all():
            what = "NaN" if np.isnan(g).any() else "Inf"
            where = node._trace or "(the op was created before detect_anomaly was on)\n"
            raise AnomalyError(
                f"Function '{node.name()}' returned {what} values in its gradient.\n"
                f"The op was created in the forward pass here:\n{where}")


def run_backward(list outputs, list grad_outputs, bint retain_graph,
                 list inputs=None, bint accumulate=True, bint create_graph=False):
    """Back-propagate `grad_outputs` from `outputs`.

    With `accumulate`, leaves add their gradient into `.grad` (loss.backward()).
    With `inputs`, the gradients reaching those tensors are returned instead
    (mt.autograd.grad), and no `.grad` is touched.
    With `create_graph`, every rule runs as differentiable tensor ops (the rule that
    microtensor.autograd.higher_order registers), so the gradients have a grad_fn.
    """
    cdef Node node, m
    cdef Tensor t
    cdef _LeafGrad lg
    cdef dict deps = {}        # node -> number of consumers still to report
    cdef dict pending = {}     # node -> gradient summed so far
    cdef dict leaves = {}      # id(leaf) -> _LeafGrad
    cdef list stack = []
    cdef list ready = []
    cdef set owned = set()     # nodes whose pending buffer the engine allocated
    cdef dict captured = None  # id(tensor) -> gradient, for autograd.grad
    cdef set capture_nodes = None
    cdef object g, raw, gi, inputs_
    cdef Py_ssize_t i, n_in

    if create_graph:
        if _create_graph_rule is None:
            # registered by microtensor.autograd.higher_order, which `import microtensor`
            # imports (the core imports nothing above it)
            raise RuntimeError("create_graph=True: no create-graph rule is registered; "
                               "import microtensor (its autograd package registers it)")
        grad_outputs = [g if isinstance(g, Tensor) else Tensor._wrap(g) for g in grad_outputs]
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
            lg = leaves.get(id(t))
            if lg is None:
                lg = _LeafGrad.__new__(_LeafGrad)
                lg.leaf, lg.grad, lg.waiting, lg.owned = t, g, 0, False
                leaves[id(t)] = lg
            else:
                lg.grad, lg.owned = _gsum(lg.grad, g), True
            continue
        node = t._node
        if node in pending:
            pending[node] = _gsum(pending[node], g)
        else:
            pending[node] = g
            if node not in deps:
                deps[node] = 0
                stack.append(node)

    # 2) count, for every reachable node and leaf, how many consumers will report to it
    while stack:
        node = stack.pop()
        for inp in node.inputs:
            if inp is None:
                continue
            t = <Tensor>inp
            if not t._requires_grad:
                continue
            if t._node is None:
                lg = leaves.get(id(t))
                if lg is None:
                    lg = _LeafGrad.__new__(_LeafGrad)
                    lg.leaf, lg.grad, lg.waiting, lg.owned = t, None, 0, False
                    leaves[id(t)] = lg
                lg.waiting += 1
                continue
            m = t._node
            if m in deps:
                deps[m] += 1
            else:
                deps[m] = 1
                stack.append(m)

    # 2b) autograd.grad: only the nodes that lead to a requested input run (as in torch);
    # the rest of the graph is neither computed nor freed
    cdef set needed = None       # nodes whose gradient is wanted
    cdef set run = None          # nodes whose rule must run (an input leads to a target)
    if inputs is not None:
        run = _nodes_leading_to(list(deps), capture_nodes,
                                {id(t) for t in inputs if t._node is None})
        needed = run | (capture_nodes & set(deps))
        for node in deps:
            deps[node] = 0
        for node in run:
            for inp in node.inputs:
                if inp is not None and (<Tensor>inp)._requires_grad and \
                        (<Tensor>inp)._node is not None and (<Tensor>inp)._node in needed:
                    deps[(<Tensor>inp)._node] += 1
        for node in list(pending):
            if node not in needed:
                del pending[node]

    # 3) Kahn's algorithm: a node runs once all its consumers have reported
    for node, n in deps.items():
        if n == 0 and (needed is None or node in needed):
            ready.append(node)
    prev_mode = mt_grad_on()
    mt_set_grad_on(create_graph)      # rules record a graph only under create_graph
    try:
        while ready:
            node = ready.pop()
            g = pending.pop(node, None)
            owned.discard(node)
            if type(g) is _SlicePile:
                g = (<_SlicePile>g).dense()
            if g is None:
                # reached only through inputs that produced no gradient
                _release_inputs(node, deps, ready, leaves, captured, accumulate, create_graph,
                                needed)
                continue
            if node._hooks:
                g = _run_tensor_hooks(node._hooks, g, create_graph)
            if node._retained is not None and accumulate:
                retained = node._retained()
                if retained is not None:
                    _accumulate_leaf(<Tensor>retained, g)
            if capture_nodes is not None and node in capture_nodes:
                captured[id(node)] = g
            if run is not None and node not in run:
                continue                 # a requested input: nothing below it is needed
            if node.freed:
                raise RuntimeError(
                    f"Trying to backward through the graph a second time (at {node.name()}), "
                    "but the saved intermediate values have already been freed. Specify "
                    "retain_graph=True when calling .backward() or autograd.grad() the first time.")
            if node._saved_versions is not None:
                _check_versions(node, create_graph)
            if create_graph:
                grads = _create_graph_rule(node, g)
            elif _backward_profiler is None:
                grads = node.backward(g)
            else:
                grads = _backward_profiler(node, g)
            if type(grads) is not tuple:
                grads = tuple(grads)
            if mt_anomaly():
                _check_anomaly(node, grads)
            if not retain_graph:
                node.release()
                node.freed = True
                node._saved_versions = None
            inputs_ = node.inputs
            n_in = len(inputs_)
            if len(grads) < n_in:
                n_in = len(grads)
            for i in range(n_in):
                inp = inputs_[i]
                if inp is None:
                    continue
                t = <Tensor>inp
                if not t._requires_grad:
                    continue
                raw = grads[i]
                if t._node is None:
                    lg = <_LeafGrad>leaves[id(t)]
                    if raw is not None:
                        gi = _as_grad_array(raw, t)
                        # held here by `grads`, `raw` and `gi` when the rule's own array
                        # came through; by `gi` alone when _as_grad_array made a new one
                        _leaf_receive(lg, gi, _unshared(gi, 3 if gi is raw else 1))
                        gi = None
                    raw = None
                    lg.waiting -= 1
                    if lg.waiting == 0:
                        _finish_leaf(lg, captured, accumulate, create_graph)
                    continue
                m = t._node
                if needed is not None and m not in needed:
                    continue
                if raw is not None:
                    _sum_into(pending, owned, m, _as_grad_array(raw, t))
                deps[m] -= 1
                if deps[m] == 0:
                    ready.append(m)

        # 4) leaves not finished above (seeded directly, or cut off by a node without gradient)
        for lg in leaves.values():
            _finish_leaf(lg, captured, accumulate, create_graph)
    finally:
        mt_set_grad_on(prev_mode)
    if inputs is None:
        return None
    result = []
    for t in inputs:
        if t._node is not None:
            g = captured.get(id(t._node))
        else:
            g = captured.get(id(t))
        if g is None:
            result.append(None)
        else:
            result.append(g if isinstance(g, Tensor) else Tensor._wrap(g))
    return result


cdef set _nodes_leading_to(list nodes, set target_nodes, set target_leaves):
    """The nodes with an input that leads to a target (a node's output, or a leaf by id):
    a post-order walk with an explicit stack, so deep graphs need no recursion."""
    cdef dict leads = {}
    cdef list stack
    cdef Node node
    cdef Tensor t
    cdef bint found
    for start in nodes:
        if start in leads:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in leads:
                continue
            if not expanded:
                stack.append((node, True))
                for inp in node.inputs:
                    if inp is not None and (<Tensor>inp)._requires_grad and \
                            (<Tensor>inp)._node is not None and (<Tensor>inp)._node not in leads:
                        stack.append(((<Tensor>inp)._node, False))
                continue
            found = False
            for inp in node.inputs:
                if inp is None or not (<Tensor>inp)._requires_grad:
                    continue
                t = <Tensor>inp
                if t._node is None:
                    found = id(t) in target_leaves
                else:
                    found = t._node in target_nodes or leads.get(t._node, False)
                if found:
                    break
            leads[node] = found
    return {n for n, found in leads.items() if found}


cdef _release_inputs(Node node, dict deps, list ready, dict leaves, dict captured,
                     bint accumulate, bint create_graph, set needed):
    """A node with no gradient still counts as having reported to its inputs."""
    cdef Tensor t
    cdef _LeafGrad lg
    for inp in node.inputs:
        if inp is None:
            continue
        t = <Tensor>inp
        if not t._requires_grad:
            continue
        if t._node is None:
            lg = <_LeafGrad>leaves[id(t)]
            lg.waiting -= 1
            if lg.waiting == 0:
                _finish_leaf(lg, captured, accumulate, create_graph)
        elif needed is None or t._node in needed:
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


cdef tuple _checked_inputs(object inputs, Node node):
    """A node's inputs as Python hands them over: a tuple of Tensors (or None), else an
    exception naming what was found."""
    if not isinstance(inputs, tuple):
        raise TypeError(f"{node.name()}: inputs must be a tuple of tensors, got "
                        f"{type(inputs).__name__}")
    for i, t in enumerate(inputs):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{node.name()}: input {i} must be a Tensor or None, got "
                            f"{type(t).__name__}")
    return <tuple>inputs


def attach(Tensor out, Node node, tuple inputs):
    """Record that `out` = node(inputs): backward will call node.backward(grad)."""
    return _attach(out, node, _checked_inputs(inputs, node))


def replace_inputs(Node node, inputs):
    """Point node at other input tensors (create-graph rules re-root a local graph onto
    the live tensors); checked like attach's inputs. `node.inputs` itself is read-only."""
    node.inputs = _checked_inputs(inputs, node)
