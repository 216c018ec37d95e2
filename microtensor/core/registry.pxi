# The op registry: one row per op. A row makes the op's `mt.` function and its Tensor
# method, names the operator Python spells it with (if any), and is what the op tests
# read. Rows sit beside their rules: `register_op("exp", exp)` closes ops/pointwise.pxi,
# `register_op("cumsum", cumsum)` sits under cumsum in ops/extra.py.
#
# A method is installed in the Tensor class's own dictionary, so `t.exp()` is found by
# the ordinary attribute lookup (no fallback, no wrapper): adding an op never needs a
# method written by hand in core/tensor.pxi, nor a rebuild for ops written in Python.
# Operators (+, @, <, ...) are the class's number and comparison slots, which C fills
# from the class body: they stay in core/tensor.pxi as one line each, calling the op the
# row names (test_registry.py checks that they do).

import sys as _sys
from cpython.object cimport PyTypeObject

cdef extern from "Python.h":
    void PyType_Modified(PyTypeObject* type)


# The op classes a row names: what the capture and the compiler read to know what an op
# does to its operands' elements.
KINDS = ("pointwise",   # each output element from the same-index input elements
         "reduction",   # fewer elements out, over some dims (sum, cumsum, sort's values)
         "shape",       # the same elements, another shape or order (views, cat, flip)
         "index",       # elements chosen by an index (gather, scatter, nonzero)
         "matmul",      # products over a shared dim (matmul, mm, einsum)
         "fused",       # several of the above in one kernel (softmax, layer_norm)
         "creation",    # new tensors from shapes or values (eye, zeros_like)
         "random",      # draws from a generator (bernoulli, normal)
         "inplace")     # changes its tensor (masked_fill_, exp_)


# Where an op is called from besides mt.<name>: "" (mt itself, and Tensor methods), "F"
# (torch.nn.functional's ops, as mt.nn.functional.<name>), "linalg" (mt.linalg.<name>).
SCOPES = ("", "F", "linalg")


class OpRow:
    """One registered op: `function` is `mt.<name>` (when `export`), `method` is what
    `t.<name>(...)` calls with t first (None: no method), `operator` the symbol Python
    spells it with, `kind` its class (one of KINDS), `module` where its rule lives, and
    `scope` where else it is called from ("F": it is F.<name>; "linalg": mt.linalg.<name>).
    `label` names it as the profiler and mt.compile's plans do: "F.gelu", "exp"."""
    __slots__ = ("name", "function", "method", "operator", "export", "module", "kind", "scope")

    def __init__(self, name, function, method, operator, export, module, kind, scope):
        self.name, self.function, self.method = name, function, method
        self.operator, self.export, self.module = operator, export, module
        self.kind, self.scope = kind, scope

    @property
    def label(self):
        return f"{self.scope}.{self.name}" if self.scope else self.name

    def __repr__(self):
        extra = f", operator {self.operator!r}" if self.operator else ""
        return f"<op {self.label} ({self.kind}) from {self.module}{extra}>"


cdef dict _registry = {}


