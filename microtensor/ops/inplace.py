"""In-place forms of the Python-written ops (t.masked_fill_(m, v), t.scatter_(...)).

The core's engine records no graph for in-place changes, so these follow its rule for
them: allowed where autograd is not watching (no_grad, or a tensor that does not require
grad; torch's usual use: initialising, masking logits in generate), and refused with a
RuntimeError where the gradient would otherwise come out silently wrong. The change goes
through copy_, which bumps the version counter so a saved tensor changed later is caught.
"""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import wrap, register_op, register_ops
from microtensor.ops import extra as _extra
from microtensor.ops import index as _index


def _guard(self, op):
    if _core.is_grad_enabled() and self.requires_grad:
        raise RuntimeError(f"{op}: an in-place change of a tensor that requires grad is not "
                           f"recorded by autograd here; use the out-of-place "
                           f"{op.rstrip('_')}() (or work under mt.no_grad())")


def _inplace(name, fn):
    """`t.name_(...)`: fn(t, ...) computed without a graph, written back into t."""
    def method(self, *args, **kwargs):
        _guard(self, name)
        with _core.no_grad():
            out = fn(self, *args, **kwargs)
        if tuple(out.shape) != tuple(self.shape):
            raise RuntimeError(f"{name}: the result has shape {tuple(out.shape)}, but the "
                               f"tensor has shape {tuple(self.shape)}")
        return self.copy_(out)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"In place: t.{name}(...) writes {name.rstrip('_')}(t, ...) into t."
    return method


_OUT_OF_PLACE = {
    "masked_fill_": _core.masked_fill, "scatter_": _index.scatter,
    "scatter_add_": _index.scatter_add, "index_fill_": _index.index_fill,
    "index_add_": _index.index_add, "pow_": _core.pow, "relu_": _core.relu,
    "sigmoid_": _core.sigmoid, "tanh_": _core.tanh, "exp_": _core.exp, "log_": _core.log,
    "sqrt_": _core.sqrt, "abs_": _core.abs, "neg_": _core.neg, "sin_": _extra.sin,
    "cos_": _extra.cos, "floor_": _extra.floor, "ceil_": _extra.ceil,
    "round_": _extra.round, "trunc_": _extra.trunc, "sign_": _extra.sign,
    "reciprocal_": _extra.reciprocal, "square_": _extra.square,
    "clamp_min_": _extra.clamp_min, "clamp_max_": _extra.clamp_max,
    "cumsum_": _extra.cumsum, "lerp_": _extra.lerp, "log1p_": _extra.log1p,
    "expm1_": _extra.expm1, "rsqrt_": _extra.rsqrt,
}


def fill_diagonal_(self, fill_value, wrap=False):
    """The main diagonal of a 2-D (or all-equal-sized) tensor set to fill_value."""
    _guard(self, "fill_diagonal_")
    a = self._data
    if a.ndim < 2 or (a.ndim > 2 and len(set(a.shape)) != 1):
        raise RuntimeError("fill_diagonal_: all dimensions of input must be of equal length "
                           "(or the tensor 2-D)")
    out = np.array(a, copy=True)
    np.fill_diagonal(out, fill_value, wrap=wrap)
    return self.copy_(_wrap_array(out))


def _wrap_array(array):
    return wrap(array)


def apply_(self, callable):
    """Each element replaced by callable(element) (slow, as in torch; no graph)."""
    _guard(self, "apply_")
    flat = self._data.reshape(-1)
    out = np.array([callable(v.item()) for v in flat], dtype=self._data.dtype)
    return self.copy_(wrap(out.reshape(self._data.shape)))


def share_memory_(self):
    """A no-op: there is one process's memory to share."""
    return self


def data_ptr(self):
    """The address of the first element."""
    return int(self._data.ctypes.data)


def stride(self, dim=None):
    """The steps between neighbours along each dim, in elements, as torch counts them:
    (3, 1) for a contiguous (2, 3), (1, 3) for its transpose, 0 along an expanded dim.
    stride(dim) is one dim's step (a negative dim counts from the end)."""
    array = self._data
    if array.size or any(array.strides):
        steps = tuple(s // array.itemsize for s in array.strides)
    else:     # a new array with no elements (numpy's steps are 0): the contiguous steps,
              # each size counted as >= 1, as torch gives them (a view keeps its base's)
        steps, step = [], 1
        for n in reversed(array.shape):
            steps.insert(0, step)
            step *= max(n, 1)
        steps = tuple(steps)
    if dim is None:
        return steps
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"stride(): dim must be an integer, got {type(dim).__name__}")
    if not steps:
        raise IndexError(f"stride(): dim {dim} given, but the tensor has no dimensions")
    if not -len(steps) <= dim < len(steps):
        raise IndexError(f"stride(): dim out of range (expected in [{-len(steps)}, "
                         f"{len(steps) - 1}], got {dim})")
    return steps[dim]


# ---- the registry rows: Tensor methods only ----------------------------------------------

for _name, _fn in _OUT_OF_PLACE.items():
    register_op(_name, _inplace(_name, _fn), export=False, kind="inplace")
del _name, _fn
register_ops("inplace", globals(), "fill_diagonal_ apply_ share_memory_", export=False)
register_ops("shape", globals(), "data_ptr stride", export=False,     # where the elements sit
             aliasing="none")
