# Comparisons and logic: elementwise ops with bool results and no gradient (the ops
# with a gradient are in ops/pointwise.pxi).

# ---- comparisons ------------------------------------------------------------------

cdef Tensor _compare(object ufunc, object a, object b, str op):
    x, y = _operand(a), _operand(b)
    try:
        return Tensor._wrap(np.asarray(ufunc(x, y)))
    except ValueError:
        raise _broadcast_error(op, x, y) from None


def lt(a, b): return _compare(np.less, a, b, "<")
def le(a, b): return _compare(np.less_equal, a, b, "<=")
def gt(a, b): return _compare(np.greater, a, b, ">")
def ge(a, b): return _compare(np.greater_equal, a, b, ">=")
def eq(a, b): return _compare(np.equal, a, b, "==")
def ne(a, b): return _compare(np.not_equal, a, b, "!=")


def logical_not(x):
    return Tensor._wrap(np.logical_not(_operand(x)))


def logical_and(a, b): return _compare(np.logical_and, a, b, "&")
def logical_or(a, b): return _compare(np.logical_or, a, b, "|")


def isnan(x):
    return Tensor._wrap(np.isnan(_t(x)._data))


def isfinite(x):
    return Tensor._wrap(np.isfinite(_t(x)._data))


# the registry rows of this file: mt.<name>, t.<name>() and the operator (core/registry.pxi)
register_op("lt", lt, operator="<", kind="pointwise")
register_op("le", le, operator="<=", kind="pointwise")
register_op("gt", gt, operator=">", kind="pointwise")
register_op("ge", ge, operator=">=", kind="pointwise")
register_op("eq", eq, operator="==", kind="pointwise")
register_op("ne", ne, operator="!=", kind="pointwise")
register_op("logical_not", logical_not, operator="~", kind="pointwise")
register_op("logical_and", logical_and, operator="&", kind="pointwise")
register_op("logical_or", logical_or, operator="|", kind="pointwise")
register_op("isnan", isnan, kind="pointwise")
register_op("isfinite", isfinite, kind="pointwise")
