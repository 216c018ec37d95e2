"""Adam and AdamW (torch's update rules, bias correction included)."""
import numpy as np

from microtensor.optim._adamw import adam_step
from microtensor.optim.optimizer import (
    Optimizer, _bump_version, _check_param, _flat, _flat_grad, _num_threads,
)


class Adam(Optimizer):
    """Adam, as torch.optim.Adam (weight decay is an L2 term added to the gradient):

        g = grad + weight_decay * p
        m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2
        p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    Each parameter is updated by one call of the Cython kernel `adam_step`, in place.
    """
    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False):
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        betas = tuple(betas)
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if weight_decay < 0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad))

    def step(self, closure=None):
        """One update of every parameter that has a gradient (one kernel call each)."""
        loss = self._closure_loss(closure)
        num_threads = _num_threads()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            amsgrad = group["amsgrad"]
            for pi, p in enumerate(group["params"]):
                if p._grad is None:
                    continue
                # every array the kernel reads is checked first (O(1): shapes and dtypes)
                g = _check_param(self, p, f"parameter {pi} of param group {gi}")
                state = self.state.setdefault(p, {})
                exp_avg = self._state_buffer(state, "exp_avg", p)._data.reshape(-1)
                exp_avg_sq = self._state_buffer(state, "exp_avg_sq", p)._data.reshape(-1)
                max_exp_avg_sq = (self._state_buffer(state, "max_exp_avg_sq", p)._data.reshape(-1)
                                  if amsgrad else exp_avg_sq)   # unread without amsgrad
                param, copied = _flat(p._data)
                grad = _flat_grad(p, g)
                state["step"] = state.get("step", 0) + 1
                if param.size:
                    adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                              group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                              float(state["step"]), self.decoupled_weight_decay, amsgrad,
                              num_threads)
                if copied:
                    np.copyto(p._data, param.reshape(p.shape))
                _bump_version(p)
        return loss


class AdamW(Adam):
    """Adam with decoupled weight decay, as torch.optim.AdamW: before the Adam update,
    p = p * (1 - lr * weight_decay); the gradient itself is not changed."""
    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)
