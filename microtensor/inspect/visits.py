"""The order in which the engine visits a graph's nodes in backward.

Two ways to know it:

- `backward_order(roots)` works it out without running anything: the engine runs a node
  once every op that read its output has reported (Kahn's algorithm, core/engine.pxi),
  taking the ready nodes last-in first-out; this repeats that walk on `node.inputs`,
  which stay in place after backward.
- `BackwardTrace` watches a backward pass that really runs, through the engine's
  per-node hook (`_core.set_backward_profiler`): which node ran when, the gradient it
  got, and the gradient it sent to each of its inputs.

    with mt.inspect.BackwardTrace(keep_grads=True) as trace:
        loss.backward()
    [node.name() for node in trace.order]        # the engine's visits, first to last
    trace.sent[(node, 0)]                        # |gradient| node sent to its input 0
"""
import math

import numpy as np

from microtensor.core import _core
from microtensor.core._core import Tensor

__all__ = ["backward_order", "BackwardTrace", "grad_norm"]


def grad_norm(array):
    """The 2-norm of a gradient, accumulated in float64."""
    return float(math.sqrt(np.sum(np.square(np.asarray(array, dtype=np.float64)))))


def backward_order(roots):
    """The op nodes behind `roots` (a tensor or a list of tensors, as given to backward) in
    the order the engine runs their rules: every node after all the nodes that consumed
    its output."""
    roots = [roots] if isinstance(roots, Tensor) else list(roots)
    deps, stack = {}, []
    for t in roots:
        node = t._node
        if node is not None and node not in deps:
            deps[node] = 0
            stack.append(node)
    # count, for every reachable node, how many consumers will report to it
    while stack:
        node = stack.pop()
        for inp in node.inputs:
            if inp is None or not inp._requires_grad or inp._node is None:
                continue
            m = inp._node
            if m in deps:
                deps[m] += 1
            else:
                deps[m] = 1
                stack.append(m)
    ready = [node for node, n in deps.items() if n == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for inp in node.inputs:
            if inp is None or not inp._requires_grad or inp._node is None:
                continue
            m = inp._node
            deps[m] -= 1
            if deps[m] == 0:
                ready.append(m)
    return order


class BackwardTrace:
    """Watch the backward passes run inside `with BackwardTrace() as trace:`.

    order      the nodes in the order the engine ran their rules;
    received   {node: |dL/d output|}, the gradient each node got;
    sent       {(node, input index): |gradient|} it passed to that input;
    grads      with keep_grads=True, the arrays: {node: dL/d output} and
               {(node, input index): gradient} in `sent_grads`.
    Another tool's per-node hook (the profiler's) keeps running inside this one.
    """

    def __init__(self, keep_grads=False):
        self.keep_grads = keep_grads
        self.order = []
        self.received = {}
        self.sent = {}
        self.grads = {}
        self.sent_grads = {}
        self._outer = None
        self._active = False

    def _hook(self, node, grad):
        outer = self._outer
        # the gradients as the engine hands them on: each summed to its input's shape
        grads = _core.sum_to_inputs(node, tuple(outer(node, grad) if outer is not None
                                                else node.backward(grad)))
        self.order.append(node)
        self.received[node] = grad_norm(grad)
        if self.keep_grads:
            self.grads[node] = np.array(grad, copy=True)
        for i, gi in enumerate(grads):
            if gi is None:
                continue
            if isinstance(gi, _core.SliceGrad):
                gi = gi.dense()
            array = np.asarray(gi)
            self.sent[(node, i)] = grad_norm(array)
            if self.keep_grads:
                self.sent_grads[(node, i)] = np.array(array, copy=True)
        return grads

    def __enter__(self):
        if self._active:
            raise RuntimeError("this BackwardTrace is already watching")
        self._outer = _core.get_backward_profiler()
        _core.set_backward_profiler(self._hook)
        self._active = True
        return self

    def __exit__(self, *exc):
        _core.set_backward_profiler(self._outer)
        self._outer = None
        self._active = False
        return False

    def position(self):
        """{node: its index in `order`}."""
        return {node: i for i, node in enumerate(self.order)}
