"""Gradient bookkeeping shared by the layers above the engine (nn and optim), so that
neither has to import the other."""

__all__ = ["zero_grads"]


def zero_grads(parameters, set_to_none=True):
    """Forget the gradients of `parameters`: drop them (default) or fill them with zeros.
    Module.zero_grad and Optimizer.zero_grad both come here."""
    for p in parameters:
        if p._grad is None:
            continue
        if set_to_none:
            p._grad = None
        else:
            p._grad._data[...] = 0
