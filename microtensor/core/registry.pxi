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


# What an op's result is to its input's memory, as torch's documentation says of the same
# op (tests/test_views_and_copies.py writes through every row's result and into its input
# and compares with torch). A view shares its base's version counter, so a write through
# either one is seen by a graph that saved the other.
ALIASINGS = ("view",          # shares the input's memory, always (transpose, narrow, diagonal)
             "copy",          # new memory, always (exp, flip, repeat, cat)
             "view_or_copy",  # a view when the strides allow, else a copy (reshape, x[key])
             "inplace",       # writes into its tensor and returns it (exp_, masked_fill_)
             "none")          # returns no tensor: a bool, a number, a tuple of ints


# Where an op is called from besides mt.<name>: "" (mt itself, and Tensor methods), "F"
# (torch.nn.functional's ops, as mt.nn.functional.<name>), "linalg" (mt.linalg.<name>).
SCOPES = ("", "F", "linalg")


class OpRow:
    """One registered op: `function` is `mt.<name>` (when `export`), `method` is what
    `t.<name>(...)` calls with t first (None: no method), `operator` the symbol Python
    spells it with, `kind` its class (one of KINDS), `module` where its rule lives, and
    `scope` where else it is called from ("F": it is F.<name>; "linalg": mt.linalg.<name>).
    `aliasing` what its result is to its input's memory (one of ALIASINGS: "view", "copy",
    ...). `label` names it as the profiler and mt.compile's plans do: "F.gelu", "exp"."""
    __slots__ = ("name", "function", "method", "operator", "export", "module", "kind", "scope",
                 "aliasing")

    def __init__(self, name, function, method, operator, export, module, kind, scope, aliasing):
        self.name, self.function, self.method = name, function, method
        self.operator, self.export, self.module = operator, export, module
        self.kind, self.scope, self.aliasing = kind, scope, aliasing

    @property
    def label(self):
        return f"{self.scope}.{self.name}" if self.scope else self.name

    def __repr__(self):
        extra = f", operator {self.operator!r}" if self.operator else ""
        return f"<op {self.label} ({self.kind}, {self.aliasing}) from {self.module}{extra}>"


cdef dict _registry = {}


def register_op(name, function, method=True, operator=None, export=True, *, kind, scope="",
                aliasing=None):
    """Register the op `name` of class `kind` (one of KINDS): `mt.name` is `function`
    (unless export=False), and `t.name(*args)` calls `method(t, *args)` (method=True: the
    function itself, whose first argument is the tensor; a callable: that callable, for
    ops whose method takes its arguments in another order; False: no method). With a
    `scope` ("F", "linalg"), the row is that scope's function only (F.<name>): no mt.
    function, no method. `aliasing` (one of ALIASINGS) says whether its result is a view
    of its input, as torch's same op; unsaid, an "inplace" row is "inplace" and any other
    a "copy" (so a view op must say "view"). Returns `function`, so it also works as a
    decorator's body."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_op: the name must be an identifier, got {name!r}")
    if kind not in KINDS:
        raise ValueError(f"register_op({name!r}): kind must be one of {', '.join(KINDS)}; "
                         f"got {kind!r}")
    if scope not in SCOPES:
        raise ValueError(f"register_op({name!r}): scope must be one of {SCOPES}; got {scope!r}")
    if aliasing is None:
        aliasing = "inplace" if kind == "inplace" else "copy"
    if aliasing not in ALIASINGS:
        raise ValueError(f"register_op({name!r}): aliasing must be one of "
                         f"{', '.join(ALIASINGS)}; got {aliasing!r}")
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
    _registry[label] = OpRow(name, function, method, operator, bool(export), module, kind,
                              scope, aliasing)
    return function


def register_ops(kind, namespace, names, method=True, export=True, scope="", aliasing=None):
    """One row of class `kind` for each op in `names` (separated by spaces), each the
    function of that name in `namespace` (the family module's globals()): the block a
    family written in Python closes with. `method`, `export`, `scope` and `aliasing` as
    for register_op."""
    if not isinstance(names, str):
        raise TypeError(f"register_ops: names must be a string of names, got {type(names).__name__}")
    for name in names.split():
        if name not in namespace:
            raise KeyError(f"register_ops({kind!r}): no function {name!r} in the namespace given")
        register_op(name, namespace[name], method=method, export=export, kind=kind, scope=scope,
                    aliasing=aliasing)


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


def registered_ops(kind=None, aliasing=None):
    """The registered ops, in the order they were registered (those of class `kind` and
    of `aliasing` only, when given)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"registered_ops: kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if aliasing is not None and aliasing not in ALIASINGS:
        raise ValueError(f"registered_ops: aliasing must be one of {', '.join(ALIASINGS)}; "
                         f"got {aliasing!r}")
    return [row for row in _registry.values() if (kind is None or row.kind == kind)
            and (aliasing is None or row.aliasing == aliasing)]


def register_tensor_method(name, fn, *, kind, aliasing=None):
    """A Tensor method that is not an `mt.` function (`t.new_zeros`, `t.masked_fill_`):
    a registry row with export=False."""
    return register_op(name, fn, export=False, kind=kind, aliasing=aliasing)


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
