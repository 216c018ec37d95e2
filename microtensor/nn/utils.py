"""nn.utils: gradient clipping."""
import math

import numpy as np

from microtensor import _core
from microtensor._core import Tensor, wrap
from microtensor._grads import zero_grads  # noqa: F401  (Module.zero_grad reads it here)

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


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale all gradients together so that their joint norm is at most max_norm.

    total = ||(||g_1||, ||g_2||, ...)||  (the norm of all gradients as one vector);
    when max_norm / (total + 1e-6) < 1 every gradient is multiplied by it, in place.
    Returns the total norm (before clipping) as a 0-d tensor.
    """
    grads = _grads(parameters)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not grads:
        return wrap(np.array(0.0, dtype=np.float32))
    dtype = np.result_type(*[g._data.dtype for g in grads])
    # NOTE: the norms are accumulated in float64 whatever the gradients' dtype
    if math.isinf(norm_type):
        total = max(float(np.abs(g._data).max(initial=0.0)) for g in grads)
    elif norm_type == 2.0:
        # one pass over each gradient, no float64 copy (a Cython kernel of the core)
        nt = _core.get_num_threads()
        total = math.sqrt(sum(_sum_of_squares(g._data, nt) for g in grads))
    else:
        total = sum(float(np.sum(np.abs(g._data.astype(np.float64)) ** norm_type))
                    for g in grads) ** (1.0 / norm_type)
    total_norm = np.array(total, dtype=dtype)
    if error_if_nonfinite and not np.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    clip_coef = dtype.type(max_norm) / (total_norm + dtype.type(1e-6))
    if clip_coef < 1:
        for g in grads:
            if g._data.flags.writeable:
                np.multiply(g._data, clip_coef, out=g._data, casting="unsafe")
            else:
                g._data = (g._data * clip_coef).astype(g._data.dtype)
    return wrap(total_norm)


def clip_grad_value_(parameters, clip_value):
    """Clamp every gradient element into [-clip_value, clip_value], in place."""
    clip_value = float(clip_value)
    for g in _grads(parameters):
        np.clip(g._data, -clip_value, clip_value, out=g._data)
