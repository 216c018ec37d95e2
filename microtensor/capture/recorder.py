"""Recording one call of a function as the ops it ran, in order.

While a Recorder is on, every op (microtensor/_intercept.py wraps them all), the
Tensor methods that make or change tensors (clone, to, add_, backward, ...) and the
calls marked with `recorded_call` (an optimizer's step, clip_grad_norm_,
zero_grad) are recorded when called from the function itself; what they call inside
is theirs. Each record keeps the function and its arguments as a template: a tensor
an earlier record made (or the function was given) becomes a slot, read from the
replay's slots; any other tensor is an external (a parameter, a constant) held as it
is; everything else is a constant.

What a recording cannot see is caught where it happens: reading a tensor's values in
Python (t.item(), bool(t), t.numpy()) may steer the code between ops, and changing a
tensor outside an op (t.grad = None, t[...] = x) is a change no op records. Both reach
the core's capture hook, and the recording is marked as not replayable, with the
reason and the line of the function's code.
"""
import functools
import threading
import traceback
import types

from microtensor import _core, _intercept
from microtensor._core import Tensor

# Tensor methods of the class itself that make or change tensors: recorded as calls
TENSOR_CALLS = (
    "backward", "detach", "detach_", "clone", "to", "type", "float", "double", "long",
    "int", "bool", "cpu", "requires_grad_", "retain_grad", "register_hook", "zero_",
    "fill_", "copy_", "add_", "sub_", "mul_", "div_", "clamp_", "normal_", "uniform_",
)
_recording = threading.local()   # .recorder: the Recorder on in this thread, if any
_guards = []      # (class, attribute names) from register_guard


def recorded_call(fn, label=None):
    """fn, recorded as one call whenever a recording is on: for functions and methods
    that change state outside any op (an optimizer's step, clip_grad_norm_). It holds
    wherever the call comes from, a reference taken before mt.compile was called
    included (`clip = nn.utils.clip_grad_norm_`, `step = optimizer.step`)."""
    label = label or fn.__qualname__.replace("microtensor.", "")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        recorder = getattr(_recording, "recorder", None)
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.call(label, fn, args, kwargs)
    call.__recorded__ = True
    return call


def register_guard(cls, *attributes):
    """Instances of cls called during a recording are guarded: the replay checks that
    their `attributes` (a Module's `training`) still hold the values they had."""
    _guards.append((cls, attributes))


class Slot:
    """A tensor of the replay: the function's input or an earlier record's output."""
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return type(other) is Slot and other.index == self.index

    def __repr__(self):
        return f"%{self.index}"


class Seq:
    """A tuple or list that holds slots."""
    __slots__ = ("kind", "items")

    def __init__(self, kind, items):
        self.kind, self.items = kind, items

    def __eq__(self, other):
        return type(other) is Seq and other.kind is self.kind and other.items == self.items


def resolve(template, values):
    """The value of a template in a replay whose slots hold `values`."""
    kind = type(template)
    if kind is Slot:
        return values[template.index]
    if kind is Seq:
        items = [resolve(t, values) for t in template.items]
        return items if template.kind is list else template.kind(items)
    return template


def has_slots(template):
    kind = type(template)
    return kind is Slot or (kind is Seq and any(has_slots(t) for t in template.items))


class Record:
    """One call: fn(*args, **kwargs) with templates, and where its tensors went."""
    __slots__ = ("label", "fn", "args", "kwargs", "dynamic", "outs", "grad_mode", "info",
                 "seconds", "calls", "out_bytes")

    def __init__(self, label, fn, args, kwargs, outs, grad_mode, info):
        self.label, self.fn, self.args, self.kwargs = label, fn, args, kwargs
        self.dynamic = has_slots(Seq(tuple, list(args) + list(kwargs.values())))
        self.outs, self.grad_mode, self.info = outs, grad_mode, info
        self.seconds, self.calls, self.out_bytes = 0.0, 0, 0


class NotReplayable(Exception):
    pass