def register_op(name, function, method=True, operator=None, export=True, *, kind, scope=""):
    """Register the op `name` of class `kind` (one of KINDS): `mt.name` is `function`
    (unless export=False), and `t.name(*args)` calls `method(t, *args)` (method=True: the
    function itself, whose first argument is the tensor; a callable: that callable, for
    ops whose method takes its arguments in another order; False: no method). With a
    `scope` ("F", "linalg"), the row is that scope's function only (F.<name>): no mt.
    function, no method. Returns `function`, so it also works as a decorator's body."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_op: the name must be an identifier, got {name!r}")
    if kind not in KINDS:
        raise ValueError(f"register_op({name!r}): kind must be one of {', '.join(KINDS)}; "
                         f"got {kind!r}")
    if scope not in SCOPES:
        raise ValueError(f"register_op({name!r}): scope must be one of {SCOPES}; got {scope!r}")
    if not callable(function):
        raise TypeError(f"register_op({name!r}): the function must be callable, "
                        f"got {type(function).__name__}")
    if scope:
        if operator is not None or method not in (True, False, None):
            raise ValueError(f"register_op({name!r}, scope={scope!r}): a scoped row has no "
                             "method and no operator")
        method, export = None, False
    label = f"{scope}.{name}" if scope else name
    if label in _registry:
        raise ValueError(f"register_op: {label!r} is registered already "
                         f"(by {_registry[label].module})")
    if method is True:
        method = function
    elif method is False or method is None:
        method = None
    elif not callable(method):
        raise TypeError(f"register_op({name!r}): method must be True, False or a callable")
    # check everything before changing anything: a refused row leaves no trace
    if method is not None and any(name in k.__dict__ for k in Tensor.__mro__):
        raise ValueError(f"Tensor already has an attribute {name!r}")
    if export:
        _check_export(name, function)
    if method is not None:
        _install_method(name, method)
    module = getattr(function, "__module__", None) or "microtensor.core._core"
    if export:
        _export(name, function)
    _registry[label] = OpRow(name, function, method, operator, bool(export), module, kind, scope)
    return function


def register_ops(kind, namespace, names, method=True, export=True, scope=""):
    """One row of class `kind` for each op in `names` (separated by spaces), each the
    function of that name in `namespace` (the family module's globals()): the block a
    family written in Python closes with. `method`, `export` and `scope` as for
    register_op."""
    if not isinstance(names, str):
        raise TypeError(f"register_ops: names must be a string of names, got {type(names).__name__}")
    for name in names.split():
        if name not in namespace:
            raise KeyError(f"register_ops({kind!r}): no function {name!r} in the namespace given")
        register_op(name, namespace[name], method=method, export=export, kind=kind, scope=scope)


cdef _check_export(str name, object function):
    package = _sys.modules.get("microtensor")
    present = None if package is None else package.__dict__.get(name)
    if present is not None and present is not function:
        raise ValueError(f"register_op: mt.{name} exists already ({present!r})")


cdef _export(str name, object function):
    """Make `function` the package's `mt.<name>` (the package may still be importing:
    the core's own rows run while `microtensor/__init__.py` imports the core)."""
    package = _sys.modules.get("microtensor")
    if package is not None:
        setattr(package, name, function)


cdef _install_method(str name, object fn):
    """Put fn in Tensor's class dictionary as the method `name`."""
    if name in Tensor.__dict__:
        raise ValueError(f"Tensor already has an attribute {name!r}")
    if not hasattr(fn, "__get__"):
        # a builtin (a numpy function, say) does not bind to the instance: wrap it
        inner = fn
        fn = lambda self, *args, **kwargs: inner(self, *args, **kwargs)
    (<dict>(<PyTypeObject*>Tensor).tp_dict)[name] = fn
    PyType_Modified(<PyTypeObject*>Tensor)


def registered_ops(kind=None):
    """The registered ops, in the order they were registered (those of class `kind` only,
    when given)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"registered_ops: kind must be one of {', '.join(KINDS)}; got {kind!r}")
    return [row for row in _registry.values() if kind is None or row.kind == kind]


def register_tensor_method(name, fn, *, kind):
    """A Tensor method that is not an `mt.` function (`t.new_zeros`, `t.masked_fill_`):
    a registry row with export=False."""
    return register_op(name, fn, export=False, kind=kind)


def registered_tensor_methods():
    """The names of the methods the registry installed."""
    return sorted(name for name, row in _registry.items() if row.method is not None)


def replace_tensor_method(name, fn):
    """Swap the Tensor method `name` (a registered op's, or one of the class's own, such
    as clone or add_) for fn and return the one it replaces: for tools that wrap ops for
    a while (the profiler, mt.compile's recording), which put the original back after."""
    row = _registry.get(name)
    if row is None or row.method is None:
        own = Tensor.__dict__.get(name)
        if own is None or isinstance(own, (property, _types.GetSetDescriptorType)) \
                or not callable(own) or name.startswith("__"):
            raise KeyError(f"no Tensor method {name!r} to replace")
    previous = (<dict>(<PyTypeObject*>Tensor).tp_dict)[name]
    (<dict>(<PyTypeObject*>Tensor).tp_dict)[name] = fn
    PyType_Modified(<PyTypeObject*>Tensor)
    return previous


def op_function(name):
    """The function of the registered op `name` (mt.<name>), for code below the layer
    that registers it (an engine-level rule calling nn's fused softmax, say)."""
    row = _registry.get(name)
    if row is None:
        raise KeyError(f"no registered op {name!r}")
    return row.function
