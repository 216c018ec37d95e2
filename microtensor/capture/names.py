"""The Python names a compiled function reads: its closure's cells and the globals its
code names. A plan is replayed only while each still holds what it held when the plan
was recorded: a number, a string or a bool by type and value (the sign of a zero
included: guards.py), anything else (a module,
a tensor, a list) by identity. A counter the function keeps in `nonlocal n` or a global
changes between its two recorded calls, so the key runs eagerly with a warning; a
global rebound between calls (`model = GPT(...)` again) records a new plan.

What this cannot see: the contents of a mutable object (`count[0] += 1`, `self.n`), and
names read by the functions it calls (only the compiled function's own code is read).
"""
import dis

from microtensor.capture.guards import same_scalar

_MISSING = object()
_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"}
_globals_of = {}      # code object -> the global names it reads or writes


def _global_names(code):
    """The names code reads as globals (co_names also holds attribute names: `x.step`
    must not guard a global `step`)."""
    names = _globals_of.get(code)
    if names is None:
        names = tuple(dict.fromkeys(i.argval for i in dis.get_instructions(code)
                                    if i.opname in _GLOBAL_OPS))
        if len(_globals_of) < 1024:
            _globals_of[code] = names
    return names


def snapshot(fn):
    """[(where, name, container, value)] of the names fn's own code reads."""
    fn = getattr(fn, "__func__", fn)             # a bound method: its function
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:                       # not bound yet
            value = _MISSING
        out.append(("cell", name, cell, value))
    globals_ = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        value = globals_.get(name, _MISSING)
        if value is not _MISSING:
            out.append(("global", name, globals_, value))
    return out


def _read(where, name, container):
    if where == "cell":
        try:
            return container.cell_contents
        except ValueError:
            return _MISSING
    return container.get(name, _MISSING)


def _same(a, b):
    """Scalars by type and value (-0.0 is not 0.0, 2 is not 2.0 nor True), everything
    else by identity (guards.same_scalar)."""
    return same_scalar(a, b)


def names_hold(names):
    for where, name, container, value in names:
        if not _same(_read(where, name, container), value):
            return False
    return True


def changed(first, second):
    """The first name whose value differs between two snapshots, in words, or None."""
    for (where, name, _, a), (_, _, _, b) in zip(first, second):
        if not _same(a, b):
            kind = "closure variable" if where == "cell" else "global"
            return (f"the {kind} {name!r} changed between the recorded calls ({_short(a)}, "
                    f"then {_short(b)}): Python state the function reads, which a replay "
                    f"cannot follow (a counter?)")
    return None


def _short(x):
    text = repr(x)
    return text if len(text) < 40 else text[:37] + "..."
