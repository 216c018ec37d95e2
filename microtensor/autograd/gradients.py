"""grad and backward: the two ways into the engine's backward pass (run_backward, in
core/engine.pxi) that mt.autograd offers, with the upstream gradients they seed."""
import numpy as np

from microtensor.core._core import Tensor, run_backward


def _as_list(x):
    if x is None:
        return None
    if isinstance(x, Tensor):
        return [x]
    return list(x)


def _seed_grads(outputs, grad_outputs, create_graph=False):
    """One upstream gradient per output: ones for a one-element output, else the given
    one. Under create_graph a given tensor is kept as it is (it may require grad: the
    result is then differentiable with respect to it too)."""
    grads = []
    grad_outputs = _as_list(grad_outputs) or [None] * len(outputs)
    if len(grad_outputs) != len(outputs):
        raise ValueError(f"grad_outputs has {len(grad_outputs)} entries for {len(outputs)} outputs")
    for out, g in zip(outputs, grad_outputs):
        if not isinstance(out, Tensor):
            raise TypeError(f"outputs must be tensors, got {type(out).__name__}")
        if g is None:
            if out.numel() != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs; an output has "
                    f"shape {out.shape}, so pass grad_outputs")
            g = np.ones(out.shape, dtype=out.dtype)
        elif create_graph and isinstance(g, Tensor):
            if g.shape != out.shape:
                raise ValueError(f"grad_output of shape {g.shape} for an output of shape {out.shape}")
            if g.dtype != out.dtype:
                g = g.to(out.dtype)
        else:
            g = np.asarray(g._data if isinstance(g, Tensor) else g, dtype=out.dtype)
            if g.shape != out.shape:
                raise ValueError(f"grad_output of shape {g.shape} for an output of shape {out.shape}")
        grads.append(g)
    return grads


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=False):
    """The gradients of `outputs` with respect to `inputs`, returned as a tuple.
    Nothing is accumulated into any `.grad`. With create_graph=True the gradients are
    built from differentiable ops (they have a grad_fn), so they can be differentiated
    again; retain_graph then defaults to True."""
    outputs = _as_list(outputs)
    inputs = _as_list(inputs)
    for t in inputs:
        if not isinstance(t, Tensor) or not t.requires_grad:
            raise RuntimeError("every input passed to autograd.grad must be a tensor that requires grad")
    if retain_graph is None:
        retain_graph = create_graph
    grads = _seed_grads(outputs, grad_outputs, create_graph)
    result = run_backward(outputs, grads, bool(retain_graph), inputs, False, bool(create_graph))
    if not allow_unused:
        for i, g in enumerate(result):
            if g is None:
                raise RuntimeError(
                    f"input {i} was not used in the graph; pass allow_unused=True to get None for it")
    return tuple(result)


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False):
    """Like calling .backward() on each output, in one traversal."""
    outputs = _as_list(tensors)
    if retain_graph is None:
        retain_graph = create_graph
    run_backward(outputs, _seed_grads(outputs, grad_tensors, create_graph), bool(retain_graph),
                 None, True, bool(create_graph))
