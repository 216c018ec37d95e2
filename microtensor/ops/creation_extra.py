"""PyTorch's creation helpers beyond the core's: eye, *_like, Tensor.new_*, as_tensor,
logspace, index grids, tensors built from others (broadcast_*, atleast_*, the stacks,
meshgrid), and random sampling (bernoulli, normal, poisson and their in-place
forms) from the core's generator, so mt.manual_seed makes them reproducible."""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, wrap, register_ops
from microtensor.ops._common import _tensor, _array


def _dtype_or(dtype, default):
    return default if dtype is None else np.dtype(_core.as_dtype(dtype))


def _default_float():
    get = getattr(_core, "get_default_float_dtype", None)
    return np.dtype(_core.as_dtype(get())) if get is not None else np.dtype(np.float32)


def _check_device(device):
    """None or the CPU; any other device is a RuntimeError naming it (the core's rule)."""
    check = getattr(_core, "check_device", None)
    if check is not None:
        check(device)
        return
    if device is None:
        return
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if not isinstance(kind, str) or kind.split(":")[0] != "cpu":
        raise RuntimeError(f"device {str(device)!r} is not available: microtensor runs on the "
                           "CPU only")


def _leaf(array, requires_grad):
    out = wrap(array)
    return out.requires_grad_(True) if requires_grad else out


def eye(n, m=None, dtype=None, requires_grad=False, device=None):
    _check_device(device)
    m = n if m is None else m
    if n < 0 or m < 0:
        raise ValueError(f"eye: n and m must be non-negative, got {n}, {m}")
    return _leaf(np.eye(n, m, dtype=_dtype_or(dtype, _default_float())), requires_grad)


def logspace(start, end, steps, base=10.0, dtype=None, requires_grad=False, device=None):
    _check_device(device)
    if steps < 0:
        raise RuntimeError(f"logspace: number of steps must be non-negative, got {steps}")
    dt = _dtype_or(dtype, _default_float())
    return _leaf(np.logspace(start, end, steps, base=base).astype(dt), requires_grad)


def as_tensor(data, dtype=None, device=None):
    """A tensor sharing memory with `data` when it is a numpy array (or tensor) of the
    requested dtype, else a copy (as torch's)."""
    _check_device(device)
    if isinstance(data, Tensor):
        return data if dtype is None else data.to(dtype)
    if isinstance(data, np.ndarray) and (dtype is None or data.dtype == _dtype_or(dtype, None)):
        return _core.from_numpy(data)
    return _core.tensor(data, dtype=dtype)


def _like(name, fill):
    def like(input, dtype=None, requires_grad=False, device=None, memory_format=None):
        t = _tensor(input, name)
        _check_device(device)
        dt = _dtype_or(dtype, t._data.dtype)
        return _leaf(np.asarray(fill(t._data.shape, dt), dtype=dt), requires_grad)
    like.__name__ = like.__qualname__ = name
    return like


def _random_like(name, fn):
    """randn_like / rand_like: floats drawn (from `generator=`), cast to an integer dtype
    when one is asked for."""
    def like(input, dtype=None, requires_grad=False, device=None, memory_format=None,
             generator=None):
        t = _tensor(input, name)
        _check_device(device)
        dt = _dtype_or(dtype, t._data.dtype)
        draw = fn(*t._data.shape, dtype=dt if dt.kind == "f" else np.float32,
                  generator=generator)._data
        return _leaf(np.asarray(draw, dtype=dt), requires_grad)
    like.__name__ = like.__qualname__ = name
    return like


randn_like = _random_like("randn_like", _core.randn)
rand_like = _random_like("rand_like", _core.rand)
empty_like = _like("empty_like", lambda shape, dt: np.zeros(shape, dt))


def randint_like(input, low=0, high=None, dtype=None, generator=None):
    if high is None:
        low, high = 0, low
    t = _tensor(input, "randint_like")
    draws = _core.randint(low, high, t._data.shape, generator=generator)._data
    return wrap(draws.astype(_dtype_or(dtype, t._data.dtype)))     # a float input: floats


