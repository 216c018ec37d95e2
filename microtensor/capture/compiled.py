"""mt.compile: record a function's ops on its first calls, replay them after.

    step = mt.compile(train_step)        # or @mt.compile above the def
    loss = step(x, y)                    # call 1: runs eagerly and records
    loss = step(x, y)                    # call 2: runs eagerly, records again, compares
    loss = step(x, y)                    # call 3 on: replays the plan
    print(step.plan)                     # the ops of one call, in order
    print(step.plan.summary())           # time per kind of op over the replays

A plan is kept per key: the shapes, dtypes and requires_grad of the tensor arguments,
the other arguments' types and values (2, 2.0 and True are three keys; so are 0.0 and
-0.0: guards.py), the grad mode, and which tensor arguments are one object or overlap
in memory (aliasing.py). Its guards (the state of every Module the call reaches or
calls, with its submodules: scalar attributes, the identity of parameters, buffers,
tensor attributes, submodules and hooks; the Python names the function reads:
names.py; which arguments are, or overlap, a tensor the function reaches otherwise:
aliasing.py) must still hold, else the call records a new plan. The first two calls of a key run eagerly
and are both recorded; the plan is trusted only when the two recordings agree (the
same ops on the same arguments, in the same grad modes, the same grad mode left, the
same values of the names the function reads, the same module states), so a value baked in on the first call
that changes on the second (a tensor made outside any op, Python control flow that
took another branch, a counter) is caught, and that key runs eagerly from then on.
Reading a tensor's value in the function (t.item(), if t > 0:, repr(t), mt.equal, a
shape read from the values), changing a tensor outside an op (t.grad = None) or making
one outside every recorded op is caught as it happens (recorder.py: the one door) and
also keeps that key eager. What changes legitimately between calls is read at replay:
an optimizer reads its param_groups' lr and its step count, every random draw draws
again from its generator, t.grad is read again.

A compiled function called while another one records (in the same thread) runs its
Python, so its ops are recorded into the outer plan. A plan is replayed by one thread at
a time (another waits for it). An op run in another thread while a call records
interrupts that recording (its result could reach the function as a constant): the key
records again later, and runs eagerly after MAX_INTERRUPTED interruptions. Generator
and async functions run eagerly with a warning (their call returns an object that runs
the body once, later), as do functions that return an iterator.

What a plan cannot see: Python side effects of the function (printing, appending to a
list) happen on the two recorded calls only; state inside mutable objects other than
Modules (a counter kept in a list) is a constant of the plan (docs/COMPILE.md has the
whole table).

The bookkeeping is bounded: at most max_plans plans (pending first calls included),
MAX_REASONS reasons kept, MAX_WARNINGS warnings per compiled function.
"""
import functools
import inspect
import threading
import types
import warnings

from microtensor.core import _core
from microtensor.core._core import Tensor
from microtensor.capture import names as _names
from microtensor.capture import guards as _guards
from microtensor.capture import aliasing as _aliasing
from microtensor.capture.recorder import Recorder, current
from microtensor.capture.plan import Plan, compare


MAX_REASONS = 32       # eager reasons kept per compiled function (the oldest go first)
MAX_WARNINGS = 8       # warnings per compiled function; then one saying the rest are off
MAX_INTERRUPTED = 2    # recordings of a key interrupted by another thread's ops, then eager


