"""Wrapping every op for a while: what the profiler (to time ops) and mt.compile (to
record them) both do.

`patch_ops(wrapper_for)` replaces each op function by `wrapper_for(label, fn)`: the
public functions of microtensor.core._core, the function of every other registry row
(the op families written in Python, F's ops, mt.linalg's), those of the modules
registered with `register_ops` (nn registers nn.init), the references other microtensor
and models modules took with `from ... import op`, and the Tensor methods the op
registry installed (t.exp() reaches the op without a module lookup). Operators need
nothing more: `a + b` calls the module-level `add` of the core. `unpatch` puts every
original back.
"""
import functools
import sys

from microtensor.core import _core

# functions of _core that are not ops: plumbing, modes, the registry itself
_PLUMBING = {
    "is_grad_enabled", "set_anomaly_enabled_", "is_anomaly_enabled",
    "get_num_threads", "set_backward_profiler", "wrap", "needs_graph", "attach", "as_dtype",
    "register_op", "register_ops", "registered_ops", "register_tensor_method",
    "registered_tensor_methods", "register_create_graph_rule", "get_create_graph_rule",
    "register_dtypes_and_device",
    "replace_tensor_method", "op_function", "set_capture_hook", "capture_read",
}
# creation, random state and modes: a profile leaves them out (they are not the step's
# math); a recording keeps them (a replay must create, draw and switch as the eager run)
CREATION_AND_STATE = {
    "tensor", "from_numpy", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
    "full_like", "arange", "linspace", "randn", "rand", "randint", "randperm",
    "multinomial", "manual_seed", "get_rng_state", "set_rng_state", "default_generator",
    "set_grad_enabled_", "set_num_threads", "run_backward",
}
_op_modules = []      # (module, label prefix), registered by the layers above the core


def register_ops(module, prefix):
    """Wrap the public functions defined in `module` too, labelled `prefix + name`, for
    functions that are not ops but must be timed or recorded (microtensor.nn registers
    nn.init as "nn.init.": its fills draw random numbers a replay must draw again)."""
    if all(m is not module for m, _ in _op_modules):
        _op_modules.append((module, prefix))


def _is_function(obj):
    return callable(obj) and not isinstance(obj, type) and (
        type(obj).__name__ in ("function", "cython_function_or_method",
                               "builtin_function_or_method", "fused_cython_function"))


def op_functions(skip=CREATION_AND_STATE):
    """{label: (module, attribute name, function)} of every op patch_ops wraps."""
    ops = {}
    for name, obj in vars(_core).items():
        if name.startswith("_") or name in _PLUMBING or name in skip or not _is_function(obj):
            continue
        # kernels (exp_backward, softmax_forward, ...) run inside ops and rules
        if name.endswith(("_forward", "_backward")) or name in ("max_lastdim", "scatter_add_rows"):
            continue
        # Cython-level helpers of the engine live here too; ops are the functions
        # defined in the module
        if getattr(obj, "__module__", "microtensor.core._core") != "microtensor.core._core":
            continue
        ops[name] = (_core, name, obj)
    # the ops outside the core's own functions: the registry's rows, labelled as a
    # row names itself ("cumsum", "F.gelu", "linalg.norm")
    for row in _core.registered_ops():
        if row.module == _core.__name__ or row.label in skip:
            continue
        module = sys.modules.get(row.module)
        name = row.name if module is not None and vars(module).get(row.name) is row.function else None
        if name is None and not row.scope and not row.export:
            continue      # a method made on the fly (t.exp_): a Tensor method, wrapped as one
        ops[row.label] = (module, name, row.function)
    # and what layers above register by module (nn registers nn.init: its fills draw
    # random numbers, which a replay must draw again)
    for module, prefix in _op_modules:
        for name, obj in vars(module).items():
            if name.startswith("_") or not _is_function(obj):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # re-exported from elsewhere: wrapped there
            ops[f"{prefix}{name}"] = (module, name, obj)
    return ops


def stand_in(wrapper, fn, label):
    """Make `wrapper` pass for `fn`: its name, qualified name, module and docstring, and
    `__wrapped__`. So pickle, which finds a function by module and qualified name, finds
    the wrapper there while it is patched in and stores a reference to `fn`'s place."""
    functools.update_wrapper(wrapper, fn)
    if not hasattr(fn, "__name__"):
        wrapper.__name__ = wrapper.__qualname__ = label
    return wrapper


_METHOD = object()       # marks a patched Tensor method in the undo list


def patch_ops(wrapper_for, skip=CREATION_AND_STATE, packages=("microtensor", "models")):
    """Replace every op by wrapper_for(label, fn); returns the undo list for unpatch."""
    patched = []

    def patch(module, attr, value):
        patched.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    wrapped = {}
    for label, (module, name, fn) in op_functions(skip).items():
        if id(fn) in wrapped:
            continue      # one function under two labels (an alias): wrapped once
        w = wrapper_for(label, fn)
        wrapped[id(fn)] = w
        if name is not None:
            patch(module, name, w)
    # modules that did `from ... import op` hold their own reference
    for modname, module in list(sys.modules.items()):
        if module is None or modname.split(".")[0] not in packages or module is _core:
            continue
        for attr, value in list(vars(module).items()):
            w = wrapped.get(id(value))
            if w is not None and getattr(module, attr) is not w:
                patch(module, attr, w)
    for row in _core.registered_ops():
        w = wrapped.get(id(row.method))
        if w is not None:
            patched.append((_METHOD, row.name, _core.replace_tensor_method(row.name, w)))
    return patched


def unpatch(patched):
    """Put back what patch_ops replaced, newest first."""
    for module, attr, original in reversed(patched):
        if module is _METHOD:
            _core.replace_tensor_method(attr, original)
        else:
            setattr(module, attr, original)
    patched.clear()
