"""Recording one call of a function as the ops it ran, in order.

While any recording is on, every op is wrapped once for all threads (`_install`): the
public functions of the core, the function of every other op registry row (F's ops
included) and nn.init's fills (microtensor/ops/_intercept.py), every Tensor method but those that only read shapes or
values (TENSOR_READS: in-place methods such as `exp_` and `masked_fill_` are ops with
records of their own), and the calls marked with `recorded_call` (an optimizer's step,
clip_grad_norm_, zero_grad). A wrapper asks its own thread's Recorder, if it has one,
to record the call; a call made inside a recorded call is the outer call's business.
When the last recording in any thread ends, every original is put back: nothing stays
patched. A random draw (mt.randn, t.normal_, nn.init.normal_, dropout) is a record like
any op: the replay calls it again, with the generator it was given, and draws anew.

Each record keeps the function and its arguments as a template: a tensor an earlier
record made (or the function was given) becomes a slot, read from the replay's slots;
any other tensor is an external (a parameter, a constant) held as it is; everything
else is a constant.

Every value that leaves a tensor passes one door: the core's capture hook (`item`,
`bool`, `int`, `float`, `index`, `tolist`, `numpy`, `__array__`, `repr`/`str`/`format`,
iteration, boolean-mask indexing, and through `capture_read` the ops that return a
Python value or a shape read from the data: `equal`, `allclose`, `nonzero`,
`masked_select`, `unique`, ...). So does every change to a tensor outside an op
(`t.grad = None`, `t[...] = x`). In the function's own code such a read or write ends
the plan for that key: the recording is marked as not replayable, with the reason and
the line, and the key runs eagerly. Reading `t.grad` or `t.data` is a record of its own
(the replay reads them again). Iteration reads only the shape, which keys the plan.

The core also calls the hook for every tensor it makes. Every op's result is made
inside a recorded call, so a tensor made in the function's own code came from a call
the recording could not see (`act = mt.tanh` taken at import, before the wrapping,
then `act(x)`): that too ends the plan, where a constant would otherwise be replayed.
"""
import functools
import threading
import traceback
import types

from microtensor.core import _core
from microtensor.ops import _intercept
from microtensor.core._core import Tensor
from microtensor.capture import guards as _guards_mod

# Tensor methods that read shapes or values and make no tensor: never recorded (a value
# read reaches the capture hook instead)
TENSOR_READS = {
    "item", "tolist", "numpy", "size", "dim", "numel", "nelement", "element_size",
    "get_device", "data_ptr", "stride", "is_contiguous", "is_floating_point", "cuda", "pin_memory",
}
# reads that depend on the shape alone (the shape is part of a plan's key)
SHAPE_READS = {"iteration over t"}
# the core calls the hook with this for every tensor it makes
NEW_TENSOR = "a new tensor"
# reads and writes that a recording turns into records of their own
RECORDED_READS = {"t.grad", "t.data"}
# the door's reads made by ops (capture_read, boolean-mask indexing): refused when the
# op was called from the function's own code, whose Python gets the value
OP_READS = ("mt.", "indexing with a boolean mask")

_recording = threading.local()   # .recorder: the Recorder on in this thread, if any
_guards = []      # (class, attributes) from register_guard
_lock = threading.RLock()
_users = 0        # recordings on now, in every thread
_undo = []        # what the shared wrapping replaced, for _uninstall
_open = set()     # the Recorders on now, in every thread


def current():
    """The Recorder on in this thread, or None."""
    return getattr(_recording, "recorder", None)


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


def record_call(label, fn, args):
    """fn(*args), recorded as one call when a recording is on in this thread (a custom
    autograd.Function's apply: the replay runs its forward and attaches its backward)."""
    recorder = getattr(_recording, "recorder", None)
    if recorder is None:
        return fn(*args)
    return recorder.call(label, fn, args, {})


def register_guard(cls, *attributes):
    """Instances of cls that a recording reaches or calls are guarded: the replay checks
    that their state (guards.py: scalar attributes such as a Module's `training`, the
    identity of the tensors in `_parameters` and `_buffers`, of the submodules in
    `_modules`, of the hooks in every `*_hooks` dict) is what it was."""
    _guards.append((cls, attributes))
    _guards_mod.register(cls, attributes)


# -- the shared wrapping: installed by the first recording, removed by the last ----------
def _foreign(what, mine=None):
    """An op (or a tensor made, a value read) in a thread other than a recording's own,
    while that recording is on: its result may reach the recorded function (a thread
    the function started, a pool it handed work to), where the plan would replay it as
    a constant. Every other thread's recording is interrupted (compiled.py records the
    key again later, and runs it eagerly when it keeps happening)."""
    thread = threading.current_thread().name
    for recorder in list(_open):
        if recorder is not mine and recorder.interrupted is None:
            recorder.interrupted = (f"{what} ran in another thread ({thread}) while the call "
                                    "was recorded: its result would be a constant of the plan")


