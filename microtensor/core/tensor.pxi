# The Tensor: a numpy array plus what autograd needs (requires_grad, grad, grad_fn).

import types as _types
import weakref as _weakref

cdef class Tensor:
    """An n-dimensional array that records the operations applied to it.

    `data` is kept in a numpy array; operations on tensors that require grad build a
    graph of Nodes, and `backward()` walks it in reverse.
    """
    __array_priority__ = 1000

    def __init__(self, data=None, requires_grad=False):
        if data is None:
            data = np.zeros(0, dtype=float32)
        self._data = _to_array(data, None)
        self._grad = None
        self._node = None
        self._hooks = None
        self._requires_grad = False
        if requires_grad:
            self.requires_grad = True
        if _capture_hook is not None:
            _capture_hook(self, "a new tensor")  # made outside every recorded op?

    @staticmethod
    cdef Tensor _wrap(object array):
        """A new tensor around `array` (no copy, no graph)."""
        cdef Tensor t = Tensor.__new__(Tensor)
        if type(array) is not np.ndarray:
            # numpy hands back scalars from ops on 0-d arrays; keep an array
            array = array if isinstance(array, np.ndarray) else np.asarray(array)
        t._data = array
        t._requires_grad = False
        if _capture_hook is not None:
            _capture_hook(t, "a new tensor")     # made outside every recorded op?
        return t

    # -- numpy interop: ndarray (op) Tensor defers to Tensor's reflected operators
    __array_ufunc__ = None

    def __array__(self, dtype=None, copy=None):
        _seen(self, "numpy's asarray(t)")
        if dtype is None:
            return self._data
        return self._data.astype(dtype)

    # -- attributes -------------------------------------------------------------
    @property
    def shape(self):
        return self._data.shape

    @property
    def ndim(self):
        return self._data.ndim

    @property
    def dtype(self):
        d = self._data.dtype
        return _dtype_objects.get(d, d)

    @property
    def device(self):
        return _cpu_device

    @property
    def is_cuda(self):
        return False

    def get_device(self):
        return -1

    def cuda(self, *args, **kwargs):
        check_device("cuda")

    def pin_memory(self):
        return self

    def dim(self):
        return self._data.ndim

    def numel(self):
        return self._data.size

    def nelement(self):
        return self._data.size

    def size(self, dim=None):
        if dim is None:
            return self._data.shape
        if self._data.ndim == 0:
            raise IndexError(f"dimension specified as {dim} but tensor has no dimensions")
        return self._data.shape[_norm_dim(dim, self._data.ndim)]

    def element_size(self):
        return self._data.itemsize

    def numpy(self):
        """The values as a numpy array sharing memory (never tracks gradients)."""
        _seen(self, "t.numpy()")
        return self._data

    def item(self):
        _seen(self, "t.item()")
        if self._data.size != 1:
            raise ValueError(
                f"a Tensor with {self._data.size} elements cannot be converted to a Python scalar")
        return self._data.reshape(()).item()

    def tolist(self):
        _seen(self, "t.tolist()")
        return self._data.tolist()

    @property
    def T(self):
        if self._data.ndim > 2:
            raise ValueError(
                f"t.T works on tensors of at most 2 dims, got shape {self._data.shape}; "
                "use permute() or transpose()")
        if self._data.ndim < 2:
            return self
        return transpose(self, 0, 1)

    @property
    def mT(self):
        return transpose(self, -2, -1)

    @property
    def grad(self):
        if _capture_hook is not None:
            _capture_hook(self, "t.grad")        # a recording re-reads it at replay
        return self._grad

    @grad.setter
    def grad(self, value):
        _seen(self, "t.grad = ...")
        if value is None:
            self._grad = None
            return
        value = value if isinstance(value, Tensor) else Tensor._wrap(np.asarray(value))
        if value.shape != self.shape:
            raise ShapeError(f"assigned grad has shape {value.shape}, but the tensor has shape {self.shape}")
        if (<Tensor>value)._data.dtype != self._data.dtype:
            raise TypeError(
                f"assigned grad has dtype {_dtype_name((<Tensor>value)._data.dtype)}, but the "
                f"tensor has dtype {_dtype_name(self._data.dtype)}")
        self._grad = value

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        _seen(self, "t.requires_grad = ...")
        value = bool(value)
        if self._node is not None and not value:
            raise RuntimeError(
                "you can only change requires_grad flags of leaf variables; use detach() "
                "to get a tensor that does not require grad")
        if value and self._data.dtype.kind != "f":
            raise TypeError(
                f"only tensors of floating point dtype can require gradients, got dtype "
                f"{_dtype_name(self._data.dtype)}")
        if value and self._data.dtype != float32 and self._data.dtype != float64:
            raise TypeError(
                f"microtensor computes gradients in float32 and float64; this tensor is "
                f"{_dtype_name(self._data.dtype)}: convert it with .float() first")
        self._requires_grad = value

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    @property
    def is_leaf(self):
        return self._node is None

    @property
    def grad_fn(self):
        return self._node

    @property
    def data(self):
        """A tensor sharing this one's storage, detached from the graph."""
        if _capture_hook is not None:
            read = _capture_hook(self, "t.data")   # a recording reads it again at replay
            if read is not None:
                return read
        return Tensor._wrap(self._data)

    @data.setter
    def data(self, value):
        _seen(self, "t.data = ...")
        self._data = value._data if isinstance(value, Tensor) else _to_array(value, None)
        # NOTE: counted as a write. PyTorch's backward then reads the new values through
        # some saved tensors and the old ones through others (a weight saved transposed);
        # here a graph that saved this tensor refuses instead
        _bump(self)

    @property
    def _version(self):
        """How many in-place changes this tensor's storage has had (as torch's t._version)."""
        return 0 if self._vc is None else (<_VersionCounter>self._vc).value

    cpdef _bump_version(self):
        """Count one in-place change (in-place ops and optimizers call this)."""
        _bump(self)

    # -- autograd -------------------------------------------------------------
    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Accumulate d(self)/d(leaf) * gradient into every leaf's .grad.
        With create_graph=True the gradients are themselves differentiable."""
        if retain_graph is None:
            retain_graph = create_graph
        if not self._requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        if gradient is None:
            if self._data.size != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs; this output has "
                    f"shape {self._data.shape}, so pass gradient= of that shape")
            g = np.ones(self._data.shape, dtype=self._data.dtype)
        else:
            g = _to_array(gradient, self._data.dtype)
            if g.shape != self._data.shape:
                raise ShapeError(
                    f"gradient has shape {g.shape} but the output has shape {self._data.shape}")
            if g.dtype != self._data.dtype:
                g = g.astype(self._data.dtype)
            if create_graph and isinstance(gradient, Tensor) and (<Tensor>gradient)._data is g:
                g = gradient          # keep its graph: the result may be differentiated by it
        run_backward([self], [g], bool(retain_graph), None, True, bool(create_graph))

    def detach(self):
        cdef Tensor t = Tensor._wrap(self._data)
        _share_version(t, self)
        return t

    def detach_(self):
        self._node = None
        self._requires_grad = False
        return self

    def retain_grad(self):
        """Keep .grad on this non-leaf tensor after backward."""
        _seen(self, "t.retain_grad()")
        if self._node is None:
            return
        # a weak reference: the node must not keep its own output alive (a cycle)
        self._node._retained = _weakref.ref(self)

    @property
    def retains_grad(self):
        return (self._node is not None and self._node._retained is not None
                and self._node._retained() is self)

    def register_hook(self, hook):
        """hook(grad) runs when this tensor's gradient is computed; it may return a
        replacement gradient. Returns a handle whose remove() unregisters it."""
        _seen(self, "t.register_hook()")
        if not self._requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._node is not None:
            if self._node._hooks is None:
                self._node._hooks = []
            lst = self._node._hooks
        else:
            if self._hooks is None:
                self._hooks = []
            lst = self._hooks
        lst.append(hook)
        return _HookHandle(lst, hook)

    def register_post_accumulate_grad_hook(self, hook):
        """hook(tensor) runs on a leaf once its .grad holds this backward pass's full
        gradient, while the rest of backward still runs (as in torch). Returns a handle."""
        if self._node is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if not self._requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._post_hooks is None:
            self._post_hooks = []
        self._post_hooks.append(hook)
        return _HookHandle(self._post_hooks, hook)

    # -- conversions ------------------------------------------------------------
    def to(self, *args, **kwargs):
        """t.to(dtype), t.to("cpu"), t.to(other), t.to(device, dtype, copy=...)"""
        dtype, copy = parse_to_args(args, dict(kwargs))
        if dtype is None or dtype == self._data.dtype:
            return _cast(self, self._data.dtype, True) if copy else self
        return _cast(self, dtype)

    def type(self, dtype):
        return self.to(dtype)

    def float(self):
        return self.to(float32)

    def double(self):
        return self.to(float64)

    def long(self):
        return self.to(int64)

    def int(self):
        return self.to(int32)

    def bool(self):
        return self.to(bool_)

    def cpu(self):
        return self

    def clone(self):
        return _cast(self, self._data.dtype, True)

    def __float__(self):
        _seen(self, "float(t)")
        return float(self.item())

    def __int__(self):
        _seen(self, "int(t)")
        return int(self.item())

    def __index__(self):
        _seen(self, "t used as an index (operator.index)")
        if self._data.dtype.kind not in "iu" or self._data.size != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __bool__(self):
        _seen(self, "bool(t)")
        if self._data.size != 1:
            raise RuntimeError(
                f"Boolean value of Tensor with {self._data.size} elements is ambiguous")
        return bool(self._data.reshape(()).item())

    def __len__(self):
        if self._data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._data.shape[0]

    def __iter__(self):
        _seen(self, "iteration over t")
        if self._data.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self._data.shape[0]))

    def __hash__(self):
        return id(self)

    def __deepcopy__(self, memo):
        """A new leaf with a copy of the values (and of .grad), as torch's deepcopy."""
        if self._node is not None:
            raise RuntimeError("only leaf tensors (created by the user) support deepcopy")
        cdef Tensor t = Tensor._wrap(self._data.copy())
        t._requires_grad = self._requires_grad
        if self._grad is not None:
            t._grad = Tensor._wrap((<Tensor>self._grad)._data.copy())
        if type(self) is not Tensor:
            res = type(self).__new__(type(self))
            (<Tensor>res)._data, (<Tensor>res)._requires_grad, (<Tensor>res)._grad = t._data, t._requires_grad, t._grad
            t = <Tensor>res
        memo[id(self)] = t
        return t

    def __copy__(self):
        return self.detach() if self._node is not None else self

    def __reduce__(self):
        raise TypeError("microtensor tensors are not pickled; save them with mt.save (safetensors)")

    def __format__(self, spec):
        # f"{loss:.4f}": a one-element tensor formats as its number, as in torch
        _seen(self, "format(t)")
        if self._data.ndim == 0:
            return format(self._data.item(), spec)
        return object.__format__(self, spec) if spec else repr(self)

    def __repr__(self):
        _seen(self, "repr(t) or str(t)")
        body = np.array2string(self._data, separator=", ", precision=4,
                               prefix="tensor(", threshold=200)
        extras = []
        if self._data.dtype != float32 and self._data.dtype != int64 or self._data.size == 0:
            extras.append(f"dtype=mt.{_dtype_name(self._data.dtype)}")
        if self._data.ndim > 1 or self._data.size > 6:
            extras.append(f"shape={self._data.shape}")
        if self._node is not None:
            extras.append(f"grad_fn=<{self._node.name()}>")
        elif self._requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    # -- in-place updates (no graph: for initialisers and optimisers) ----------
    cdef _check_inplace(self):
        """Every in-place op starts here: refuse a leaf that requires grad (in grad
        mode), and count the change, so backward can tell a saved tensor was modified."""
        _seen(self, "an in-place op")
        if _grad_on() and self._requires_grad:
            if self._node is None:
                raise RuntimeError(
                    "a leaf tensor that requires grad is being used in an in-place operation; "
                    "wrap it in `with mt.no_grad():` or update `t.data`")
            # NOTE: the engine records no in-place op in the graph, so going on would give
            # a silently wrong gradient: refuse instead (torch records it)
            raise RuntimeError(
                f"an in-place operation on a tensor that requires grad (made by "
                f"{self._node.name()}) is not recorded by microtensor's autograd; write it "
                f"out of place (y = y * 2 instead of y.mul_(2)) or run it under mt.no_grad()")
        if not self._data.flags.writeable:
            raise RuntimeError("this tensor's storage is read-only (an expanded or broadcast "
                               "view); clone() it before changing it in place")
        _bump(self)

    def zero_(self):
        self._check_inplace()
        self._data[...] = 0
        return self

    def fill_(self, value):
        self._check_inplace()
        self._data[...] = value
        return self

    def copy_(self, src):
        self._check_inplace()
        np.copyto(self._data, _to_array(src, None), casting="unsafe")
        return self

    def add_(self, other, alpha=1):
        self._check_inplace()
        o = _inplace_operand(other)
        if alpha != 1:
            o = o * alpha
        np.add(self._data, o, out=self._data, casting="unsafe")
        return self

    def sub_(self, other, alpha=1):
        return self.add_(other, alpha=-alpha)

    def mul_(self, other):
        self._check_inplace()
        np.multiply(self._data, _inplace_operand(other), out=self._data, casting="unsafe")
        return self

    def div_(self, other):
        self._check_inplace()
        np.divide(self._data, _inplace_operand(other), out=self._data, casting="unsafe")
        return self

    def clamp_(self, min=None, max=None):
        self._check_inplace()
        np.clip(self._data, min, max, out=self._data)
        return self

    def normal_(self, mean=0.0, std=1.0, *, generator=None):
        self._check_inplace()
        self._data[...] = _gen(generator).normal(mean, std, self._data.shape)
        return self

    def uniform_(self, a=0.0, b=1.0, *, generator=None):
        self._check_inplace()
        self._data[...] = _gen(generator).uniform(a, b, self._data.shape)
        return self

    def __setitem__(self, key, value):
        _seen(self, "t[...] = ...")
        if _grad_on() and (self._requires_grad or
                           (isinstance(value, Tensor) and (<Tensor>value)._requires_grad)):
            raise RuntimeError(
                "index assignment into a tensor that requires grad (or of a value that requires "
                "grad) is not differentiable here: microtensor's autograd records no in-place "
                "op; do it under `with mt.no_grad():` or build the tensor with mt.where / "
                "masked_fill / index_add")
        if not self._data.flags.writeable:
            raise RuntimeError("this tensor's storage is read-only (an expanded or broadcast "
                               "view); clone() it before changing it in place")
        key = _index_key(key)
        if _ints_beside_arrays(key):
            first, rest = _select_then_gather(key)     # torch's order, as getitem
            self._data[first][rest] = _to_array(value, None)
        else:
            self._data[key] = _to_array(value, None)
        _bump(self)


    # -- operations as methods (the functions live in ops/*.pxi) -----------------
    def __add__(self, other): return add(self, other)
    def __radd__(self, other): return add(other, self)
    def __sub__(self, other): return sub(self, other)
    def __rsub__(self, other): return sub(other, self)
    def __mul__(self, other): return mul(self, other)
    def __rmul__(self, other): return mul(other, self)
    def __truediv__(self, other): return div(self, other)
    def __rtruediv__(self, other): return div(other, self)
    def __pow__(self, other, mod=None): return pow(self, other)
    def __rpow__(self, other, mod=None): return pow(other, self)
    def __floordiv__(self, other): return floor_divide(self, other)
    def __rfloordiv__(self, other): return floor_divide(other, self)
    def __mod__(self, other): return remainder(self, other)
    def __rmod__(self, other): return remainder(other, self)
    def __matmul__(self, other): return matmul(self, other)
    def __rmatmul__(self, other): return matmul(other, self)
    # a += b changes a, and every view of its storage (a[1] += b writes into a), as torch
    def __iadd__(self, other): return _inplace_operator(self, other, add)
    def __isub__(self, other): return _inplace_operator(self, other, sub)
    def __imul__(self, other): return _inplace_operator(self, other, mul)
    def __itruediv__(self, other): return _inplace_operator(self, other, div)
    def __ifloordiv__(self, other): return _inplace_operator(self, other, floor_divide)
    def __imod__(self, other): return _inplace_operator(self, other, remainder)
    def __ipow__(self, other): return _inplace_operator(self, other, pow)
    def __neg__(self): return neg(self)
    def __pos__(self): return self
    def __abs__(self): return abs(self)
    def __invert__(self):
        if self._data.dtype != bool_:
            raise TypeError(f"~ works on bool tensors, got dtype {_dtype_name(self._data.dtype)}")
        return logical_not(self)
    def __and__(self, other): return logical_and(self, other)
    def __or__(self, other): return logical_or(self, other)
    def __lt__(self, other): return lt(self, other)
    def __le__(self, other): return le(self, other)
    def __gt__(self, other): return gt(self, other)
    def __ge__(self, other): return ge(self, other)
    def __eq__(self, other): return eq(self, other)
    def __ne__(self, other): return ne(self, other)
    def __getitem__(self, key): return getitem(self, key)