class CompiledFunction:
    """A function with its plans (see the module docstring)."""

    def __init__(self, fn, max_plans=8, verbose=False, arena=True, fuse=True):
        if not callable(fn):
            raise TypeError(f"mt.compile needs a callable, got {type(fn).__name__}")
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"mt.compile: max_plans must be a positive int, got {max_plans!r}")
        self.fn = fn
        self.max_plans = max_plans
        self.verbose = verbose
        self.arena = bool(arena)
        self.fuse = bool(fuse)     # apply fuse.py's rewrites to a trusted plan
        self._plans = {}        # key -> list of Plan (one per set of guard values)
        self._pending = {}      # key -> the first call's (recorder, plan), awaiting the second
        self._eager = {}        # key -> why this key runs eagerly (at most MAX_REASONS)
        self._lock = threading.Lock()      # the bookkeeping, between threads
        self.warnings = 0
        self.calls = {"recorded": 0, "replayed": 0, "eager": 0}
        self.inlined = 0        # calls recorded into another compiled function's plan
        self._interrupted = {}  # key -> recordings another thread's ops interrupted
        self._always_eager = _never_replayable(fn)
        functools.update_wrapper(self, fn)

    # -- the call -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if current() is not None:
            # called while another compiled function records in this thread: its ops
            # are recorded into the outer plan
            self.inlined += 1
            return self.fn(*args, **kwargs)
        if self._always_eager is not None:
            if not self._eager:
                return self._run_eagerly(None, self._always_eager, args, kwargs)
            self.calls["eager"] += 1
            return self.fn(*args, **kwargs)
        try:
            ordered = tuple(sorted(kwargs.items()))
            tensors = [t for _, t in _tensors((args, dict(ordered)))]
            key = (_key(args), _key(ordered), _core.is_grad_enabled(), _aliasing.among(tensors))
        except TypeError as e:
            return self._run_eagerly(None, f"an argument cannot key a plan ({e})", args, kwargs)
        if key in self._eager:
            self.calls["eager"] += 1
            return self.fn(*args, **kwargs)
        for plan in self._plans.get(key, ()):
            if plan.holds(tensors):
                self.calls["replayed"] += 1
                return plan.replay(args, kwargs)
        with self._lock:
            waiting = len(self._pending) - (key in self._pending)   # other keys' first calls
            full = sum(len(p) for p in self._plans.values()) + waiting >= self.max_plans
        if full:
            return self._run_eagerly(key, f"more than max_plans={self.max_plans} plans "
                                          "(shapes or arguments keep changing)", args, kwargs)
        return self._record(key, args, kwargs)

    def _record(self, key, args, kwargs):
        recorder = Recorder()
        names = _names.snapshot(self.fn)
        # the modules the call can reach, as they are before it runs (guards.py)
        _guards.tree(_guards.roots_of(self.fn, args, kwargs, names), recorder.guards)
        found = _tensors((args, dict(sorted(kwargs.items()))))
        inputs = [(path, recorder.new_slot(t)) for path, t in found]
        with recorder:
            result = self.fn(*args, **kwargs)
            result_template = recorder.result_template(result)
        self.calls["recorded"] += 1
        recorder.final_grad_mode = _core.is_grad_enabled()
        with self._lock:
            if recorder.refused:
                self._give_up(key, recorder.refused)
                return result
            if recorder.interrupted:
                # not this call's own doing, perhaps: record the key again later, and
                # run it eagerly when it keeps happening
                self._pending.pop(key, None)
                if len(self._interrupted) >= MAX_REASONS:
                    self._interrupted.clear()             # bounded bookkeeping
                count = self._interrupted[key] = self._interrupted.get(key, 0) + 1
                if count >= MAX_INTERRUPTED:
                    self._give_up(key, recorder.interrupted)
                return result
            plan = Plan(recorder, inputs, result_template, arena=self.arena, names=names)
            # which arguments are (or overlap) a tensor the function reaches otherwise
            plan.aliases = _aliasing.Beside(_aliasing.reachable(
                names, [g[0] for g in plan.guards], recorder.externals.values()),
                [t for _, t in found])
            first = self._pending.pop(key, None)
            if first is None or first.aliases.signature != plan.aliases.signature:
                # the second call records again and compares (a call whose arguments
                # alias other tensors than the first's did starts the pair again)
                self._pending[key] = plan
                return result
            difference = _names.changed(first.names, plan.names) or compare(first, plan)
            if difference is not None:
                self._give_up(key, difference)
                return result
            if self.fuse:
                plan.fuse(recorder.alive)
            self._plans.setdefault(key, []).append(plan)
        if self.verbose:
            print(f"mt.compile({self.__name__}): a plan of {len(plan)} calls")
        return result

    def _give_up(self, key, reason, stacklevel=5):
        self._pending.pop(key, None)
        self._remember(key, reason)
        self._warn(f"running eagerly: {reason}", stacklevel)

    def _remember(self, key, reason):
        self._eager.pop(key, None)
        while len(self._eager) >= MAX_REASONS:      # the oldest goes first
            del self._eager[next(iter(self._eager))]
        self._eager[key] = reason

    def _warn(self, message, stacklevel):
        """A RuntimeWarning pointing at the caller's line; at most MAX_WARNINGS."""
        self.warnings += 1
        if self.warnings > MAX_WARNINGS:
            return
        if self.warnings == MAX_WARNINGS:
            message += " (further warnings of this compiled function are not shown)"
        warnings.warn(f"mt.compile({getattr(self.fn, '__name__', 'fn')}): {message}",
                      RuntimeWarning, stacklevel=stacklevel)

    def _run_eagerly(self, key, reason, args, kwargs):
        with self._lock:
            # no key to remember it by: listed under the reason itself
            self._give_up(key if key is not None else ("no key", reason), reason)
        self.calls["eager"] += 1
        return self.fn(*args, **kwargs)

    # -- reading it -----------------------------------------------------------------------
    @property
    def plan(self):
        """The newest plan (None before the second call of a key)."""
        plans = [p for ps in self._plans.values() for p in ps]
        return plans[-1] if plans else None

    @property
    def plans(self):
        return [p for ps in self._plans.values() for p in ps]

    @property
    def eager_reasons(self):
        """Why keys run eagerly: {key: reason}."""
        return dict(self._eager)

    def __repr__(self):
        return (f"<compiled {getattr(self.fn, '__name__', 'fn')}: {len(self.plans)} plans, "
                f"calls {self.calls}>")