def _dispatch(label, fn):
    """The wrapper of one op: recorded by this thread's recorder, if it has one."""
    def recorded(*args, **kwargs):
        recorder = getattr(_recording, "recorder", None)
        if recorder is None:
            if _open:
                _foreign(label)
            return fn(*args, **kwargs)
        if len(_open) > 1:
            _foreign(label, recorder)
        return recorder.call(label, fn, args, kwargs)
    return _intercept.stand_in(recorded, fn, label)


def _guarded(call, attributes):
    def guarded(instance, *args, **kwargs):
        recorder = getattr(_recording, "recorder", None)
        if recorder is None:
            if _open:
                _foreign(f"{type(instance).__name__}.__call__")
        elif id(instance) not in recorder.guards:
            # a module the recording did not reach before the call: its tree, as now
            _guards_mod.tree([instance], recorder.guards)
        return call(instance, *args, **kwargs)
    guarded.__wrapped__ = call
    return guarded


def _hook(tensor, what):
    recorder = getattr(_recording, "recorder", None)
    if len(_open) > (recorder is not None):
        _foreign("an op" if what == NEW_TENSOR else what, recorder)
    if recorder is not None:
        return recorder.seen(tensor, what)
    return None


def _install():
    """Wrap every op (see the module docstring); the first recording does this."""
    global _undo
    undo = _intercept.patch_ops(_dispatch, skip=("set_grad_enabled_",))
    wrapped = {name for module, name, _ in undo if module is _intercept._METHOD}
    for name, value in list(Tensor.__dict__.items()):
        if (name.startswith("_") or name in wrapped or name in TENSOR_READS
                or not callable(value) or isinstance(value, (property, types.GetSetDescriptorType))):
            continue
        undo.append((_intercept._METHOD, name, value))
        _core.replace_tensor_method(name, _dispatch(f"t.{name}", value))
    for cls, attributes in _guards:
        undo.append((cls, "__call__", cls.__call__))
        setattr(cls, "__call__", _guarded(cls.__call__, attributes))
    undo.append((_HOOK, None, _core.set_capture_hook(_hook)))
    _undo = undo


_HOOK = object()      # marks the capture hook in the undo list


def _uninstall():
    global _undo
    undo, _undo = _undo, []
    for module, attr, original in reversed(undo):
        if module is _HOOK:
            _core.set_capture_hook(original)
        elif module is _intercept._METHOD:
            _core.replace_tensor_method(attr, original)
        else:
            setattr(module, attr, original)


def installed():
    """Whether the ops are wrapped now (some recording is on, in some thread)."""
    return bool(_undo)


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
        kind = template.kind
        if kind is list:
            return items
        if kind is slice:
            return slice(*items)
        if kind is tuple or kind is dict:
            return kind(items)
        return kind(*items)                 # a namedtuple
    return template


def slots_in(template, found):
    """found (a list), with the slot index of every Slot in a template appended."""
    kind = type(template)
    if kind is Slot:
        found.append(template.index)
    elif kind is Seq:
        for t in template.items:
            slots_in(t, found)
    return found


def has_slots(template):
    kind = type(template)
    return kind is Slot or (kind is Seq and any(has_slots(t) for t in template.items))


