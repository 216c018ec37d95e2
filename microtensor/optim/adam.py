"""Adam and AdamW (torch's update rules, bias correction included)."""
import numpy as np

from microtensor.optim._adamw import adam_step, adam_step_many
from microtensor.optim.optimizer import (
    Optimizer, _bump_version, _check_param, _flat, _flat_grad, _num_threads,
)


class Adam(Optimizer):
    """Adam, as torch.optim.Adam (weight decay is an L2 term added to the gradient):

        g = grad + weight_decay * p
        m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2
        p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    maximize=True runs the same update on -grad (gradient ascent), as torch.

    Every parameter of a param group is updated, in place, by one call of the Cython
    kernel `adam_step_many` (its threads share out the elements of all of them); a
    parameter stored non-contiguously takes `adam_step` on a contiguous copy.
    """
    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False):
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
                                      amsgrad=amsgrad, maximize=maximize))

    def step(self, closure=None):
        """One update of every parameter that has a gradient: one kernel call per param
        group and dtype."""
        loss = self._closure_loss(closure)
        num_threads = _num_threads()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            amsgrad = group["amsgrad"]
            maximize = group.get("maximize", False)      # absent from older checkpoints
            options = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            together = {}          # dtype -> the flat arrays of each of the group's parameters
            for pi, p in enumerate(group["params"]):
                if p._grad is None:
                    continue
                # every array the kernel reads is checked first (O(1): shapes and dtypes)
                g = _check_param(self, p, pi, gi)
                state = self.state.setdefault(p, {})
                exp_avg = self._state_buffer(state, "exp_avg", p)._data.reshape(-1)
                exp_avg_sq = self._state_buffer(state, "exp_avg_sq", p)._data.reshape(-1)
                max_exp_avg_sq = (self._state_buffer(state, "max_exp_avg_sq", p)._data.reshape(-1)
                                  if amsgrad else exp_avg_sq)   # unread without amsgrad
                param, copied = _flat(p._data)
                grad = _flat_grad(p, g, maximize)
                step = state.get("step", 0) + 1
                if copied:             # a strided parameter: updated on a copy, copied back
                    if param.size:
                        adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, *options,
                                  float(step), self.decoupled_weight_decay, amsgrad,
                                  num_threads)
                    np.copyto(p._data, param.reshape(p.shape))
                    state["step"] = step
                    _bump_version(p)
                else:
                    together.setdefault(param.dtype, []).append(
                        (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, p))
            for rows in together.values():
                params, grads, avgs, sqs, maxes, steps, owners = map(list, zip(*rows))
                # the kernel checks every array before it writes any: on an error no
                # parameter of the call has moved, and no step count either
                adam_step_many(params, grads, avgs, sqs, maxes, np.array(steps, np.float64),
                               *options, self.decoupled_weight_decay, amsgrad, num_threads)
                for p, step in zip(owners, steps):
                    self.state[p]["step"] = step
                    _bump_version(p)
        return loss


class AdamW(Adam):
    """Adam with decoupled weight decay, as torch.optim.AdamW: before the Adam update,
    p = p * (1 - lr * weight_decay); the gradient itself is not changed."""
    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 amsgrad=False, *, maximize=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)
