"""The normalisation layers: LayerNorm and RMSNorm over the trailing dims (a Transformer's),
BatchNorm1d over the batch, per channel (makemore's favourite layer)."""
import numpy as np

from microtensor.core._core import Parameter, wrap, as_dtype
from microtensor.ops.creation_extra import _check_device
from microtensor.nn import functional as F
from microtensor.nn import init
from microtensor.nn.layers import _parameter, _size
from microtensor.nn.module import Module

__all__ = ["LayerNorm", "RMSNorm", "BatchNorm1d"]


def _shape(normalized_shape):
    if isinstance(normalized_shape, (int, np.integer)):
        normalized_shape = (normalized_shape,)
    shape = tuple(_size(s, "normalized_shape entries") for s in normalized_shape)
    return shape


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the trailing
    `normalized_shape` dims; weight starts at 1, bias at 0."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = _parameter(self.normalized_shape, dtype)
            if bias:
                self.bias = _parameter(self.normalized_shape, dtype)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims;
    eps=None means the dtype's machine epsilon (torch's default)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = _parameter(self.normalized_shape, dtype)
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, input):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


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