class Recorder:
    """Records the ops of one call of a function (see the module docstring)."""

    def __init__(self):
        self.records = []
        self.slot_of = {}       # id(tensor) -> slot index
        self.alive = []         # every tensor given a slot, kept alive (ids stay unique)
        self.externals = {}     # id -> the external tensors the records read
        self.roots = set()      # ids of the arrays that own the memory seen so far
        self.kept = []
        self.guards = {}        # id(instance) -> (instance, ((attribute, value), ...))
        self.refused = None     # why this recording cannot be replayed, if it cannot
        self.depth = 0
        self.thread = threading.get_ident()
        self._patched = []
        self._backward_rows = None

    # -- slots and templates ---------------------------------------------------------
    def new_slot(self, tensor):
        index = len(self.alive)
        self.alive.append(tensor)
        self.slot_of[id(tensor)] = index
        return index

    def template(self, value):
        kind = type(value)
        if isinstance(value, Tensor):
            index = self.slot_of.get(id(value))
            if index is not None:
                return Slot(index)
            self.externals[id(value)] = value
            return value
        if kind is tuple or kind is list:
            items = [self.template(v) for v in value]
            if any(type(t) in (Slot, Seq) for t in items):
                return Seq(kind, items)
            return value
        if kind is dict and any(isinstance(v, Tensor) for v in value.values()):
            self.refuse("a dict of tensors passed to an op")
        return value

    def new_memory(self, args, outputs):
        """Bytes of the memory the outputs own that no argument or earlier output owns
        (a view, a reshape, a split of another tensor owns none)."""
        for a in args:
            if isinstance(a, Tensor):
                self.roots.add(id(_root(a._data)))
        new = 0
        for t in outputs:
            root = _root(t._data)
            if id(root) not in self.roots:
                self.roots.add(id(root))
                self.kept.append(root)           # keep it alive: ids stay unique
                new += root.nbytes
        return new

    def bind_outputs(self, out, path=()):
        """[(path, slot)] for the tensors in an op's result (nested tuples/lists)."""
        if isinstance(out, Tensor):
            return [(path, self.new_slot(out))]
        if isinstance(out, (tuple, list)):
            found = []
            for i, v in enumerate(out):
                found += self.bind_outputs(v, path + (i,))
            return found
        return []

    # -- on / off -----------------------------------------------------------------------
    def __enter__(self):
        # grad mode is kept per record instead of recording its switches
        patched = _intercept.patch_ops(self._wrapper, skip=("set_grad_enabled_",))
        for name in TENSOR_CALLS:
            original = Tensor.__dict__[name]
            patched.append((_intercept._METHOD, name, original))
            _core.replace_tensor_method(name, self._wrapper(f"t.{name}", original))
        for cls, attributes in _guards:
            patched.append((cls, "__call__", cls.__call__))
            setattr(cls, "__call__", self._guarded(cls.__call__, attributes))
        self._patched = patched
        self._previous_hook = _core.set_capture_hook(self._seen)
        _recording.recorder = self
        return self

    def __exit__(self, *exc):
        _recording.recorder = None
        _core.set_capture_hook(self._previous_hook)
        _intercept.unpatch(self._patched)
        return False

    # -- what the wrappers do -------------------------------------------------------------
    def _wrapper(self, label, fn):
        recorder = self

        def recorded(*args, **kwargs):
            return recorder.call(label, fn, args, kwargs)
        recorded.__name__ = getattr(fn, "__name__", label)
        recorded.__doc__ = getattr(fn, "__doc__", None)
        recorded.__wrapped__ = fn
        return recorded

    def call(self, label, fn, args, kwargs):
        """fn(*args, **kwargs), recorded when the function itself made the call."""
        if self.depth or threading.get_ident() != self.thread:
            return fn(*args, **kwargs)
        grad_mode = _core.is_grad_enabled()
        # a generator (model.parameters()) is used up by the call: the replay needs the
        # tensors it gave, so the call gets them as a list
        if any(type(a) is types.GeneratorType for a in args):
            args = tuple(list(a) if type(a) is types.GeneratorType else a for a in args)
        args_t = tuple(self.template(a) for a in args)
        kwargs_t = {k: self.template(v) for k, v in kwargs.items()}
        info = [tuple(a.shape) for a in args if isinstance(a, Tensor)]
        backward = label in ("t.backward", "run_backward")
        if backward:
            self._backward_rows = []
            previous = _core.set_backward_profiler(self._backward_row)
        self.depth = 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self.depth = 0
            if backward:
                _core.set_backward_profiler(previous)
        outs = self.bind_outputs(out)
        rec = Record(label, fn, args_t, kwargs_t, outs, grad_mode, info)
        rec.out_bytes = self.new_memory(args, [self.alive[slot] for _, slot in outs])
        if backward:
            rec.info = rec.info + self._backward_rows
        self.records.append(rec)
        return out

    def _backward_row(self, node, grad):
        self._backward_rows.append(node.name())
        return node.backward(grad)

    def _guarded(self, call, attributes):
        recorder = self

        def guarded(instance, *args, **kwargs):
            if threading.get_ident() == recorder.thread and id(instance) not in recorder.guards:
                recorder.guards[id(instance)] = (
                    instance, tuple((a, getattr(instance, a)) for a in attributes))
            return call(instance, *args, **kwargs)
        return guarded

    def _seen(self, tensor, what):
        if self.depth or threading.get_ident() != self.thread or self.refused:
            return
        self.refuse(f"{what} in the function's own code{_where()}")

    def refuse(self, reason):
        if self.refused is None:
            self.refused = reason


def _root(array):
    while isinstance(array.base, type(array)):
        array = array.base
    return array


def _label(holder, name):
    owner = getattr(holder, "__name__", type(holder).__name__)
    return f"{owner.replace('microtensor.', '')}.{name}"


def _where():
    """', at file:line' of the innermost frame outside microtensor's own code."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/microtensor/" not in frame.filename.replace("\\", "/"):
            return f", at {frame.filename}:{frame.lineno} ({frame.line})"
    return ""


def same_constant(a, b):
    """Two recordings' constants are the same value."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, Tensor):
        return (not a.requires_grad and not b.requires_grad and a.shape == b.shape
                and a.dtype == b.dtype and a._data.tobytes() == b._data.tobytes())
    if type(a).__module__ == "numpy" and hasattr(a, "tobytes"):
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is Seq:
        return a.kind is b.kind and len(a.items) == len(b.items) and all(
            same_constant(x, y) for x, y in zip(a.items, b.items))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_constant(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_constant(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:          # noqa: BLE001 - an incomparable value is not the same
        return False



def is_compiling():
    """True while mt.compile records a call in this thread: code that reads a tensor's
    values only to check it (and whose ops check it again) can skip that read."""
    return getattr(_recording, "recorder", None) is not None
