"""A plan: the recorded calls of one compiled function, replayed in order.

A replay puts the new inputs into their slots, then runs each record's function on
its arguments (slots read from this replay, externals and constants as recorded), in
the grad mode it was recorded in, and keeps the tensors it returns in their slots.
No Python of the compiled function runs, no Module is called, nothing is looked up by
name: what is left per op is the op itself.
"""
import threading
import time

from microtensor.core import _core
from microtensor.capture.recorder import Slot, Seq, resolve, same_constant, slots_in
from microtensor.capture.memory import Memory
from microtensor.capture.names import names_hold
from microtensor.capture import guards as _guards
from microtensor.capture import fuse as _fuse
from microtensor.core._core import Tensor

_BACKWARD_LABELS = ("t.backward", "run_backward")
_FLOP_LABELS = ("matmul", "F.linear", "F.scaled_dot_product_attention", "bmm", "mm")


class Plan:
    """The records of one recording, the slots its inputs fill, the result's template
    and the guards (module modes) it holds under."""

    def __init__(self, recorder, inputs, result, arena=True, names=()):
        self.records = recorder.records
        self.slots = len(recorder.alive)
        self.inputs = inputs          # [(path into (args, kwargs), slot)]
        self.result = result          # template of the function's return value
        self.guards = [g for g in recorder.guards.values()]
        self.names = names            # the Python names the function reads (names.py)
        self.aliases = None           # aliasing.Beside: the arguments' aliasing (compiled.py)
        self.externals = len(recorder.externals)
        self.final_grad_mode = getattr(recorder, "final_grad_mode", None)
        self.replays = 0
        self.fused = []               # [(label, [labels of the calls it stands for])]
        self.dropped = []             # (label, why) of the calls a rewrite removed (fuse.py)
        self._relist = None           # the backward call whose rules the next replay lists
        self._rules_fused = False     # whether its listed rules are the rewritten plan's
        self._laid_out()
        self.memory = Memory() if arena else None
        self.lock = threading.Lock()  # one replay at a time: another thread waits

    def _laid_out(self):
        self.bytes = sum(rec.out_bytes for rec in self.records)
        self.release = _last_uses(self.records, self.slots, self.result)

    def fuse(self, alive):
        """Apply the rewrite rules (fuse.py) once the plan is trusted; alive[i] is slot
        i's tensor in the recording the plan was made from."""
        self.records, self.result, self.fused, self.dropped = _fuse.fuse(
            self.records, alive, self.result)
        self._laid_out()
        if self.fused or self.dropped:
            # the backward pass may run other rules now (a fused call has its own; a
            # dropped call may have had one): the first replay lists the rules it runs
            self._relist = next((i for i, rec in enumerate(self.records)
                                 if rec.label in _BACKWARD_LABELS), None)

    def _listing_rules(self, rec, values):
        """Run a backward call, listing the rules the engine runs in its info."""
        rules = []

        def row(node, grad):
            rules.append(node.name())
            return node.backward(grad)
        previous = _core.set_backward_profiler(row)
        try:
            out = rec.fn(*[resolve(a, values) for a in rec.args],
                         **{k: resolve(v, values) for k, v in rec.kwargs.items()})
        finally:
            _core.set_backward_profiler(previous)
        rec.info = [i for i in rec.info if not isinstance(i, str)] + rules
        self._relist = None
        self._rules_fused = True
        return out

    def holds(self, inputs):
        """Whether the guards still hold for a call with these tensor arguments: each
        Module's state (guards.py: its scalar attributes, training included, and the
        identity of its parameters, buffers, tensor attributes, submodules and hooks),
        the Python names the function reads (scalars by type and value, everything else
        by identity), and which arguments are, or overlap, the other tensors the
        function reaches (aliasing.py)."""
        return (_guards.hold(self.guards) and names_hold(self.names)
                and (self.aliases is None or self.aliases.holds(inputs)))

    def replay(self, args, kwargs):
        with self.lock:
            return self._replay(args, kwargs)

    def _replay(self, args, kwargs):
        values = [None] * self.slots
        for path, slot in self.inputs:
            values[slot] = _dig((args, kwargs), path)
        was = _core.is_grad_enabled()
        mode = was
        clock = time.perf_counter
        memory = self.memory
        if memory is not None:
            memory.begin()
        try:
            release = self.release
            for i, rec in enumerate(self.records):
                if rec.grad_mode != mode:
                    _core.set_grad_enabled_(rec.grad_mode)
                    mode = rec.grad_mode
                t0 = clock()
                if self._relist is not None and i == self._relist:
                    out = self._listing_rules(rec, values)
                elif rec.dynamic:
                    out = rec.fn(*[resolve(a, values) for a in rec.args],
                                 **{k: resolve(v, values) for k, v in rec.kwargs.items()})
                else:
                    out = rec.fn(*rec.args, **rec.kwargs)
                rec.seconds += clock() - t0
                rec.calls += 1
                for path, slot in rec.outs:
                    values[slot] = _dig(out, path) if path else out
                # drop each tensor after its last use, so backward can free what it
                # no longer needs as it goes, as in eager mode
                for slot in release[i]:
                    values[slot] = None
        finally:
            if memory is not None:
                memory.end()
            end = was if self.final_grad_mode is None else self.final_grad_mode
            if mode != end:
                _core.set_grad_enabled_(end)
        self.replays += 1
        return resolve(self.result, values)

    # -- reading it -------------------------------------------------------------------
    def __len__(self):
        return len(self.records)

    def __str__(self):
        lines = [f"plan: {len(self.records)} calls, {self.slots} tensors in slots, "
                 f"{self.externals} external tensors (parameters, constants), "
                 f"{len(self.guards)} guarded modules, {len(self.names)} guarded names; "
                 f"{_mb(self.bytes)} of new results per call"
                 + (f"; {len(self.fused)} fused calls (each stands for the calls it lists)"
                    if self.fused else "")]
        for i, rec in enumerate(self.records):
            shapes = " ".join(str(i) for i in rec.info if isinstance(i, tuple))
            flops = _flops(rec)
            extra = f"  {flops / 1e6:,.2f} MFLOP" if flops else ""
            grad = "" if rec.grad_mode else "  [no_grad]"
            outs = ", ".join(f"%{s}" for _, s in rec.outs)
            size = f" ({_kib(rec.out_bytes)})" if rec.out_bytes else " (views)"
            lines.append(f"{i:4d}  {rec.label:<34} {shapes}{extra}{grad}"
                         + (f"  -> {outs}{size}" if outs else ""))
            if rec.fused:
                lines.append(f"        fuses {len(rec.fused)} calls: {_counted(rec.fused)}")
                if getattr(rec.fn, "fallbacks", 0):
                    lines.append(f"        ran them one by one in {rec.fn.fallbacks} replays (its "
                                 "input came with other strides than when recorded)")
            nodes = [n for n in rec.info if isinstance(n, str)]
            if nodes:
                when = ("" if self._rules_fused or not (self.fused or self.dropped)
                        else " (as recorded, before the rewrites)")
                lines.append(f"        runs {len(nodes)} backward rules{when}: {_counted(nodes)}")
        if self.dropped:
            labels = [label for label, _ in self.dropped]
            whys = "; ".join(dict.fromkeys(f"{label}: {why}" for label, why in self.dropped))
            lines.append(f"dropped {len(labels)} calls that change nothing: "
                         f"{_counted(labels)} ({whys})")
        lines.append("the replay drops each tensor after its last call (backward frees as it goes)")
        lines.append(self.memory.describe() if self.memory is not None else
                     "memory: no arena (each op allocates its results as in eager mode)")
        return "\n".join(lines)

    def summary(self):
        """Time per kind of call over the replays so far, most first."""
        by = {}
        for rec in self.records:
            calls, seconds = by.get(rec.label, (0, 0.0))
            by[rec.label] = (calls + rec.calls, seconds + rec.seconds)
        total = sum(s for _, s in by.values()) or 1.0
        n = max(self.replays, 1)
        lines = [f"{self.replays} replays; per replay:",
                 f"{'call':<36} {'calls':>6} {'ms':>9} {'%':>6}"]
        for label, (calls, seconds) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{label:<36} {calls / n:6.0f} {seconds / n * 1e3:9.3f} "
                         f"{100 * seconds / total:6.1f}")
        return "\n".join(lines)