def _new(fill):
    def new(self, *size, dtype=None, device=None, requires_grad=False):
        _check_device(device)
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = tuple(size[0])
        dt = _dtype_or(dtype, self._data.dtype)
        return _leaf(fill(tuple(int(s) for s in size), dt), requires_grad)
    return new


new_zeros = _new(lambda shape, dt: np.zeros(shape, dt))
new_ones = _new(lambda shape, dt: np.ones(shape, dt))
new_empty = _new(lambda shape, dt: np.zeros(shape, dt))


def new_full(self, size, fill_value, dtype=None, device=None, requires_grad=False):
    _check_device(device)
    if isinstance(size, (int, np.integer)):
        size = (size,)
    dt = _dtype_or(dtype, self._data.dtype)
    return _leaf(np.full(tuple(size), fill_value, dtype=dt), requires_grad)


def new_tensor(self, data, dtype=None, device=None, requires_grad=False):
    """A copy of `data` with this tensor's dtype unless one is given (as torch's)."""
    _check_device(device)
    dt = _dtype_or(dtype, self._data.dtype)
    return _leaf(np.array(_array(data), dtype=dt), requires_grad)


def type_as(self, other):
    return self.to(_tensor(other, "type_as", "other").dtype)


def half(self):
    return self.to(_core.as_dtype("float16"))


def tril_indices(row, col, offset=0, dtype=None, device=None):
    _check_device(device)
    r, c = np.tril_indices(row, offset, col)
    return wrap(np.stack([r, c]).astype(_dtype_or(dtype, np.dtype(np.int64))))


def triu_indices(row, col, offset=0, dtype=None, device=None):
    _check_device(device)
    r, c = np.triu_indices(row, offset, col)
    return wrap(np.stack([r, c]).astype(_dtype_or(dtype, np.dtype(np.int64))))


# ---- random sampling ----------------------------------------------------------------------

def _generator(generator):
    """The numpy Generator to draw from: the default one, or that of an mt.Generator."""
    if generator is None:
        return _core.default_generator()
    draw = getattr(generator, "_numpy_generator", None)
    if draw is None:
        raise TypeError(f"generator must be an mt.Generator, got {type(generator).__name__}")
    return draw()


def bernoulli(input, p=None, generator=None):
    """1 with probability input (or p), else 0, in input's dtype; no gradient."""
    t = _tensor(input, "bernoulli")
    probs = t._data if p is None else np.full(t._data.shape, p)
    if probs.size and ((probs < 0) | (probs > 1) | np.isnan(probs)).any():
        raise RuntimeError("bernoulli: probabilities must be in [0, 1]")
    draws = _generator(generator).random(t._data.shape) < probs
    return wrap(draws.astype(t._data.dtype if t._data.dtype.kind == "f" else np.float32))


def normal(mean, std=1.0, size=None, generator=None, dtype=None, requires_grad=False):
    """Samples of N(mean, std), broadcasting tensor arguments, or of `size` for scalars."""
    m, s = _array(mean), _array(std)
    if (s < 0).any():
        raise RuntimeError("normal: std must be non-negative")
    shape = tuple(size) if size is not None else np.broadcast_shapes(m.shape, s.shape)
    dt = _dtype_or(dtype, m.dtype if m.dtype.kind == "f" and m.ndim else _default_float())
    out = m + s * _generator(generator).standard_normal(shape)
    return _leaf(np.asarray(out, dtype=dt), requires_grad)


def poisson(input, generator=None):
    t = _tensor(input, "poisson")
    if (t._data < 0).any():
        raise RuntimeError("poisson: rates must be non-negative")
    return wrap(_generator(generator).poisson(t._data).astype(t._data.dtype))


def _fill_inplace(op, self, values):
    """Write sampled values into self (no graph, as the core's normal_ / uniform_)."""
    return self.copy_(wrap(np.asarray(values, dtype=self._data.dtype)))


