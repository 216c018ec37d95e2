# Elementwise ops: each Backward node (the rule) sits right above its forward function.
# A rule returns its gradients in the broadcast (output) shape: the engine sums each down
# to its input's shape (core/broadcast.pxi, _as_grad_array), once for every rule.


cdef inline object _operand(object x):
    """The array (or weak Python scalar) behind an operand."""
    if isinstance(x, Tensor):
        return (<Tensor>x)._data
    if isinstance(x, (int, float, bool)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    return _to_array(x, None)


cdef inline bint _strong_f64(object x, object y):
    """Does x force a float64 result? (torch: a 0-d tensor or a scalar does not
    outrank a dimensioned float tensor.)"""
    if not isinstance(x, np.ndarray) or x.dtype != float64:
        return False
    if x.ndim > 0:
        return True
    return not (isinstance(y, np.ndarray) and y.ndim > 0 and y.dtype.kind == "f")


cdef inline object _promote(object out, object a, object b):
    if out.dtype == float64 and not (_strong_f64(a, b) or _strong_f64(b, a)):
        return out.astype(float32)
    return out


cdef inline object _shape_of(object x):
    return x.shape if isinstance(x, np.ndarray) else ()


def _broadcast_error(op, a, b):
    return ShapeError(
        f"{op}: shapes {tuple(_shape_of(a))} and {tuple(_shape_of(b))} cannot be broadcast "
        "together (sizes must match or be 1, aligned from the last dimension)")


cdef inline Tensor _binary_result(object out, object ta, object tb, Node node):
    cdef Tensor res = Tensor._wrap(out)
    cdef tuple inputs = (ta if isinstance(ta, Tensor) else None,
                         tb if isinstance(tb, Tensor) else None)
    if _needs_graph(inputs):
        _attach(res, node, inputs)
    return res


cdef class AddBackward(Node):
    """y = a + b;  da = g,  db = g"""
    cpdef tuple backward(self, g):
        return (g, g)

    def create_graph(self, g):
        """y = a + b;  da = g,  db = g"""
        return (g if _wants(self, 0) else None, g if _wants(self, 1) else None)


def add(a, b, alpha=1):
    if alpha != 1:
        b = mul(b, alpha)
    x, y = _operand(a), _operand(b)
    try:
        out = _promote(np.add(x, y), x, y)
    except ValueError:
        raise _broadcast_error("add", x, y) from None
    return _binary_result(out, a, b, AddBackward.__new__(AddBackward))


cdef class SubBackward(Node):
    """y = a - b;  da = g,  db = -g"""
    cpdef tuple backward(self, g):
        return (g, np.negative(g) if self.inputs[1] is not None else None)

    def create_graph(self, g):
        """y = a - b;  da = g,  db = -g"""
        return (g if _wants(self, 0) else None, neg(g) if _wants(self, 1) else None)


def sub(a, b, alpha=1):
    if alpha != 1:
        b = mul(b, alpha)
    x, y = _operand(a), _operand(b)
    try:
        out = _promote(np.subtract(x, y), x, y)
    except ValueError:
        raise _broadcast_error("sub", x, y) from None
    except TypeError:
        raise TypeError("subtraction of bool tensors is not supported; use logical ops") from None
    return _binary_result(out, a, b, SubBackward.__new__(SubBackward))


cdef class MulBackward(Node):
    """y = a * b;  da = g * b,  db = g * a"""
    cdef readonly object a, b
    cpdef tuple backward(self, g):
        da = db = None
        if self.inputs[0] is not None:
            da = g * self.b
        if self.inputs[1] is not None:
            db = g * self.a
        return (da, db)

    cpdef release(self):
        self.a = self.b = None

    def create_graph(self, g):
        """y = a * b;  da = g * b,  db = g * a"""
        a, b = _live(self, 0, self.a), _live(self, 1, self.b)
        return (mul(g, b) if _wants(self, 0) else None,
                mul(g, a) if _wants(self, 1) else None)


def mul(a, b):
    x, y = _operand(a), _operand(b)
    try:
        out = _promote(np.multiply(x, y), x, y)
    except ValueError:
        raise _broadcast_error("mul", x, y) from None
    cdef MulBackward node = MulBackward.__new__(MulBackward)
    node.a, node.b = x, y
    return _binary_result(out, a, b, node)


cdef class DivBackward(Node):
    """y = a / b;  da = g / b,  db = -g * a / b^2"""
    cdef readonly object a, b
    cpdef tuple backward(self, g):
        db = None
        ga = g / self.b
        if self.inputs[1] is not None:
            db = -ga * self.a / self.b
        return (ga, db)

    cpdef release(self):
        self.a = self.b = None

    def create_graph(self, g):
        """y = a / b;  da = g / b,  db = -(g / b) * a / b"""
        a, b = _live(self, 0, self.a), _live(self, 1, self.b)
        ga = div(g, b)
        return (ga if _wants(self, 0) else None,
                neg(div(mul(ga, a), b)) if _wants(self, 1) else None)


def div(a, b):
    x, y = _operand(a), _operand(b)
    try:
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.true_divide(x, y)
    except ValueError:
        raise _broadcast_error("div", x, y) from None
    out = _promote(out, x, y)
    cdef DivBackward node = DivBackward.__new__(DivBackward)
    node.a, node.b = x, y
    return _binary_result(out, a, b, node)


cdef class PowBackward(Node):
    """y = a ** b;  da = g * b * a^(b-1),  db = g * y * log(a)"""
    cdef readonly object a, b, out
    cpdef tuple backward(self, g):
        da = db = None
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.inputs[0] is not None:
                if isinstance(self.b, (int, float)):
                    # NOTE: x**0 has gradient 0 everywhere, also at x = 0 (not 0 * inf) and
                    # whatever the upstream gradient (as torch)
                    if self.b != 0:
                        da = g * (self.b * np.power(self.a, self.b - 1))
                    else:
                        da = np.zeros(np.shape(self.a), dtype=g.dtype)
                else:
                    da = np.where(self.b == 0, 0, g * (self.b * np.power(self.a, self.b - 1)))
                    da = da.astype(g.dtype, copy=False)
            if self.inputs[1] is not None:
                # d/de x**e at x = 0 (e >= 0) is 0, as in torch, not 0 * log(0)
                db = np.where((self.a == 0) & (self.b >= 0), 0, g * (self.out * np.log(self.a)))
                db = db.astype(g.dtype, copy=False)
        return (da, db)

    cpdef release(self):
        self.a = self.b = self.out = None

    def create_graph(self, g):
        """y = a ** b;  da = g * b * a^(b-1),  db = g * a^b * log(a)"""
        a, b = _live(self, 0, self.a), _live(self, 1, self.b)
        dtype = g.dtype
        da = db = None
        if _wants(self, 0):
            if isinstance(self.b, (int, float)):
                # NOTE: x**0 has gradient 0 everywhere, also at x = 0 (not 0 * inf)
                da = mul(g, mul(pow(a, self.b - 1), self.b)) if self.b != 0 else mul(g, 0.0)
            else:
                local = where(self.b == 0, 0.0, mul(b, pow(a, sub(b, 1.0))))
                da = mul(g, local)
        if _wants(self, 1):
            # d/de x**e at x = 0 (e >= 0) is 0, as in torch; log(1) stands in for log(0) there,
            # so the masked branch stays finite in every later derivative too
            zero = (np.asarray(self.a) == 0) & (np.asarray(self.b) >= 0)
            if isinstance(a, Tensor):
                log_a = log(where(zero, 1.0, a))
            else:                       # a constant base: its log is a constant
                with np.errstate(divide="ignore", invalid="ignore"):
                    log_a = _const(np.log(np.where(zero, 1.0, self.a)), dtype)
            local = where(zero, 0.0, mul(pow(a, b), log_a))
            db = mul(g, local)
        return (da, db)


def pow(a, exponent):
    b = exponent
    x, y = _operand(a), _operand(b)
    try:
        with np.errstate(divide="ignore", invalid="ignore"):
            if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and isinstance(y, int) and y < 0:
                raise ValueError("Integers to negative integer powers are not allowed.")
            out = _promote(np.power(x, y), x, y)
    except ValueError as e:
        if "broadcast" in str(e):
            raise _broadcast_error("pow", x, y) from None
        raise
    cdef PowBackward node = PowBackward.__new__(PowBackward)
    node.a, node.b, node.out = x, y, out
    return _binary_result(out, a, b, node)


cdef class NegBackward(Node):
    """y = -x;  dx = -g"""
    cpdef tuple backward(self, g):
        return (np.negative(g),)

    def create_graph(self, g):
        """y = -x;  dx = -g"""
        return (neg(g),)


def neg(x):
    cdef Tensor t = _t(x)
    if t._data.dtype == bool_:
        raise TypeError("negation of a bool tensor is not supported; use ~ or logical_not")
    cdef Tensor out = Tensor._wrap(np.negative(t._data))
    if _grad_on() and t._requires_grad:
        _attach(out, NegBackward.__new__(NegBackward), (t,))
    return out


# ---- selection -------------------------------------------------------------------

cdef class WhereBackward(Node):
    """y = cond ? a : b;  da = g * cond,  db = g * !cond"""
    cdef readonly object cond
    cpdef tuple backward(self, g):
        da = db = None
        if self.inputs[0] is not None:
            da = np.where(self.cond, g, 0)
        if self.inputs[1] is not None:
            db = np.where(self.cond, 0, g)
        return (da, db)

    cpdef release(self):
        self.cond = None

    def create_graph(self, g):
        """y = cond ? a : b;  da = g * cond,  db = g * !cond"""
        return (where(self.cond, g, 0.0) if _wants(self, 0) else None,
                where(self.cond, 0.0, g) if _wants(self, 1) else None)


def where(condition, input=None, other=None):
    """Elements of `input` where `condition` is True, else of `other`."""
    c = _operand(condition)
    if input is None and other is None:
        capture_read(condition, "mt.where(condition) (a shape read from the values)")
        return tuple(Tensor._wrap(np.ascontiguousarray(i)) for i in np.nonzero(c))
    if not isinstance(c, np.ndarray) or c.dtype != bool_:
        c = np.asarray(c).astype(bool_)
    x, y = _operand(input), _operand(other)
    try:
        out = np.where(c, x, y)
    except ValueError:
        raise ShapeError(
            f"where: condition {c.shape}, input {tuple(_shape_of(x))} and other "
            f"{tuple(_shape_of(y))} cannot be broadcast together") from None
    out = _promote(out, x, y)
    # a Python scalar takes the tensor's dtype
    if isinstance(x, np.ndarray) and not isinstance(y, np.ndarray) and x.dtype.kind == "f":
        out = out.astype(x.dtype, copy=False)
    elif isinstance(y, np.ndarray) and not isinstance(x, np.ndarray) and y.dtype.kind == "f":
        out = out.astype(y.dtype, copy=False)
    cdef WhereBackward node = WhereBackward.__new__(WhereBackward)
    node.cond = c
    return _binary_result(out, input, other, node)


def masked_fill(x, mask, value):
    """`value` where `mask` is True, else x (gradient flows where mask is False)."""
    cdef Tensor t = _t(x)
    m = _operand(mask)
    if not isinstance(m, np.ndarray) or m.dtype != bool_:
        raise TypeError(f"masked_fill: mask must be a bool tensor, got "
                        f"{_dtype_name(m.dtype) if isinstance(m, np.ndarray) else type(mask).__name__}")
    try:
        shape = np.broadcast_shapes(m.shape, t._data.shape)
    except ValueError:
        raise ShapeError(f"masked_fill: mask of shape {m.shape} does not broadcast to "
                         f"the tensor's shape {t._data.shape}") from None
    if shape != t._data.shape:
        raise ShapeError(f"masked_fill: mask of shape {m.shape} does not broadcast to "
                         f"the tensor's shape {t._data.shape}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError("masked_fill only supports a 0-dimensional value tensor")
        value = value.item()
    out = np.where(m, np.asarray(value, dtype=t._data.dtype), t._data)
    cdef WhereBackward node = WhereBackward.__new__(WhereBackward)
    node.cond = ~m
    return _binary_result(out, t, None, node)


# ---- dtype casts -----------------------------------------------------------------

cdef class CastBackward(Node):
    """y = x.to(dtype);  dx = g.to(x.dtype)"""
    cdef readonly object dtype
    cpdef tuple backward(self, g):
        return (g.astype(self.dtype),)

    def create_graph(self, g):
        """y = x.to(dtype);  dx = g.to(x.dtype)"""
        return (_cast(g, self.dtype),)


def _cast(x, dtype, bint copy=False):
    cdef Tensor t = _t(x)
    cdef Tensor res = Tensor._wrap(t._data.astype(dtype, copy=True))
    cdef CastBackward node
    if _grad_on() and t._requires_grad and np.dtype(dtype).kind == "f":
        node = CastBackward.__new__(CastBackward)
        node.dtype = t._data.dtype
        _attach(res, node, (t,))
    return res


def floor_divide(a, b):
    """a // b, rounding toward -inf (torch's floor_divide / `//`); no gradient."""
    x, y = _operand(a), _operand(b)
    try:
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.floor_divide(x, y)
    except ValueError:
        raise _broadcast_error("floor_divide", x, y) from None
    if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and isinstance(y, np.ndarray) \
            and y.dtype.kind in "iu" and (y == 0).any():
        raise ZeroDivisionError("integer division by zero in floor_divide")
    return Tensor._wrap(np.asarray(_promote(out, x, y)))


def remainder(a, b):
    """a % b with the sign of b (Python's and torch's);  da = g,  db = -g * floor(a / b)"""
    x, y = _operand(a), _operand(b)
    is_float = (isinstance(x, np.ndarray) and x.dtype.kind == "f") or \
               (isinstance(y, np.ndarray) and y.dtype.kind == "f") or \
               isinstance(x, float) or isinstance(y, float)
    if not is_float:
        q = floor_divide(a, b)
        return sub(a, mul(q, b))
    with no_grad():
        q = floor_divide(a, b)
    return sub(a, mul(q, b))


# which tensors each rule reads in backward (version checks)
declare_saved(AddBackward)
declare_saved(SubBackward)
declare_saved(NegBackward)
declare_saved(MulBackward, 0, 1)
declare_saved(DivBackward, 0, 1)
declare_saved(PowBackward, 0, 1, output=True)
declare_saved(WhereBackward)
declare_saved(CastBackward)


# the registry rows of this file: mt.<name>, t.<name>() and the operator (core/registry.pxi)
register_op("add", add, operator="+", kind="pointwise")
register_op("sub", sub, operator="-", kind="pointwise")
register_op("mul", mul, operator="*", kind="pointwise")
register_op("div", div, operator="/", kind="pointwise")
register_op("pow", pow, operator="**", kind="pointwise")
register_op("neg", neg, operator="unary -", kind="pointwise")
register_op("floor_divide", floor_divide, operator="//", kind="pointwise")
register_op("remainder", remainder, operator="%", kind="pointwise")
register_op("where", where, method=lambda self, condition, other: where(condition, self, other), kind="pointwise")
register_op("masked_fill", masked_fill, kind="pointwise")
