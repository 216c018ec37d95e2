"""What a plan checks before it replays: Python scalars told apart as eager tells them
apart, and the state of the modules the function uses.

A scalar is compared by `scalar_id`: its type and its value, with the sign of a zero
and NaN kept (2, 2.0 and True are three values; so are 0.0 and -0.0; every NaN is one
value). Keys, guarded names (names.py), guarded attributes and the comparison of two
recordings all use it.

A module (an instance of a class given to `register_guard`: nn.Module) is guarded by
its whole state as the plan needs it (`state`): its scalar attributes (`training`, a
dropout's `p`, any number the forward reads), the identity of every tensor in its
`_parameters` and `_buffers` and of every tensor attribute (`self.scale = mt.tensor(5.)`,
neither a parameter nor a buffer), of every submodule in `_modules` (`model.h[0] = Block()`
and `model.lm_head = ...` are changes) and of every hook in its `*_hooks` dicts (a
forward pre-hook or forward hook registered or removed). The modules reachable from the
function (its arguments, closure, globals, its `self`) are read before the call runs,
with their whole tree of submodules; a module first met while the call runs is read
then. A change to any of it records a new plan.
"""
import math

import numpy as np

from microtensor.core._core import Tensor

_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_GUARDED_DICTS = ("_parameters", "_buffers", "_modules")

_classes = []     # (class, attributes) from register_guard


def register(cls, attributes):
    _classes.append((cls, tuple(attributes)))


def classes():
    return tuple(c for c, _ in _classes)


def _float_id(f):
    return "nan" if f != f else (f, math.copysign(1.0, f))


def scalar_id(value):
    """A hashable value that two scalars share exactly when eager treats them alike."""
    kind = type(value)
    if kind is bool or kind is int or kind is str or value is None:
        return (kind, value)
    if isinstance(value, float):                  # float, np.float64
        return (kind, _float_id(float(value)))
    if isinstance(value, complex):                # complex, np.complex128
        return (kind, _float_id(value.real), _float_id(value.imag))
    if isinstance(value, np.floating):
        return (kind, _float_id(float(value)))
    if isinstance(value, np.complexfloating):
        value = complex(value)
        return (kind, _float_id(value.real), _float_id(value.imag))
    return (kind, value)


def is_scalar(value):
    return isinstance(value, _SCALARS) or isinstance(value, np.generic)


def same_scalar(a, b):
    """Two scalars (or two objects) are the same: scalars by scalar_id, others by identity."""
    if a is b:
        return True
    if type(a) is not type(b) or not is_scalar(a):
        return False
    try:
        return scalar_id(a) == scalar_id(b)
    except Exception:              # noqa: BLE001 - an incomparable value is not the same
        return False


_PLAIN = frozenset((bool, int, str, type(None)))     # scalar_id(v) is (type(v), v)


def state(instance):
    """The guarded state of one module: a tuple compared with == (ints and scalar ids).
    (Read before every replay of a plan: the common kinds are tested first, by type.)"""
    parts = []
    append = parts.append
    for name, value in instance.__dict__.items():
        kind = type(value)
        if kind is dict or (kind not in _PLAIN and isinstance(value, dict)):
            if name in _GUARDED_DICTS or name.endswith("_hooks"):
                append((name, tuple(value), tuple(map(id, value.values())) if value else ()))
        elif kind in _PLAIN:
            append((name, (kind, value)))
        elif kind is float or kind is complex or isinstance(value, np.generic):
            append((name, scalar_id(value)))
        elif isinstance(value, Tensor):
            # a plain tensor attribute (`self.scale = mt.tensor(5.)`): read by the
            # records as it is, so a new one must record a new plan, as a parameter does
            append((name, "tensor", id(value)))
    return tuple(parts)


def held(instance):
    """The objects whose ids the state holds, kept alive so that no id is reused."""
    d = instance.__dict__
    out = []
    for name, value in d.items():
        if isinstance(value, dict) and (name in _GUARDED_DICTS or name.endswith("_hooks")):
            out.extend(value.values())
        elif isinstance(value, Tensor):
            out.append(value)
    return out


def entry(instance):
    return (instance, state(instance), held(instance))


def tree(roots, found):
    """Add entry() of every guarded module reachable from roots (and of their
    submodules) to found {id: entry}."""
    kinds = classes()
    if not kinds:
        return found
    stack = [r for r in roots if isinstance(r, kinds)]
    while stack:
        m = stack.pop()
        if id(m) in found:
            continue
        found[id(m)] = entry(m)
        children = m.__dict__.get("_modules")
        if isinstance(children, dict):
            stack.extend(c for c in children.values() if isinstance(c, kinds))
    return found


def roots_of(fn, args, kwargs, names):
    """The objects a call can reach modules from: fn, its self, the arguments (and one
    level of tuples, lists and dicts in them), the names it reads."""
    out = [fn, getattr(fn, "__self__", None)]
    for value in list(args) + list(kwargs.values()) + [n[3] for n in names]:
        out.append(value)
        if isinstance(value, (tuple, list)):
            out.extend(value)
        elif isinstance(value, dict):
            out.extend(value.values())
    return out


def hold(guards):
    for instance, st, _ in guards:
        if state(instance) != st:
            return False
    return True


def changed(first, second):
    """The first module whose state differs between two recordings, in words, or None."""
    a = {id(g[0]): g for g in first}
    b = {id(g[0]): g for g in second}
    for key in a.keys() & b.keys():
        if a[key][1] != b[key][1]:
            x = {p[0]: p[1:] for p in a[key][1]}
            y = {p[0]: p[1:] for p in b[key][1]}
            names = sorted(n for n in x.keys() | y.keys() if x.get(n) != y.get(n))
            return (f"{type(a[key][0]).__name__}'s {', '.join(map(str, names[:3]))} changed "
                    "between the recorded calls (module state the function changes)")
    return None
