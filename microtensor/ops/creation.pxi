# Creation functions (tensor, zeros, arange, ...) and the random generator behind randn,
# rand, randint, dropout and nn.init (reseeded by manual_seed).

# -- creation -----------------------------------------------------------------

cdef object _to_array(object data, object dtype):
    """Python data or an array as a numpy array; Python floats become float32,
    Python ints int64 (as in torch); a numpy array keeps its dtype."""
    if isinstance(data, Tensor):
        a = (<Tensor>data)._data
    elif isinstance(data, np.ndarray):
        a = data
    elif isinstance(data, np.generic):
        a = np.asarray(data)                 # a numpy scalar keeps its dtype, as in torch
    elif isinstance(data, bool):
        a = np.array(data, dtype=bool_)
    elif isinstance(data, int):
        a = np.array(data, dtype=int64)
    elif isinstance(data, float):
        # NOTE: straight to the float dtype asked for: through float32 first, 1e-9 asked
        # for as float64 would keep float32's rounding (9.99999972e-10)
        a = np.array(data, dtype=dtype if _is_float_dtype(dtype) else _default_float)
    elif isinstance(data, np.generic):
        a = np.asarray(data)
    else:
        if isinstance(data, (list, tuple)) and any(isinstance(x, Tensor) for x in data):
            data = [x._data if isinstance(x, Tensor) else x for x in data]
        a = np.asarray(data)
        if a.dtype == float64 and _is_float_dtype(dtype):
            pass                             # cast once, below, to the dtype asked for
        elif a.dtype == float64 and _default_float is not float64:
            a = a.astype(_default_float)
        elif a.dtype.kind == "i":
            a = a.astype(int64)
        elif a.dtype.kind not in "fb":
            raise TypeError(f"cannot make a tensor from {type(data).__name__} with dtype {a.dtype}")
    if a.dtype.kind in _NOT_NUMBERS:
        raise TypeError(f"can't convert np.ndarray of type numpy.{a.dtype.type.__name__}: a "
                        f"tensor holds numbers (floating point, integer or bool)")
    if dtype is not None and a.dtype != dtype:
        a = a.astype(dtype)
    return a


cdef bint _is_float_dtype(object dtype):
    return dtype is not None and np.dtype(dtype).kind == "f"


# numpy dtype kinds no tensor holds: objects, strings, raw bytes, dates and times
_NOT_NUMBERS = frozenset("OUSVMm")


def tensor(data, dtype=None, device=None, requires_grad=False):
    """A new tensor holding a copy of `data` (a list, scalar, numpy array or tensor)."""
    check_device(device)
    a = _to_array(data, as_dtype(dtype))
    if isinstance(data, (np.ndarray, Tensor)) and (a is data or isinstance(data, Tensor) and a is (<Tensor>data)._data):
        a = a.copy()
    cdef Tensor t = Tensor._wrap(_contig(a))
    if requires_grad:
        t.requires_grad = True
    return t


def from_numpy(array):
    """A tensor sharing memory with a numpy array."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(array).__name__}")
    _to_array(array, None)                   # the same dtypes as mt.tensor, or TypeError
    for step in array.strides:
        if step < 0:                         # torch's refusal: no tensor has a negative stride
            raise ValueError(
                "At least one stride in the given numpy array is negative, and tensors with "
                "negative strides are not supported. (You can work around this by making a "
                "copy of your array with array.copy().)")
    return Tensor._wrap(array)


def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = []
    for s in shape:
        if isinstance(s, Tensor):
            s = int(s)
        if not isinstance(s, (int, np.integer)):
            raise TypeError(f"sizes must be integers, got {s!r}")
        if s < 0:
            raise ValueError(f"negative dimension {s} in size {tuple(shape)}")
        out.append(int(s))
    return tuple(out)


cdef Tensor _new(object array, bint requires_grad):
    cdef Tensor t = Tensor._wrap(array)
    if requires_grad:
        t.requires_grad = True
    return t


def zeros(*shape, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.zeros(_shape_arg(shape), dtype=as_dtype(dtype) or _default_float), requires_grad)


def ones(*shape, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.ones(_shape_arg(shape), dtype=as_dtype(dtype) or _default_float), requires_grad)


def empty(*shape, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.empty(_shape_arg(shape), dtype=as_dtype(dtype) or _default_float), requires_grad)


def full(shape, fill_value, dtype=None, device=None, requires_grad=False):
    check_device(device)
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if dtype is None:
        dtype = bool_ if isinstance(fill_value, bool) else int64 if isinstance(fill_value, int) else float32
    return _new(np.full(_shape_arg(tuple(shape)), fill_value, dtype=as_dtype(dtype)), requires_grad)


def zeros_like(t, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.zeros(t.shape, dtype=as_dtype(dtype) or t.dtype), requires_grad)


def ones_like(t, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.ones(t.shape, dtype=as_dtype(dtype) or t.dtype), requires_grad)


def full_like(t, fill_value, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.full(t.shape, fill_value, dtype=as_dtype(dtype) or t.dtype), requires_grad)


def arange(start, stop=None, step=1, dtype=None, device=None, requires_grad=False):
    check_device(device)
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    if dtype is None:
        ints = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
        dtype = int64 if ints else _default_float
    return _new(np.arange(start, stop, step, dtype=as_dtype(dtype)), requires_grad)


def linspace(start, end, steps, dtype=None, device=None, requires_grad=False):
    check_device(device)
    return _new(np.linspace(start, end, steps, dtype=as_dtype(dtype) or _default_float), requires_grad)


# -- random numbers: one generator, reseeded by manual_seed ------------------

cdef object _rng = np.random.default_rng()


def manual_seed(seed):
    """Make randn / rand / randint / dropout / init reproducible."""
    global _rng
    _rng = np.random.Generator(np.random.PCG64(int(seed)))
    return _rng


def default_generator():
    """The numpy Generator behind microtensor's random functions."""
    return _rng


