"""SGD with momentum, dampening, weight decay and Nesterov momentum (torch's rule)."""
import numpy as np

from microtensor.optim._adamw import sgd_step
from microtensor.optim.optimizer import (
    Optimizer, _bump_version, _check_param, _flat, _flat_grad, _num_threads,
)


class SGD(Optimizer):
    """Stochastic gradient descent, as torch.optim.SGD:

        g = grad + weight_decay * p
        b = g (first step), then b = momentum * b + (1 - dampening) * g
        g = g + momentum * b (nesterov)  or  g = b
        p = p - lr * g

    maximize=True runs the same update on -grad (gradient ascent), as torch.
    """

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False):
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening "
                             f"(got momentum={momentum}, dampening={dampening})")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient (one kernel call each)."""
        loss = self._closure_loss(closure)
        num_threads = _num_threads()
        for gi, group in enumerate(self.param_groups):
            momentum = group["momentum"]
            maximize = group.get("maximize", False)      # absent from older checkpoints
            for pi, p in enumerate(group["params"]):
                if p._grad is None:
                    continue
                # every array the kernel reads is checked first (O(1): shapes and dtypes)
                g = _check_param(self, p, pi, gi)
                if momentum != 0:
                    state = self.state.setdefault(p, {})
                    first_step = state.get("momentum_buffer") is None
                    buf = self._state_buffer(state, "momentum_buffer", p)._data.reshape(-1)
                param, copied = _flat(p._data)
                grad = _flat_grad(p, g, maximize)
                if momentum == 0:
                    first_step, buf = True, param   # unread when momentum is 0
                if param.size:
                    sgd_step(param, grad, buf, group["lr"], momentum, group["dampening"],
                             group["weight_decay"], group["nesterov"], first_step, num_threads)
                if copied:
                    np.copyto(p._data, param.reshape(p.shape))
                _bump_version(p)
        return loss
