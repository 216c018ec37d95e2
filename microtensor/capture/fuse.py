"""Rewrites of a trusted plan: calls that one fused call does, in the same order of work.

A plan is a list of recorded calls (plan.py). Once its two recordings agree, the rules
below read it, with the op class of each call (the registry's `kind`: "shape" or "index"
for a view op, when it made no new memory) and the tensors of the second recording, and
replace groups of calls by one:

- **a dropout that changed nothing** (p = 0, or training off: F.dropout returns its
  input): the call is dropped and its readers read its input.
- **attention on views of one tensor**: F.scaled_dot_product_attention whose q, k and v
  are views of one tensor made by view ops alone (the `split`, `view`, `transpose` of a
  (B, T, 3C) projection), and the view ops after it (`transpose(1, 2).contiguous()
  .view(B, T, C)`), become one call of `attention_on_views`: the kernel reads the heads
  where they lie and writes the gradients of all three in one buffer. Eleven calls and
  about twelve backward rules per attention layer become one of each.

A rule fires only where its group is closed: every tensor made inside it is read inside
it alone (not by a later call, not in the result, no hook or retain_grad call on it),
every call in it ran in the same grad mode, and the layouts it relies on were checked
on the recording: the fused call checks its input's layout again at each replay and,
where it differs (a plan input that came with other strides), runs the calls it stands
for instead. The numbers are eager's, bit for bit: the same kernels on the same
operands in the same order (tests/test_compile_fusion.py).
"""
import inspect

import numpy as np

from microtensor.core import _core
from microtensor.capture.recorder import Record, Slot, Seq, resolve, slots_in

_attention_fn = F = _SDPA = None     # read at the first fusion (nn imports the capture)


def _ops():
    global _attention_fn, F, _SDPA
    if _SDPA is None:
        from microtensor.nn import _attention_fn as attention, functional
        _attention_fn, F = attention, functional
        _SDPA = inspect.signature(attention.scaled_dot_product_attention)


def fuse(records, alive, result):
    """(records, result template, groups, dropped) after every rule; alive[i] is slot i's
    tensor in the recording the plan was made from. groups: [(label, [labels of the calls
    it stands for])]; dropped: the labels of the calls removed. Both for printing."""
    _ops()
    kinds = {row.label: row.kind for row in _core.registered_ops()}
    before = len(records)
    records, result = _drop_identity_dropouts(records, alive, result)
    dropped = ["F.dropout"] * (before - len(records))
    records, groups = _attention_on_views(records, alive, result, kinds)
    return records, result, groups, dropped


# ---- reading templates -----------------------------------------------------------------

def _reads(rec):
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
    new.out_bytes, new.fused = rec.out_bytes, getattr(rec, "fused", None)
    return new


# ---- a dropout that changed nothing --------------------------------------------------------

def _drop_identity_dropouts(records, alive, result):
    mapping, kept = {}, []
    for rec in records:
        reads = _reads(rec)
        if (rec.fn is F.dropout and len(rec.outs) == 1 and rec.outs[0][0] == () and reads
                and type(rec.args[0] if rec.args else None) is Slot
                and alive[rec.outs[0][1]] is alive[rec.args[0].index]):
            # F.dropout returns its input exactly when p == 0 or training is off, which
            # are constants of the record: the replay would return it again
            source = rec.args[0].index
            mapping[rec.outs[0][1]] = mapping.get(source, source)
            continue
        kept.append(_renamed(rec, mapping) if mapping else rec)
    return kept, _rename(result, mapping)


# ---- attention on views of one tensor -------------------------------------------------------

def _attention_on_views(records, alive, result, kinds):
    readers = {}
    for i, rec in enumerate(records):
        for s in _reads(rec):
            readers.setdefault(s, set()).add(i)
    kept = set(slots_in(result, []))
    made_by = {slot: i for i, rec in enumerate(records) for _, slot in rec.outs}
    replaced, fused_at, groups = set(), {}, []
    for i, rec in enumerate(records):
        if rec.fn is not _attention_fn.scaled_dot_product_attention or i in replaced:
            continue
        found = _attention_group(records, i, alive, readers, kept, made_by, kinds)
        if found is None or found[0] & replaced:
            continue
        members, call, out_slot = found
        replaced |= members
        fused = Record(call.label, call, (Slot(call.source),), {}, [((), out_slot)],
                       rec.grad_mode, [tuple(alive[call.source].shape)])
        fused.out_bytes = sum(records[j].out_bytes for j in members)
        fused.fused = [records[j].label for j in sorted(members)]
        fused_at[i] = fused
        groups.append((call.label, fused.fused))
    if not fused_at:
        return records, []
    out = []
    for i, rec in enumerate(records):
        if i in fused_at:
            out.append(fused_at[i])
        elif i not in replaced:
            out.append(rec)
    return out, groups


def _is_view_call(rec, kinds):
    """A call of a view op: a shape or index op (the registry's classes: `view`,
    `transpose`, `split`, `t[:, :, :C]`) that made no new memory, read one tensor (its
    first argument) and took constants otherwise."""
    return (kinds.get(rec.label) in ("shape", "index") and rec.out_bytes == 0 and rec.args
            and type(rec.args[0]) is Slot and len(_reads(rec)) == 1)


