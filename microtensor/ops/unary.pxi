# Included in core/_core.pyx. The unary elementwise ops whose backward runs a Cython kernel
# (exp, log, sqrt, tanh, sigmoid, relu, abs) and clamp: one node type, UnaryBackward, told
# apart by its kernel; each op's forward, first-order backward and create-graph rule here.

# ---- unary ops with a Cython backward kernel -----------------------------------------

cdef inline object _float_data(Tensor t, str op):
    """Float ops on an integer (or bool) tensor compute in float32, as torch does; a
    complex tensor is refused (casting it would drop the imaginary part unsaid)."""
    d = t._data
    if d.dtype.kind == "f":
        return d
    if d.dtype.kind not in "biu":
        raise TypeError(f"{op}: tensors of dtype {_dtype_name(d.dtype)} are not supported "
                        f"(float, integer or bool)")
    return d.astype(float32)


cdef inline object _kernel_float(object dt, str op):
    """The float type the Cython kernels run in for data of dtype dt: float32 and float64
    as they are, float16 in float32 (rounded back to float16 after, as torch computes
    half precision on the CPU). Any other dtype: a TypeError that names it."""
    if dt == float32 or dt == float64:
        return dt
    if dt == np.float16:
        return float32
    raise TypeError(f"{op}: no kernel for dtype {_dtype_name(dt)} "
                    f"(float16, float32 or float64)")


cdef inline object _flat(object a):
    return _contig(a).reshape(-1)


# The create-graph rules of the unary ops (UnaryBackward.create_graph picks one by kernel).
# exp, sqrt, tanh and sigmoid save their output y: their rules read y (the saved values,
# as a tensor whose graph leads back to x), never x, which may have changed in place since
# the forward pass
def _unary_exp(y, g):
    return mul(g, y)                                             # dx = g * y,  y = e^x


def _unary_sqrt(y, g):
    return div(g, mul(y, 2.0))                                 # dx = g / (2 y)


def _unary_tanh(y, g):
    return mul(g, sub(1.0, mul(y, y)))                       # dx = g (1 - y^2)


def _unary_sigmoid(y, g):
    return mul(g, mul(y, sub(1.0, y)))                       # dx = g y (1 - y)


# log, relu and abs save their input x
def _unary_log(x, g):
    return div(g, x)                                             # dx = g / x


def _unary_relu(x, g):
    return where(x._data > 0, g, 0.0)                            # dx = g (x > 0)


def _unary_abs(x, g):
    return mul(g, _const(np.sign(x._data), g.dtype))             # dx = g sign(x)


_FROM_OUTPUT = {"exp_backward": _unary_exp, "sqrt_backward": _unary_sqrt,
                "tanh_backward": _unary_tanh, "sigmoid_backward": _unary_sigmoid}
_FROM_INPUT = {"log_backward": _unary_log, "relu_backward": _unary_relu,
               "abs_backward": _unary_abs}


cdef class UnaryBackward(Node):
    """Shared shape of the elementwise nodes: `saved` is x or y, `kernel` the rule."""
    cdef readonly object saved
    cdef readonly object kernel

    cpdef tuple backward(self, g):
        saved = self.saved
        work = _kernel_float(saved.dtype, self.name())
        dinp = np.empty(saved.shape, dtype=work)
        self.kernel(dinp.reshape(-1), _flat(np.asarray(g, dtype=work)),
                    _flat(saved.astype(work, copy=False)))
        return (dinp if work == saved.dtype else dinp.astype(saved.dtype),)

    cpdef release(self):
        self.saved = None

    def name(self):
        return self.kernel.__name__.split("_")[0].capitalize() + "Backward"

    def create_graph(self, g):
        """exp, log, sqrt, tanh, sigmoid, relu, abs: one core self type, told apart by kernel"""
        name = self.kernel.__name__
        if name in _FROM_OUTPUT:
            return (_FROM_OUTPUT[name](unary_saved_output(self), g),)
        if name in _FROM_INPUT:
            return (_FROM_INPUT[name](self.inputs[0], g),)
        raise RuntimeError(f"{self.name()} (kernel {name}) has no create_graph rule "
                           "(_FROM_OUTPUT / _FROM_INPUT in ops/unary.pxi)")


def unary_saved_output(UnaryBackward node):
    """The output an exp/sqrt/tanh/sigmoid node saved, as a tensor whose graph leads back
    to the node's input through the same rule. Create-graph rules read it (as PyTorch
    does) instead of recomputing it from an input that may have changed in place since."""
    if node.saved is None:
        raise RuntimeError(f"{node.name()}: its saved output has already been freed")
    cdef Tensor res = Tensor._wrap(node.saved)
    cdef UnaryBackward again
    inp = node.inputs[0] if node.inputs else None
    if _grad_on() and inp is not None and (<Tensor>inp)._requires_grad:
        again = UnaryBackward.__new__(UnaryBackward)
        again.kernel, again.saved = node.kernel, node.saved
        again._saves = SAVES_OUTPUT
        _attach(res, again, (inp,))
    return res


