"""Learning-rate schedules: LambdaLR and CosineAnnealingLR, with torch's values.

A scheduler sets `group["lr"]` of every param group of its optimizer; call
`scheduler.step()` once per epoch (or per iteration) after `optimizer.step()`.
Constructing one already applies the value for step 0, as torch does.
"""
import math

from microtensor.optim.optimizer import Optimizer


class LRScheduler:
    """Base class: keeps `base_lrs` (each group's "initial_lr"), `last_epoch` and the
    last values set; subclasses write `get_lr()`."""

    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] "
                                   "when resuming an optimizer")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._is_initial = True     # the step made by the constructor
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self):
        raise NotImplementedError

    def get_last_lr(self):
        """The learning rates this scheduler set last, one per param group."""
        return list(self._last_lr)

    def step(self):
        self._step_count += 1
        self.last_epoch += 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        """Everything but the optimizer (and functions): plain numbers, JSON-able."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas", "_is_initial")}

    def load_state_dict(self, state_dict):
        self.__dict__.update({k: v for k, v in state_dict.items()
                              if k not in ("lr_lambdas", "_is_initial")})


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(epoch); one function, or one per param group."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        self.optimizer = optimizer
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != len(optimizer.param_groups):
                raise ValueError(f"expected {len(optimizer.param_groups)} lr_lambdas, "
                                 f"but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * len(optimizer.param_groups)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base_lr * fn(self.last_epoch) for fn, base_lr in zip(self.lr_lambdas, self.base_lrs)]


class CosineAnnealingLR(LRScheduler):
    """lr_t = eta_min + (initial_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2.

    Computed, as torch does, by the recursive form (each step from the current lr), so
    values match torch's and other changes to the lr carry through; past T_max the
    schedule rises again (a period of 2 T_max)."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        if T_max <= 0:
            raise ValueError(f"T_max must be positive, got {T_max}")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        t, T = self.last_epoch, self.T_max
        if self._is_initial:                  # the constructor's step keeps the lr
            return [group["lr"] for group in groups]
        if (t - 1 - T) % (2 * T) == 0:        # just past the bottom: the ratio below divides by 0
            return [group["lr"] + (base_lr - self.eta_min) * (1 - math.cos(math.pi / T)) / 2
                    for base_lr, group in zip(self.base_lrs, groups)]
        ratio = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
        return [ratio * (group["lr"] - self.eta_min) + self.eta_min for group in groups]

    def _get_closed_form_lr(self):
        cosine = math.cos(math.pi * self.last_epoch / self.T_max)
        return [self.eta_min + (base_lr - self.eta_min) * (1 + cosine) / 2 for base_lr in self.base_lrs]