def _counted(labels):
    counts = {}
    for n in labels:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


def _last_uses(records, n, result):
    """release[i]: the slots record i reads (or makes) for the last time; the result's
    slots are kept to the end."""
    last = {}
    for i, rec in enumerate(records):
        used = []
        for a in list(rec.args) + list(rec.kwargs.values()):
            slots_in(a, used)
        used.extend(slot for _, slot in rec.outs)
        for slot in used:
            last[slot] = i
    keep = set(slots_in(result, []))
    release = [[] for _ in records]
    for slot, i in last.items():
        if slot not in keep:
            release[i].append(slot)
    return release


def _dig(value, path):
    for i in path:
        value = value[i]
    return value


def _kib(n):
    return f"{n} B" if n < 1024 else f"{n / 1024:,.1f} KiB"


def _mb(n):
    return f"{n / 2**20:.2f} MiB"


def _flops(rec):
    """Matrix-product FLOPs of a record, from its input shapes (2 per multiply-add)."""
    shapes = [i for i in rec.info if isinstance(i, tuple)]
    if len(shapes) < 2 or rec.label not in _FLOP_LABELS:
        return 0
    a, b = shapes[0], shapes[1]
    if rec.label == "F.linear" and len(b) == 2:
        return 2 * _prod(a) * b[0]
    if rec.label == "F.scaled_dot_product_attention" and len(a) >= 2 and len(b) >= 2:
        return 4 * _prod(a) * b[-2]          # q k^T and p v: (.., Tq, hs) x Tk, twice
    if len(a) >= 1 and len(b) >= 2:
        return 2 * _prod(a) * b[-1]          # (.., M, K) @ (.., K, N)
    return 0


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def compare(first, second):
    """None when two recordings did the same calls on the same arguments, else the
    first difference in words."""
    if first.final_grad_mode != second.final_grad_mode:
        return (f"the function left grad mode {first.final_grad_mode} on its first call and "
                f"{second.final_grad_mode} on its second")
    modules = _guards.changed(first.guards, second.guards)
    if modules is not None:
        return modules
    if len(first.records) != len(second.records):
        return (f"the function ran {len(first.records)} ops on its first call and "
                f"{len(second.records)} on its second")
    for i, (a, b) in enumerate(zip(first.records, second.records)):
        if a.fn is not b.fn or a.label != b.label:
            return f"call {i} was {a.label}, then {b.label}"
        if a.grad_mode != b.grad_mode:
            return f"call {i} ({a.label}) ran with grad mode {a.grad_mode}, then {b.grad_mode}"
        if [s for _, s in a.outs] != [s for _, s in b.outs]:
            return f"call {i} ({a.label}) returned a different number of tensors"
        for name, x, y in _arguments(a, b):
            if not _same_argument(x, y):
                return (f"call {i} ({a.label}): argument {name} changed between calls "
                        f"({_short(x)}, then {_short(y)}); a value made outside the ops, or "
                        f"read from a tensor, is baked into a plan")
    return None


def _arguments(a, b):
    if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        yield "count", a.args, b.args
        return
    for i, (x, y) in enumerate(zip(a.args, b.args)):
        yield str(i), x, y
    for k in a.kwargs:
        yield k, a.kwargs[k], b.kwargs[k]


def _same_argument(x, y):
    if type(x) is Slot or type(y) is Slot:
        return x == y
    if type(x) is Seq or type(y) is Seq:
        return (type(x) is Seq and type(y) is Seq and x.kind is y.kind
                and len(x.items) == len(y.items)
                and all(_same_argument(p, q) for p, q in zip(x.items, y.items)))
    return same_constant(x, y)


def _short(x):
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) < 40 else text[:37] + "..."