def _attention_group(records, i, alive, readers, kept, made_by, kinds):
    """(record indices, the fused call, its output slot) for the attention record i, or
    None where the group is not closed or its layouts do not allow it."""
    rec = records[i]
    try:
        bound = _SDPA.bind(*rec.args, **rec.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    qkv = [a["query"], a["key"], a["value"]]
    if (any(type(t) is not Slot for t in qkv) or a["attn_mask"] is not None or a["enable_gqa"]
            or any(type(a[n]) in (Slot, Seq) or isinstance(a[n], _core.Tensor)
                   for n in ("dropout_p", "is_causal", "scale"))):
        return None
    members = {i}
    # back from q, k and v through view calls to the one tensor they are views of
    sources = []
    for t in qkv:
        slot = t.index
        while slot in made_by and _is_view_call(records[made_by[slot]], kinds) \
                and records[made_by[slot]].grad_mode == rec.grad_mode:
            members.add(made_by[slot])
            slot = records[made_by[slot]].args[0].index
        sources.append(slot)
    if len(set(sources)) != 1:
        return None
    source = sources[0]
    # forward from the output through view calls read by nothing else
    out_slot, tail = rec.outs[0][1] if len(rec.outs) == 1 else None, []
    if out_slot is None:
        return None
    while out_slot not in kept and len(readers.get(out_slot, ())) == 1:
        j = next(iter(readers[out_slot]))
        nxt = records[j]
        if not (_is_view_call(nxt, kinds) and len(nxt.outs) == 1 and nxt.outs[0][0] == ()
                and nxt.grad_mode == rec.grad_mode and j > i):
            break
        tail.append(j)
        out_slot = nxt.outs[0][1]
    # closed: every tensor made inside is read inside only (the output aside)
    inside = members | set(tail)
    for j in inside:
        for _, slot in records[j].outs:
            if slot == out_slot:
                continue
            if slot in kept or not readers.get(slot, set()) <= inside:
                return None
    call = _views_call(records, sorted(inside), source, out_slot, alive, a,
                       with_tail=bool(tail))
    if call is None:
        return None
    return inside, call, out_slot


def _views_call(records, members, source, out_slot, alive, a, with_tail):
    """The fused call, when the recorded layouts allow it."""
    x = alive[source]._data
    if not x.flags.c_contiguous or x.size == 0:
        return None
    specs = []
    for name in ("query", "key", "value"):
        view = alive[a[name].index]._data
        spec = _spec_in(view, x)
        if spec is None:
            return None
        specs.append(spec)
    (_, q, _), (_, k, _), (_, v, _) = specs
    if not (len(q) >= 2 and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
        return None
    if _overlap(specs, x):
        return None
    out_as = None
    if with_tail:
        out = alive[out_slot]._data
        sdpa_out = alive[records[[j for j in members if records[j].fn is
                                 _attention_fn.scaled_dot_product_attention][0]].outs[0][1]]._data
        root = sdpa_out if sdpa_out.base is None else sdpa_out.base
        if not (out.flags.c_contiguous and out.size == root.size and root.base is None
                and _address(out) == _address(root)):
            return None
        out_as = tuple(out.shape)
    batch = specs[0][1][:-2]
    for (_, shape, _), name in zip(specs, ("query", "key", "value")):
        view = alive[a[name].index]._data
        pairs = _attention_fn._pairs(view, batch, shape[-2], shape[-1])
        if _attention_fn._owner(pairs) is not _attention_fn._owner(x):
            return None                 # the kernels would read (and write) a copy
    return AttentionOnViews(records, members, source, out_slot, tuple(specs), out_as,
                            float(a["dropout_p"]), bool(a["is_causal"]), a["scale"], x)


def _address(a):
    return a.__array_interface__["data"][0]


def _spec_in(view, x):
    """(offset in elements, shape, strides) of view inside x's memory, or None."""
    if view.dtype != x.dtype or view.size == 0 or any(s < 0 for s in view.strides):
        return None
    offset = _address(view) - _address(x)
    end = offset + sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize
    if offset < 0 or offset % x.itemsize or end > x.nbytes:
        return None
    return (offset // x.itemsize, tuple(view.shape), tuple(view.strides))


def _overlap(specs, x):
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


class AttentionOnViews:
    """The function of a fused attention record: attention_on_views on the replay's
    tensor when it is laid out as recorded, else the calls it stands for."""

    def __init__(self, records, members, source, out_slot, views, out_as, dropout_p,
                 is_causal, scale, x):
        self.records = [records[j] for j in members]
        self.source, self.out_slot = source, out_slot
        self.views, self.out_as = views, out_as
        self.dropout_p, self.is_causal, self.scale = dropout_p, is_causal, scale
        self.layout = (x.shape, x.strides, x.dtype)
        self.label = f"fused attention on views of %{source}"

    def __call__(self, x):
        d = x._data
        if (d.shape, d.strides, d.dtype) != self.layout:
            return self.chain(x)
        return _attention_fn.attention_on_views(x, self.views, self.chain, self.out_as,
                                                self.dropout_p, self.is_causal, self.scale)

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