class Record:
    """One call: fn(*args, **kwargs) with templates, and where its tensors went."""
    __slots__ = ("label", "fn", "args", "kwargs", "dynamic", "outs", "grad_mode", "info",
                 "seconds", "calls", "out_bytes", "fused")

    def __init__(self, label, fn, args, kwargs, outs, grad_mode, info):
        self.label, self.fn, self.args, self.kwargs = label, fn, args, kwargs
        self.dynamic = has_slots(Seq(tuple, list(args) + list(kwargs.values())))
        self.outs, self.grad_mode, self.info = outs, grad_mode, info
        self.seconds, self.calls, self.out_bytes = 0.0, 0, 0
        self.fused = None       # the labels of the calls a fused record stands for (fuse.py)


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
        self.interrupted = None  # another thread's op ran meanwhile (_foreign), if one did
        self.depth = 0          # 0: in the function's own code; 1: in a recorded call
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
        if kind is slice:           # x[:n] with n a tensor: read again at replay
            items = [self.template(v) for v in (value.start, value.stop, value.step)]
            if any(type(t) in (Slot, Seq) for t in items):
                return Seq(slice, items)
            if any(isinstance(v, Tensor) for v in items):
                self.refuse("a tensor made outside the function inside a slice")
            return value
        if kind is dict and any(isinstance(v, Tensor) for v in value.values()):
            self.refuse("a dict of tensors passed to an op")
        return value

    def result_template(self, value):
        """The template of the function's return value: every tuple, list, dict and
        namedtuple in it is built anew by each replay (the caller may change a list it
        was given), and a value a replay cannot give again refuses the plan."""
        kind = type(value)
        if kind is list or kind is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            return Seq(kind, [self.result_template(v) for v in value])
        if kind is dict:
            return Seq(dict, [Seq(tuple, [k, self.result_template(v)]) for k, v in value.items()])
        if isinstance(value, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            self.refuse(f"the function returned a {kind.__name__} (used up by its caller: a "
                        "replay cannot give it again)")
        elif hasattr(kind, "__next__"):
            self.refuse(f"the function returned an iterator ({kind.__name__}): a replay "
                        "cannot give it again")
        elif not isinstance(value, Tensor) and any(
                isinstance(v, (Tensor, list, dict)) for v in getattr(value, "__dict__", {}).values()):
            self.refuse(f"the function returned a {kind.__name__} holding tensors or "
                        "containers: return a tuple, list, dict or namedtuple")
        return self.template(value)

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
        global _users
        if current() is not None:
            raise RuntimeError("a recording is on in this thread already")
        with _lock:
            if _users == 0:
                _install()
            _users += 1
            _open.add(self)
        _recording.recorder = self
        return self

    def __exit__(self, *exc):
        global _users
        _recording.recorder = None
        with _lock:
            _open.discard(self)
            _users -= 1
            if _users == 0:
                _uninstall()
        return False

    # -- what the wrappers do -------------------------------------------------------------
    def call(self, label, fn, args, kwargs):
        """fn(*args, **kwargs), recorded when the function itself made the call."""
        if self.depth:
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
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
        self._record(label, fn, args, args_t, kwargs_t, out, grad_mode, info)
        if backward:
            self.records[-1].info += self._backward_rows
        return out

    def _record(self, label, fn, args, args_t, kwargs_t, out, grad_mode, info):
        outs = self.bind_outputs(out)
        rec = Record(label, fn, args_t, kwargs_t, outs, grad_mode, info)
        rec.out_bytes = self.new_memory(args, [self.alive[slot] for _, slot in outs])
        self.records.append(rec)

    def _backward_row(self, node, grad):
        self._backward_rows.append(node.name())
        return node.backward(grad)

    def seen(self, tensor, what):
        """The door (the core's capture hook): a value leaving a tensor, or a change
        made outside an op, in this thread."""
        if what == NEW_TENSOR:
            # every op's result is made inside a recorded call: a tensor made in the
            # function's own code came from a call the recording did not see
            if self.depth == 0 and not self.refused:
                self.refuse("a tensor made by a call the recording cannot see (an op "
                            "reached through a reference taken before mt.compile wrapped "
                            f"the ops, or a Tensor built by hand){_where()}")
            return None
        if self.refused or what in SHAPE_READS:
            return None
        if what in RECORDED_READS:
            if self.depth == 0:
                return self._read(tensor, what)
            return None
        if self.depth == 0 or (self.depth == 1 and what.startswith(OP_READS)):
            self.refuse(f"{what} in the function's own code{_where()}")

    def _read(self, tensor, what):
        """t.grad or t.data read by the function: a record, read again at replay."""
        fn = _read_grad if what == "t.grad" else _read_data
        self.depth = 1
        try:
            out = fn(tensor)
        finally:
            self.depth = 0
        if out is None:
            self.refuse(f"{what} is None here (a plan cannot follow a check of it) "
                        f"in the function's own code{_where()}")
            return None
        self._record(what, fn, (tensor,), (self.template(tensor),), {}, out,
                     _core.is_grad_enabled(), [tuple(tensor.shape)])
        return out

    def refuse(self, reason):
        if self.refused is None:
            self.refused = reason


def _read_grad(tensor):
    return tensor.grad


def _read_data(tensor):
    return tensor.data


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
    if _guards_mod.is_scalar(a):
        return _guards_mod.same_scalar(a, b)       # -0.0 is not 0.0
    try:
        return bool(a == b)
    except Exception:          # noqa: BLE001 - an incomparable value is not the same
        return False



def is_compiling():
    """True while mt.compile records a call in this thread: code that reads a tensor's
    values only to check it (and whose ops check it again) can skip that read."""
    return getattr(_recording, "recorder", None) is not None