def compile(fn=None, *, max_plans=8, verbose=False, arena=True, fuse=True, **torch_options):
    """Record `fn`'s ops on its first two calls and replay them after (see
    microtensor/capture/compiled.py). Works as `mt.compile(fn)` and as `@mt.compile`.
    fuse=False replays the recorded calls as they are (no rewrites: capture/fuse.py,
    nn/_rewrites.py).
    torch.compile's options (mode=, fullgraph=, dynamic=, backend=) are accepted and
    have no effect."""
    unknown = set(torch_options) - {"mode", "fullgraph", "dynamic", "backend", "options",
                                    "disable"}
    if unknown:
        raise TypeError(f"mt.compile() got unexpected keyword arguments {sorted(unknown)}")
    if torch_options.get("disable"):
        return fn if fn is not None else (lambda f: f)
    if fn is None:
        return lambda f: CompiledFunction(f, max_plans=max_plans, verbose=verbose, arena=arena,
                                          fuse=fuse)
    return CompiledFunction(fn, max_plans=max_plans, verbose=verbose, arena=arena, fuse=fuse)


def _never_replayable(fn):
    """Why fn can never be replayed (a generator, coroutine or async generator function:
    its call returns an object that runs the body later, once), or None. Such a
    function runs eagerly, with one warning, as torch.compile runs it."""
    target = fn
    for _ in range(8):
        if isinstance(target, functools.partial):
            target = target.func
        elif hasattr(target, "__wrapped__"):
            target = target.__wrapped__
        else:
            break
    target = getattr(target, "__func__", target)
    if not inspect.isfunction(target) and not inspect.ismethod(target):
        call = getattr(type(target), "__call__", None)
        target = getattr(call, "__func__", call)
    kinds = ((inspect.isgeneratorfunction, "a generator function"),
             (inspect.iscoroutinefunction, "an async function (coroutine)"),
             (inspect.isasyncgenfunction, "an async generator function"))
    for test, what in kinds:
        if target is not None and test(target):
            return (f"{what} cannot be replayed (each call returns an object that runs the "
                    "body later, once): it runs eagerly")
    return None


def _key(value):
    """A hashable key of an argument: tensors by shape, dtype and requires_grad."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _key(v)) for k, v in sorted(value.items()))
    if isinstance(value, types.GeneratorType):
        raise TypeError("a generator is used up by the call; pass a list")
    hash(value)
    return _guards.scalar_id(value)         # 2, 2.0, True are three keys; so are 0.0, -0.0


def _tensors(value, path=()):
    """[(path, tensor)] of the tensors in nested args / kwargs."""
    if isinstance(value, Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [x for i, v in enumerate(value) for x in _tensors(v, path + (i,))]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _tensors(v, path + (k,))]
    return []
