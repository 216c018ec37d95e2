"""BatchNorm1d: normalise each channel over the batch (makemore's favourite layer)."""
import numpy as np

from microtensor.core._core import Parameter, wrap, as_dtype
from microtensor.ops.creation_extra import _check_device
from microtensor.nn import functional as F
from microtensor.nn.module import Module

__all__ = ["BatchNorm1d"]


class BatchNorm1d(Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias per channel of (N, C) or (N, C, L).

    Training uses the batch's statistics and updates running_mean / running_var
    (momentum 0.1, unbiased variance); eval uses the running ones, as torch does."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, *, bias=True):
        super().__init__()
        _check_device(device)
        dt = np.dtype(as_dtype(dtype)) if dtype is not None else np.dtype(np.float32)
        self.num_features, self.eps, self.momentum = int(num_features), eps, momentum
        self.affine, self.track_running_stats, self.has_bias = affine, track_running_stats, bias
        if affine:
            self.weight = Parameter(np.ones(self.num_features, dtype=dt))
            if bias:
                self.bias = Parameter(np.zeros(self.num_features, dtype=dt))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", wrap(np.zeros(self.num_features, dtype=dt)))
            self.register_buffer("running_var", wrap(np.ones(self.num_features, dtype=dt)))
            self.register_buffer("num_batches_tracked", wrap(np.zeros((), dtype=np.int64)))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, input):
        if input.ndim not in (2, 3) or input.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm1d({self.num_features}): expected (N, "
                             f"{self.num_features}) or (N, {self.num_features}, L) input, got "
                             f"{tuple(input.shape)}")
        training = self.training or not self.track_running_stats
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:           # a cumulative average over the batches seen
                momentum = 1.0 / float(self.num_batches_tracked.item())
        return F.batch_norm(input, self.running_mean if self.track_running_stats else None,
                             self.running_var if self.track_running_stats else None,
                             self.weight, self.bias, training, momentum, self.eps)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.has_bias}, "
                f"track_running_stats={self.track_running_stats}")
