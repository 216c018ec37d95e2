"""Rewrites of a trusted plan: calls that one fused call does, in the same order of work.

A plan is a list of recorded calls (plan.py). Once its two recordings agree, every
registered rule reads it through a PlanView (the calls, the slots each reads and makes,
the op class of each call: the registry's `kind`, and the tensors of the second
recording) and may drop a call that changes nothing or replace a group of calls by one.
The rules live beside their ops and register here (`nn/_rewrites.py`: a dropout of p = 0,
and attention on views of one tensor); this module is what every rule shares: reading
templates, walking chains of view calls, the closed-group test, the views' layouts, and
FusedCall, the function of a fused record.

A group may be fused only where it is closed: every tensor made inside it is read
inside it alone (not by a later call, not in the result: a hook or retain_grad call on
it is a read), and every call in it ran in the same grad mode. A fused call relies on
the layouts of the recording; it checks its input's layout again at each replay and,
where it differs (a plan input that came with other strides), runs the calls it stands
for instead. The numbers are eager's, bit for bit (tests/test_compile_fusion.py).
"""
import numpy as np

from microtensor.core import _core
from microtensor.capture.recorder import Record, Slot, Seq, resolve, slots_in

_RULES = []          # rule(view), in the order they were registered


def register_rule(rule):
    """Run rule(view) on every trusted plan (view: a PlanView); returns the rule."""
    if rule not in _RULES:
        _RULES.append(rule)
    return rule


def fuse(records, alive, result):
    """(records, result template, groups, dropped) after every rule; alive[i] is slot i's
    tensor in the recording the plan was made from. groups: [(label, [labels of the calls
    it stands for])]; dropped: [(label, why)] of the calls removed. Both for printing."""
    view = PlanView(records, alive, result)
    for rule in _RULES:
        rule(view)
    return view.records, view.result, view.groups, view.dropped


def reads(rec):
    """The slots a record reads, in its arguments' order."""
    found = []
    for a in rec.args:
        slots_in(a, found)
    for a in rec.kwargs.values():
        slots_in(a, found)
    return found


def _rename(template, mapping):
    kind = type(template)
    if kind is Slot:
        return Slot(mapping.get(template.index, template.index))
    if kind is Seq:
        return Seq(template.kind, [_rename(t, mapping) for t in template.items])
    return template


def _renamed(rec, mapping):
    new = Record(rec.label, rec.fn, tuple(_rename(a, mapping) for a in rec.args),
                 {k: _rename(v, mapping) for k, v in rec.kwargs.items()}, rec.outs,
                 rec.grad_mode, rec.info)
    new.out_bytes, new.fused = rec.out_bytes, rec.fused
    return new


