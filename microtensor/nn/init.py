"""nn.init: fill a tensor in place, without recording a graph.

Every function writes straight into `t._data` (so it also works on parameters that
require grad, as torch's init runs under no_grad) and returns `t`. Random values come
from microtensor's generator, so `mt.manual_seed` makes them reproducible.
"""
import math

import numpy as np

from microtensor.core import _core
from microtensor.core._core import Tensor
from microtensor.ops.creation_extra import _generator

__all__ = ["calculate_gain", "normal_", "uniform_", "zeros_", "ones_", "constant_",
           "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
           "trunc_normal_", "orthogonal_", "eye_"]


def _check(t):
    """Every init function starts here: t is a Tensor, and its values are about to be
    overwritten, which counts as an in-place change (a graph that saved t will refuse
    to run backward with the new values, as PyTorch's does)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"nn.init expects a Tensor, got {type(t).__name__}")
    t._bump_version()
    return t


def _draw_into(t, draw):
    """Fill t in place with draw(out=...) when numpy can write straight into it
    (float32/float64, contiguous): no float64 temporary for a float32 weight."""
    data = t._data
    if data.dtype in (np.float32, np.float64) and data.flags.c_contiguous and data.flags.writeable:
        draw(data.dtype, data)
    else:
        tmp = np.empty(data.shape, dtype=np.float64)
        draw(np.float64, tmp)
        data[...] = tmp
    return data


def normal_(tensor, mean=0.0, std=1.0, generator=None):
    """t ~ N(mean, std^2), in place."""
    _check(tensor)
    if std < 0:
        raise ValueError(f"normal_: std must be non-negative, got {std}")
    gen = _generator(generator)
    data = _draw_into(tensor, lambda dt, out: gen.standard_normal(out.shape, dtype=dt, out=out))
    data *= std
    data += mean
    return tensor


def uniform_(tensor, a=0.0, b=1.0, generator=None):
    """t ~ U(a, b), in place."""
    _check(tensor)
    if a > b:
        raise ValueError(f"uniform_: expected a <= b, got a={a}, b={b}")
    gen = _generator(generator)
    data = _draw_into(tensor, lambda dt, out: gen.random(out.shape, dtype=dt, out=out))
    data *= (b - a)
    data += a
    return tensor


def constant_(tensor, val):
    _check(tensor)._data[...] = val
    return tensor


def zeros_(tensor):
    return constant_(tensor, 0)


def ones_(tensor):
    return constant_(tensor, 1)


def _fans(tensor):
    """(fan_in, fan_out) of a weight (out, in, *kernel), as torch computes them."""
    if tensor.ndim < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than "
                         f"2 dimensions (got shape {tensor.shape})")
    receptive = int(np.prod(tensor.shape[2:])) if tensor.ndim > 2 else 1
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def calculate_gain(nonlinearity, param=None):
    """The recommended gain for an activation (torch's table)."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity}")


def xavier_uniform_(tensor, gain=1.0, generator=None):
    """t ~ U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(_check(tensor))
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -a, a, generator)


def xavier_normal_(tensor, gain=1.0, generator=None):
    """t ~ N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(_check(tensor))
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def _kaiming_std(tensor, a, mode, nonlinearity):
    fan_in, fan_out = _fans(_check(tensor))
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan = fan_in if mode == "fan_in" else fan_out
    return calculate_gain(nonlinearity, a) / math.sqrt(fan)


def kaiming_uniform_(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """t ~ U(-b, b) with b = gain * sqrt(3 / fan) (He et al. 2015), as torch."""
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """t ~ N(0, std^2) with std = gain / sqrt(fan) (He et al. 2015), as torch."""
    return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity), generator)


def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """t ~ N(mean, std^2) restricted to [a, b] (redrawing what falls outside)."""
    _check(tensor)
    if std < 0 or a >= b:
        raise ValueError(f"trunc_normal_: needs std >= 0 and a < b, got std={std}, a={a}, b={b}")
    gen = _generator(generator)
    out = np.empty(tensor._data.shape, dtype=np.float64)
    flat = out.reshape(-1)
    todo = np.arange(flat.size)
    for _ in range(1000):
        if todo.size == 0:
            break
        flat[todo] = mean + std * gen.standard_normal(todo.size)
        todo = todo[(flat[todo] < a) | (flat[todo] > b)]
    np.clip(flat, a, b, out=flat)   # what 1000 redraws left outside (an interval far in a tail)
    tensor._data[...] = out
    return tensor


def orthogonal_(tensor, gain=1.0, generator=None):
    """A (semi-)orthogonal matrix (rows or columns orthonormal), scaled by gain."""
    _check(tensor)
    if tensor.ndim < 2:
        raise ValueError(f"orthogonal_: only tensors with 2 or more dimensions are supported, "
                         f"got shape {tensor.shape}")
    rows = tensor.shape[0]
    cols = tensor._data.size // rows
    flat = _generator(generator).standard_normal((rows, cols))
    if rows < cols:
        flat = flat.T
    q, r = np.linalg.qr(flat)
    q *= np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    tensor._data[...] = (gain * q).reshape(tensor.shape)
    return tensor


def eye_(tensor):
    """The identity matrix, in place (2-D tensors)."""
    _check(tensor)
    if tensor.ndim != 2:
        raise ValueError(f"eye_: only 2-D tensors are supported, got shape {tensor.shape}")
    tensor._data[...] = np.eye(*tensor.shape)
    return tensor