cdef inline Tensor _unary_result(Tensor t, object out, object kernel, object saved):
    cdef Tensor res = Tensor._wrap(out)
    cdef UnaryBackward node
    if _grad_on() and t._requires_grad:
        node = UnaryBackward.__new__(UnaryBackward)
        node.kernel = kernel
        node.saved = saved
        node._saves = SAVES_OUTPUT if saved is out else 1
        _attach(res, node, (t,))
    return res


def exp(x):
    """y = e^x;  dx = g * y"""
    cdef Tensor t = _t(x)
    out = np.exp(_float_data(t, "exp"))
    return _unary_result(t, out, exp_backward, out)


def log(x):
    """y = ln x;  dx = g / x"""
    cdef Tensor t = _t(x)
    d = _float_data(t, "log")
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(d)
    return _unary_result(t, out, log_backward, d)


def sqrt(x):
    """y = sqrt(x);  dx = g / (2y)"""
    cdef Tensor t = _t(x)
    with np.errstate(invalid="ignore"):
        out = np.sqrt(_float_data(t, "sqrt"))
    return _unary_result(t, out, sqrt_backward, out)


def tanh(x):
    """y = tanh x;  dx = g * (1 - y^2)"""
    cdef Tensor t = _t(x)
    out = np.tanh(_float_data(t, "tanh"))
    return _unary_result(t, out, tanh_backward, out)


def sigmoid(x):
    """y = 1 / (1 + e^-x);  dx = g * y * (1 - y)"""
    cdef Tensor t = _t(x)
    d = _contig(_float_data(t, "sigmoid"))
    work = _kernel_float(d.dtype, "sigmoid")
    out = np.empty(d.shape, dtype=work)
    sigmoid_forward(out.reshape(-1), d.astype(work, copy=False).reshape(-1))
    if work != d.dtype:
        out = out.astype(d.dtype)
    return _unary_result(t, out, sigmoid_backward, out)


def relu(x):
    """y = max(x, 0);  dx = g * (x > 0)"""
    cdef Tensor t = _t(x)
    d = t._data
    if d.dtype.kind in "iu":
        return Tensor._wrap(np.maximum(d, 0))
    if d.dtype.kind != "f":                               # bool and complex, as torch
        raise TypeError(f"relu: tensors of dtype {_dtype_name(d.dtype)} are not supported "
                        f"(float or integer)")
    d = _contig(d)
    work = _kernel_float(d.dtype, "relu")
    out = np.empty(d.shape, dtype=work)
    relu_forward(out.reshape(-1), d.astype(work, copy=False).reshape(-1))
    if work != d.dtype:
        out = out.astype(d.dtype)
    return _unary_result(t, out, relu_backward, d)


def abs(x):
    """y = |x|;  dx = g * sign(x)"""
    cdef Tensor t = _t(x)
    d = t._data
    if d.dtype == bool_:                                  # as torch
        raise TypeError("abs: tensors of dtype bool are not supported (float or integer)")
    out = np.abs(d)
    if d.dtype.kind != "f":
        return Tensor._wrap(out)
    return _unary_result(t, out, abs_backward, d)


cdef class ClampBackward(Node):
    """y = min(max(x, lo), hi);  dx = g where lo <= x <= hi"""
    cdef readonly object x
    cdef readonly double lo, hi
    cpdef tuple backward(self, g):
        x = self.x
        work = _kernel_float(x.dtype, "ClampBackward")
        dinp = np.empty(x.shape, dtype=work)
        clamp_backward(dinp.reshape(-1), _flat(np.asarray(g, dtype=work)),
                       _flat(x.astype(work, copy=False)), self.lo, self.hi)
        return (dinp if work == x.dtype else dinp.astype(x.dtype),)

    cpdef release(self):
        self.x = None

    def create_graph(self, g):
        """y = clamp(x, lo, hi);  dx = g where lo <= x <= hi"""
        x = self.x
        return (where((x >= self.lo) & (x <= self.hi), g, 0.0),)


def clamp(x, min=None, max=None):
    cdef Tensor t = _t(x)
    if min is None and max is None:
        raise ArgumentError("clamp: at least one of 'min' or 'max' must not be None")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        # tensor bounds: compose from where() so gradients reach them too
        out = x
        if min is not None:
            out = where(lt(out, min), min, out)
        if max is not None:
            out = where(gt(out, max), max, out)
        return out
    d = t._data
    out = np.clip(d, min, max)
    cdef Tensor res = Tensor._wrap(out)
    cdef ClampBackward node
    if _grad_on() and t._requires_grad:
        node = ClampBackward.__new__(ClampBackward)
        node.x = d
        node.lo = -np.inf if min is None else min
        node.hi = np.inf if max is None else max
        _attach(res, node, (t,))
    return res


# which tensors each rule reads in backward (version checks)
declare_saved(ClampBackward, 0)


# the registry rows of this file: mt.<name>, t.<name>() and the operator (core/registry.pxi)
register_op("exp", exp, kind="pointwise")
register_op("log", log, kind="pointwise")
register_op("sqrt", sqrt, kind="pointwise")
register_op("tanh", tanh, kind="pointwise")
register_op("sigmoid", sigmoid, kind="pointwise")
register_op("relu", relu, kind="pointwise")
register_op("abs", abs, operator="abs()", kind="pointwise")
register_op("clamp", clamp, kind="pointwise")
register_op("clip", clamp, kind="pointwise")