def get_rng_state():
    """The generator's state as a JSON string (store it in a checkpoint's metadata)."""
    import json
    return json.dumps(_rng.bit_generator.state)


def set_rng_state(state):
    import json
    global _rng
    st = json.loads(state) if isinstance(state, (str, bytes)) else state
    bg = getattr(np.random, st["bit_generator"])()
    bg.state = st
    _rng = np.random.Generator(bg)


cdef object _gen(object generator):
    """The numpy Generator to draw from: the default one, or that of `generator=`
    (an mt.Generator)."""
    if generator is None:
        return _rng
    draw = getattr(generator, "_numpy_generator", None)
    if draw is None:
        raise TypeError(f"generator must be an mt.Generator, got {type(generator).__name__}")
    return draw()


def randn(*shape, generator=None, dtype=None, device=None, requires_grad=False):
    check_device(device)
    dt = as_dtype(dtype) or _default_float
    return _new(_gen(generator).standard_normal(_shape_arg(shape), dtype=dt if dt in (float32, float64) else float64).astype(dt, copy=False), requires_grad)


def rand(*shape, generator=None, dtype=None, device=None, requires_grad=False):
    check_device(device)
    dt = as_dtype(dtype) or _default_float
    return _new(_gen(generator).random(_shape_arg(shape), dtype=dt if dt in (float32, float64) else float64).astype(dt, copy=False), requires_grad)


def randint(low, high=None, size=None, dtype=None, device=None, generator=None):
    check_device(device)
    if size is None and isinstance(high, (tuple, list)):
        low, high, size = 0, low, high
    if high is None:
        raise TypeError("randint(low, high, size) needs high")
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be greater than low ({low})")
    if isinstance(size, (int, np.integer)):
        size = (size,)
    return _new(_gen(generator).integers(low, high, _shape_arg(tuple(size)), dtype=as_dtype(dtype) or int64), False)


def randperm(n, dtype=None, device=None, generator=None):
    check_device(device)
    n = int(n)
    if n < 0:
        raise RuntimeError(f"randperm: n must be non-negative, got {n}")
    return _new(_gen(generator).permutation(n).astype(as_dtype(dtype) or int64), False)


def multinomial(probs, num_samples, replacement=False, generator=None):
    """Draw `num_samples` indices from each row of `probs` (rows need not sum to 1), as
    torch: with replacement, independent draws; without, distinct indices, in the order
    of an exponential race (index i wins at time E_i / p_i, E_i ~ Exp(1)), so a
    zero-probability index comes only after every positive one."""
    p = probs._data if isinstance(probs, Tensor) else np.asarray(probs)
    if p.ndim not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim, got {p.ndim}")
    if p.dtype.kind != "f":
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                           f"{p.dtype}")
    num_samples = int(num_samples)
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    p2 = np.atleast_2d(p).astype(np.float64)
    if not replacement and num_samples > p2.shape[1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    if (p2 < 0).any() or not np.isfinite(p2).all():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    s = p2.sum(-1, keepdims=True)
    if (s <= 0).any():
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    rng = _gen(generator)
    if replacement or num_samples == 1:
        c = np.cumsum(p2 / s, axis=-1)
        u = rng.random((p2.shape[0], num_samples))
        idx = np.empty((p2.shape[0], num_samples), dtype=int64)
        for r in range(p2.shape[0]):
            idx[r] = np.minimum(np.searchsorted(c[r], u[r], side="right"), p2.shape[1] - 1)
    else:
        keys = p2 / rng.exponential(1.0, p2.shape)           # larger key: earlier in the race
        idx = np.argsort(-keys, axis=-1, kind="stable")[:, :num_samples].astype(int64)
    return Tensor._wrap(idx if p.ndim == 2 else idx[0])
