"""nn.utils: gradient clipping."""
import math

import numpy as np

from microtensor.core import _core
from microtensor.core._core import Tensor, wrap
from microtensor.core._grads import zero_grads  # noqa: F401  (Module.zero_grad reads it here)
from microtensor.capture.recorder import recorded_call
from microtensor.kernels import _foreach
from microtensor.core.dtypes import KERNEL_FLOATS as _FLOATS

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _grads(parameters):
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p._grad for p in parameters if p._grad is not None]


def _sum_of_squares(a, num_threads):
    if a.dtype in (np.float32, np.float64):
        return _core.sum_of_squares(np.ascontiguousarray(a).reshape(-1), num_threads)
    a = a.astype(np.float64).ravel()
    return float(np.dot(a, a))


def _vector_norm(a, norm_type, num_threads):
    """||a||_p of an array as a Python float, as torch.linalg.vector_norm: p = 0 counts the
    non-zero elements, p = inf is max |a|, p = -inf is min |a|, any other p is
    (sum |a|^p)^(1/p) (for p < 0 an element 0 makes it 0). Accumulated in float64."""
    if norm_type == 2.0:
        # one pass, no float64 copy (a Cython kernel of the core)
        return math.sqrt(_sum_of_squares(a, num_threads))
    if a.size == 0:
        return math.inf if norm_type == -math.inf else 0.0
    if norm_type == 0.0:
        return float(np.count_nonzero(a))
    absolute = np.abs(a.astype(np.float64, copy=False))
    if norm_type == math.inf:
        return float(absolute.max())
    if norm_type == -math.inf:
        return float(absolute.min())
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return float(np.sum(absolute ** norm_type) ** (1.0 / norm_type))


@recorded_call   # mt.compile records the whole clip as one call (it scales .grad in place)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale all gradients together so that their joint norm is at most max_norm.

    total = ||(||g_1||, ||g_2||, ...)||  (the norm of each gradient, then the norm of those
    norms, as torch: for p = 0, the number of gradients with a non-zero element);
    every gradient is multiplied by min(max_norm / (total + 1e-6), 1), in place (so a NaN
    total makes every gradient NaN, as torch). Returns the total norm (before clipping)
    as a 0-d tensor. norm_type: any float, inf or -inf (also as the strings 'inf', '-inf').
    """
    grads = _grads(parameters)
    max_norm = float(max_norm)
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"clip_grad_norm_: norm_type must be a number, inf or -inf, got "
                         f"{norm_type!r}") from None
    if math.isnan(norm_type):
        raise ValueError("clip_grad_norm_: norm_type is NaN")
    if not grads:
        return wrap(np.array(0.0, dtype=np.float32))
    dtype = np.result_type(*[g._data.dtype for g in grads])
    if dtype.kind != "f":
        dtype = np.dtype(np.float32)
    nt = _core.get_num_threads()
    if norm_type == 2.0:       # sqrt(sum of squares) at once: no square root per gradient
        total = math.sqrt(_foreach_sum_of_squares([g._data for g in grads], nt))
    else:
        norms = np.array([_vector_norm(g._data, norm_type, nt) for g in grads])
        total = _vector_norm(norms, norm_type, nt)
    total_norm = np.array(total, dtype=dtype)
    if error_if_nonfinite and not np.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        clip_coef = dtype.type(max_norm) / (total_norm + dtype.type(1e-6))
    if not clip_coef >= 1:     # also when it is NaN: NaN spreads, as in torch
        # every float gradient that can be scaled where it lies in one call; any other
        # (read-only, strided, not float) by numpy, with the same rounding
        in_place = [_foreach_can_write(g._data) for g in grads]
        _foreach.mul_([g._data for g, ok in zip(grads, in_place) if ok], float(clip_coef), nt)
        for g, ok in zip(grads, in_place):
            if ok:
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                if g._data.flags.writeable:
                    np.multiply(g._data, clip_coef, out=g._data, casting="unsafe")
                else:
                    g._data = (g._data * clip_coef).astype(g._data.dtype)
    return wrap(total_norm)


def _foreach_can_write(a):
    return (type(a) is np.ndarray and a.dtype in _FLOATS
            and a.flags.c_contiguous and a.flags.writeable)


def _foreach_sum_of_squares(arrays, num_threads):
    """sum(a^2) over every array, in double: float arrays in one kernel call (contiguous
    copies of strided ones), any other dtype through float64."""
    floats, total = [], 0.0
    for a in arrays:
        if a.dtype in _FLOATS:
            floats.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
        else:
            total += _sum_of_squares(a, num_threads)
    return _foreach.sum_of_squares(floats, num_threads) + total


@recorded_call
def clip_grad_value_(parameters, clip_value):
    """Clamp every gradient element into [-clip_value, clip_value], in place."""
    clip_value = float(clip_value)
    for g in _grads(parameters):
        np.clip(g._data, -clip_value, clip_value, out=g._data)