def bernoulli_(self, p=0.5, generator=None):
    probs = _array(p)
    return _fill_inplace("bernoulli_", self,
                         _generator(generator).random(self._data.shape) < probs)


def exponential_(self, lambd=1.0, generator=None):
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return _fill_inplace("exponential_", self,
                         _generator(generator).exponential(1.0 / lambd, self._data.shape))


def random_(self, from_=0, to=None, generator=None):
    if to is None:
        from_, to = 0, from_ if from_ else 2 ** 24
    return _fill_inplace("random_", self, _generator(generator).integers(from_, to, self._data.shape))


# ---- tensors built from others: broadcasting, stacks, coordinate grids --------------

def broadcast_shapes(*shapes):
    try:
        return tuple(np.broadcast_shapes(*[(s,) if isinstance(s, int) else tuple(s)
                                           for s in shapes]))
    except ValueError:
        raise _core.ShapeError(f"broadcast_shapes: shapes {shapes} cannot be broadcast "
                               "together") from None


def broadcast_to(input, size):
    return _core.expand(input, *size)


def broadcast_tensors(*tensors):
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    shape = broadcast_shapes(*[_tensor(x, "broadcast_tensors").shape for x in tensors])
    return tuple(x if x.shape == shape else _core.expand(x, *shape) for x in tensors)


def atleast_1d(input):
    return _core.reshape(input, 1) if input.ndim == 0 else input


def atleast_2d(input):
    x = atleast_1d(input)
    return _core.unsqueeze(x, 0) if x.ndim == 1 else x


def hstack(tensors):
    tensors = [atleast_1d(x) for x in tensors]
    return _core.cat(tensors, 0 if tensors[0].ndim == 1 else 1)


def vstack(tensors):
    return _core.cat([atleast_2d(x) for x in tensors], 0)


def column_stack(tensors):
    return _core.cat([_core.reshape(x, -1, 1) if x.ndim <= 1 else x for x in tensors], 1)


def meshgrid(*tensors, indexing="ij"):
    """Coordinate grids from 1-D tensors; 'ij' (matrix) or 'xy' (Cartesian) indexing."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ValueError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    for x in tensors:
        if _tensor(x, "meshgrid").ndim > 1:
            raise RuntimeError(f"meshgrid: expects 0-D or 1-D tensors, got {x.ndim}-D")
    sizes = [x.numel() for x in tensors]
    swap = indexing == "xy" and len(tensors) >= 2
    if swap:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    out = []
    for i, x in enumerate(tensors):
        axis = (1 - i if i < 2 else i) if swap else i
        shape = [1] * len(tensors)
        shape[axis] = sizes[axis]
        out.append(_core.expand(_core.reshape(x, *shape), *sizes))
    return tuple(out)


# ---- the registry rows -----------------------------------------------------------------

register_ops("creation", globals(), """
    eye logspace randn_like rand_like randint_like empty_like tril_indices triu_indices""",
             method=False)
register_ops("creation", globals(), "as_tensor", method=False, aliasing="view_or_copy")
register_ops("random", globals(), "normal poisson", method=False)
register_ops("random", globals(), "bernoulli")
register_ops("shape", globals(), "broadcast_to", aliasing="view")
register_ops("shape", globals(), "broadcast_tensors atleast_1d atleast_2d meshgrid",
             method=False, aliasing="view")
register_ops("shape", globals(), "hstack vstack column_stack", method=False)
register_ops("shape", globals(), "broadcast_shapes", method=False, aliasing="none")
# Tensor methods only (torch has no function of these names)
register_ops("creation", globals(), "new_zeros new_ones new_empty new_full new_tensor",
             export=False)
# the tensor itself when it has the dtype already, as torch's
register_ops("pointwise", globals(), "type_as half", export=False, aliasing="view_or_copy")
register_ops("random", globals(), "bernoulli_ exponential_ random_", export=False,
             aliasing="inplace")
