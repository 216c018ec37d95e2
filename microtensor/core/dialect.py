"""PyTorch's global switches, as a torch script calls them: default dtype, print
options, inference mode, matmul precision."""
import numpy as np

import microtensor.core._core as _core
from microtensor.core.dtypes import KERNEL_FLOATS

__all__ = ["set_default_dtype", "get_default_dtype", "set_printoptions", "inference_mode",
           "is_inference_mode_enabled", "set_float32_matmul_precision",
           "get_float32_matmul_precision", "use_deterministic_algorithms",
           "are_deterministic_algorithms_enabled"]


# ---- default dtype ---------------------------------------------------------------------

def _float_dtype(dtype, op):
    dt = _core.as_dtype(dtype)
    if np.dtype(dt) not in KERNEL_FLOATS:
        raise TypeError(f"{op}(): only floating-point types are supported as the default type, "
                        f"got {dtype}")
    return dt


def set_default_dtype(d):
    """The dtype of Python floats and of float creation functions (float32 or float64)."""
    dt = _float_dtype(d, "set_default_dtype")
    setter = getattr(_core, "set_default_float_dtype", None)
    if setter is not None:
        setter(dt)
    elif np.dtype(dt) != np.dtype(np.float32):
        raise NotImplementedError("set_default_dtype: this build's core has no default-dtype "
                                  "setter; only float32 is available")


def get_default_dtype():
    getter = getattr(_core, "get_default_float_dtype", None)
    return getter() if getter is not None else _core.float32


# ---- printing ----------------------------------------------------------------------------

PRINT_OPTIONS = {"precision": 4, "threshold": 1000, "edgeitems": 3, "linewidth": 80,
                 "sci_mode": None}
_PROFILES = {"default": dict(precision=4, threshold=1000, edgeitems=3, linewidth=80),
             "short": dict(precision=2, threshold=1000, edgeitems=2, linewidth=80),
             "full": dict(precision=4, threshold=2 ** 63 - 1, edgeitems=3, linewidth=80)}


def set_printoptions(precision=None, threshold=None, edgeitems=None, linewidth=None,
                     profile=None, sci_mode=None):
    """torch.set_printoptions: recorded in PRINT_OPTIONS (the tensor repr reads the
    precision and threshold it was built with; the values are kept for when it reads them)."""
    if profile is not None:
        if profile not in _PROFILES:
            raise ValueError(f"set_printoptions: unknown profile {profile!r}")
        PRINT_OPTIONS.update(_PROFILES[profile])
    for name, value in (("precision", precision), ("threshold", threshold),
                        ("edgeitems", edgeitems), ("linewidth", linewidth)):
        if value is not None:
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"set_printoptions: {name} must be a non-negative int, "
                                 f"got {value!r}")
            PRINT_OPTIONS[name] = int(value)
    if sci_mode is not None:
        PRINT_OPTIONS["sci_mode"] = bool(sci_mode)
    hook = getattr(_core, "set_print_options", None)
    if hook is not None:
        hook(dict(PRINT_OPTIONS))


# ---- inference mode ----------------------------------------------------------------------

_inference_depth = 0


class inference_mode:
    """torch.inference_mode: no graph is recorded inside (as no_grad here); usable as a
    context manager or a decorator; inference_mode(False) changes nothing."""

    def __init__(self, mode=True):
        self.mode = bool(mode)
        self._prev = []

    def __enter__(self):
        global _inference_depth
        if self.mode:
            self._prev.append(_core.is_grad_enabled())
            _core.set_grad_enabled_(False)
            _inference_depth += 1
        return self

    def __exit__(self, *exc):
        global _inference_depth
        if self.mode:
            _core.set_grad_enabled_(self._prev.pop())
            _inference_depth -= 1
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with inference_mode(self.mode):
                return fn(*args, **kwargs)
        return wrapper


def is_inference_mode_enabled():
    return _inference_depth > 0


# ---- switches that only matter on other hardware ---------------------------------------

_matmul_precision = "highest"
_deterministic = False


def set_float32_matmul_precision(precision):
    """Accepted for torch scripts; float32 matmuls here are always full precision."""
    global _matmul_precision
    if precision not in ("highest", "high", "medium"):
        raise ValueError(f"set_float32_matmul_precision: expected 'highest', 'high' or "
                         f"'medium', got {precision!r}")
    _matmul_precision = precision


def get_float32_matmul_precision():
    return _matmul_precision


def use_deterministic_algorithms(mode, warn_only=False):
    """Accepted for torch scripts: every op here is deterministic for a given thread count."""
    global _deterministic
    _deterministic = bool(mode)


def are_deterministic_algorithms_enabled():
    return _deterministic