class PlanView:
    """A plan's calls as the rules read and change them."""

    def __init__(self, records, alive, result):
        self.records, self.alive, self.result = list(records), alive, result
        self.kinds = {row.label: row.kind for row in _core.registered_ops()}
        self.groups, self.dropped = [], []
        self._index()

    def _index(self):
        self.readers = {}                    # slot -> indices of the records reading it
        for i, rec in enumerate(self.records):
            for s in reads(rec):
                self.readers.setdefault(s, set()).add(i)
        self.kept = set(slots_in(self.result, []))       # slots in the function's result
        self.made_by = {slot: i for i, rec in enumerate(self.records) for _, slot in rec.outs}

    # -- reading ------------------------------------------------------------------------
    def is_view_call(self, rec):
        """A call of a view op: a shape or index op (the registry's classes: `view`,
        `transpose`, `split`, `t[:, :, :C]`) that made no new memory, read one tensor (its
        first argument) and took constants otherwise."""
        return (self.kinds.get(rec.label) in ("shape", "index") and rec.out_bytes == 0
                and rec.args and type(rec.args[0]) is Slot and len(reads(rec)) == 1)

    def views_back(self, slot, grad_mode):
        """(the slot a chain of view calls started from, the chain's record indices),
        walking back from slot while its maker is a view call in grad_mode."""
        members = set()
        while slot in self.made_by:
            rec = self.records[self.made_by[slot]]
            if not (self.is_view_call(rec) and rec.grad_mode == grad_mode):
                break
            members.add(self.made_by[slot])
            slot = rec.args[0].index
        return slot, members

    def views_forward(self, slot, grad_mode, after):
        """(the last slot, record indices) of the chain of view calls, each the only
        reader of the slot before it, that starts at slot, after record `after`."""
        members = set()
        while slot not in self.kept and len(self.readers.get(slot, ())) == 1:
            j = next(iter(self.readers[slot]))
            rec = self.records[j]
            if not (self.is_view_call(rec) and len(rec.outs) == 1 and rec.outs[0][0] == ()
                    and rec.grad_mode == grad_mode and j > after):
                break
            members.add(j)
            slot = rec.outs[0][1]
        return slot, members

    def closed(self, members, out_slot):
        """Whether every slot the records `members` make, but out_slot, is read by them
        alone and is not in the result."""
        for j in members:
            for _, slot in self.records[j].outs:
                if slot != out_slot and (slot in self.kept
                                         or not self.readers.get(slot, set()) <= members):
                    return False
        return True

    # -- changing -----------------------------------------------------------------------
    def drop(self, i, source, why):
        """Remove record i, whose one output is the tensor in slot `source`: its readers
        (and the result) read source. `why` says so in the plan's printout."""
        rec = self.records.pop(i)
        mapping = {rec.outs[0][1]: source}
        self.records = [_renamed(r, mapping) if j >= i else r
                        for j, r in enumerate(self.records)]
        self.result = _rename(self.result, mapping)
        self.dropped.append((rec.label, why))
        self._index()

    def replace(self, members, at, call):
        """Replace the records `members` by one record of `call` (a FusedCall reading its
        source slot and making its out_slot) made at index `at`."""
        rec = self.records[at]
        fused = Record(call.label, call, (Slot(call.source),), {}, [((), call.out_slot)],
                       rec.grad_mode, [tuple(self.alive[call.source].shape)])
        fused.out_bytes = sum(self.records[j].out_bytes for j in members)
        fused.fused = [self.records[j].label for j in sorted(members)]
        self.records = [fused if j == at else r for j, r in enumerate(self.records)
                        if j == at or j not in members]
        self.groups.append((call.label, fused.fused))
        self._index()


class FusedCall:
    """The function of a fused record: fused(x) on the replay's tensor when it is laid
    out as recorded, else the calls it stands for (`chain`)."""

    def __init__(self, records, source, out_slot, label, x):
        self.records = records           # the calls it stands for, in order
        self.source, self.out_slot, self.label = source, out_slot, label
        self.layout = (x.shape, x.strides, x.dtype)
        self.fallbacks = 0               # replays whose input was laid out otherwise

    def __call__(self, x):
        d = x._data
        if (d.shape, d.strides, d.dtype) != self.layout:
            self.fallbacks += 1
            return self.chain(x)
        return self.fused(x)

    def fused(self, x):
        raise NotImplementedError

    def chain(self, x):
        """The calls this one stands for, on x (the composite, and the path for a tensor
        laid out otherwise)."""
        values = {self.source: x}
        for rec in self.records:
            out = rec.fn(*[resolve(a, values) for a in rec.args],
                         **{k: resolve(v, values) for k, v in rec.kwargs.items()})
            for path, slot in rec.outs:
                value = out
                for p in path:
                    value = value[p]
                values[slot] = value
        return values[self.out_slot]


# ---- layouts ----------------------------------------------------------------------------------

def address(a):
    return a.__array_interface__["data"][0]


def spec_in(view, x):
    """(offset in elements, shape, strides) of view inside x's memory, or None."""
    if view.dtype != x.dtype or view.size == 0 or any(s < 0 for s in view.strides):
        return None
    offset = address(view) - address(x)
    end = offset + sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize
    if offset < 0 or offset % x.itemsize or end > x.nbytes:
        return None
    return (offset // x.itemsize, tuple(view.shape), tuple(view.strides))


def overlap(specs, x):
    """Whether two elements of the views are one element of x (a gradient written there
    would be overwritten, where eager adds): within a view (its dims, by stride, must
    each step past everything the smaller ones span) or between two of them
    (np.shares_memory, exact)."""
    flat = x.reshape(-1)
    views = []
    for offset, shape, strides in specs:
        if any(s % x.itemsize for s in strides):
            return True
        dims = sorted((s, n) for n, s in zip(shape, strides) if n > 1)
        span = x.itemsize
        for s, n in dims:
            if s < span:
                return True
            span = s * (n - 1) + span
        views.append(np.ndarray(shape, x.dtype, buffer=flat, offset=offset * x.itemsize,
                                strides=strides))
    return any(np.shares_memory(a, b) for i, a in enumerate(views) for b in views[i + 1:])