cdef object _inplace_operand(object other):
    """The other operand of an in-place op: a Python number stays a number (so that
    t.mul_(0.9) on a float64 tensor multiplies by 0.9, not by float32(0.9))."""
    if isinstance(other, (int, float)) and not isinstance(other, Tensor):
        return other
    return _to_array(other, None)




class _HookHandle:
    def __init__(self, lst, hook):
        self._lst = lst
        self._hook = hook

    def remove(self):
        try:
            self._lst.remove(self._hook)
        except ValueError:
            pass


class Parameter(Tensor):
    """A tensor that a Module registers as a parameter (requires grad by default)."""

    def __init__(self, data=None, requires_grad=True):
        if data is None:
            data = np.zeros(0, dtype=float32)
        Tensor.__init__(self, data._data if isinstance(data, Tensor) else data, requires_grad)

    def __repr__(self):
        return "Parameter containing:\n" + Tensor.__repr__(self)


cdef object _inplace_operator(Tensor self, object other, object op):
    """`self op= other`. Without autograd: in place, as torch (the result written into
    self's storage, so a view's base and every other view see it; the version counts one
    change; a result of a wider kind, float into an int tensor, is refused as torch does).
    With autograd (self or other requires grad, grad mode on): the engine records no
    in-place op, so the name is rebound to the out-of-place result (y += x gives the
    right gradient; a view or another name of the old y does not see the change)."""
    if _grad_on() and (self._requires_grad or
                       (isinstance(other, Tensor) and (<Tensor>other)._requires_grad)):
        if self._requires_grad and self._node is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        return op(self, other)
    with no_grad():
        r = <Tensor>op(self, other)
    kind, want = r._data.dtype.kind, self._data.dtype.kind
    if (kind == "f" and want in "iub") or (kind in "iu" and want == "b"):
        raise RuntimeError(f"result type {_dtype_name(r._data.dtype)} can't be cast to the "
                           f"desired output type {_dtype_name(self._data.dtype)}")
    if r._data.shape != self._data.shape:
        raise RuntimeError(f"output with shape {list(self._data.shape)} doesn't match the "
                           f"broadcast shape {list(r._data.shape)}")
    self.copy_(r)
    return self
