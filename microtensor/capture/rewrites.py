"""The rewrite rules of nn's ops, for mt.compile's trusted plans (capture/fuse.py has the
machinery every rule shares, and what a rule may rely on):

- **a dropout that changes nothing**: `F.dropout` returned its own input (p = 0, or
  training off: constants of the call), so the call is dropped and its readers read its
  input.
- **attention on views of one tensor**: `F.scaled_dot_product_attention` (no mask) whose
  q, k and v are views of one tensor made by view calls alone (the `split`, `view`,
  `transpose` of a (B, T, 3C) projection), and the view calls after it that hand its
  whole buffer out (`transpose(1, 2).contiguous().view(B, T, C)`), become one call of
  `attention_on_views`: the kernel reads the heads where they lie and writes the
  gradients of all three in one buffer. Eleven calls and about twelve backward rules
  per attention layer become one of each.
"""
import inspect

from microtensor.core import _core
from microtensor.capture import fuse
from microtensor.capture.recorder import Slot, Seq
from microtensor.ops import attention as _attention_fn
from microtensor.ops import layers as F    # F.dropout lives in ops/layers.py

_SDPA = inspect.signature(_attention_fn.scaled_dot_product_attention)


def drop_identity_dropouts(view):
    i = 0
    while i < len(view.records):
        rec = view.records[i]
        if (rec.fn is F.dropout and len(rec.outs) == 1 and rec.outs[0][0] == () and rec.args
                and type(rec.args[0]) is Slot
                and view.alive[rec.outs[0][1]] is view.alive[rec.args[0].index]):
            # F.dropout returns its input exactly when p == 0 or training is off, which
            # are constants of the record: the replay would return it again
            view.drop(i, rec.args[0].index, "p = 0 or training off: it returns its input")
            continue
        i += 1


def attention_on_views(view):
    i = 0
    while i < len(view.records):
        rec = view.records[i]
        found = (_attention_group(view, i)
                 if rec.fn is _attention_fn.scaled_dot_product_attention else None)
        if found is not None:
            members, call = found
            view.replace(members, i, call)
            i -= sum(1 for j in members if j < i)       # the fused record's place now
        i += 1


def _attention_group(view, i):
    """(record indices, the fused call) for the attention record i, or None where the
    group is not closed or its layouts do not allow it."""
    rec = view.records[i]
    try:
        bound = _SDPA.bind(*rec.args, **rec.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    qkv = [a["query"], a["key"], a["value"]]
    if (any(type(t) is not Slot for t in qkv) or a["attn_mask"] is not None or a["enable_gqa"]
            or len(rec.outs) != 1
            or any(type(a[n]) in (Slot, Seq) or isinstance(a[n], _core.Tensor)
                   for n in ("dropout_p", "is_causal", "scale"))):
        return None
    # back from q, k and v through view calls to the one tensor they are views of
    members, sources = {i}, set()
    for t in qkv:
        source, chain = view.views_back(t.index, rec.grad_mode)
        members |= chain
        sources.add(source)
    if len(sources) != 1:
        return None
    source = sources.pop()
    # forward from the output through view calls read by nothing else
    out_slot, tail = view.views_forward(rec.outs[0][1], rec.grad_mode, i)
    members |= tail
    if not view.closed(members, out_slot):
        return None
    call = _views_call(view, sorted(members), source, out_slot, a, bool(tail))
    return None if call is None else (members, call)


def _views_call(view, members, source, out_slot, a, with_tail):
    """The fused call, when the recorded layouts allow it."""
    alive, records = view.alive, view.records
    x = alive[source]._data
    if not x.flags.c_contiguous or x.size == 0:
        return None
    specs = []
    for name in ("query", "key", "value"):
        spec = fuse.spec_in(alive[a[name].index]._data, x)
        if spec is None:
            return None
        specs.append(spec)
    (_, q, _), (_, k, _), (_, v, _) = specs
    if not (len(q) >= 2 and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
        return None
    if fuse.overlap(specs, x):
        return None
    out_as = None
    if with_tail:
        out = alive[out_slot]._data
        attention = next(j for j in members
                         if records[j].fn is _attention_fn.scaled_dot_product_attention)
        made = alive[records[attention].outs[0][1]]._data
        root = made if made.base is None else made.base
        if not (out.flags.c_contiguous and out.size == root.size and root.base is None
                and fuse.address(out) == fuse.address(root)):
            return None
        out_as = tuple(out.shape)
    batch = q[:-2]
    for (_, shape, _), name in zip(specs, ("query", "key", "value")):
        pairs = _attention_fn._pairs(alive[a[name].index]._data, batch, shape[-2], shape[-1])
        if _attention_fn._owner(pairs) is not _attention_fn._owner(x):
            return None                 # the kernels would read (and write) a copy
    return AttentionOnViews([records[j] for j in members], source, out_slot, tuple(specs),
                            out_as, float(a["dropout_p"]), bool(a["is_causal"]), a["scale"], x)


class AttentionOnViews(fuse.FusedCall):
    """attention_on_views on the replay's tensor when it is laid out as recorded, else
    the calls it stands for."""

    def __init__(self, records, source, out_slot, views, out_as, dropout_p, is_causal,
                 scale, x):
        super().__init__(records, source, out_slot, f"fused attention on views of %{source}", x)
        self.views, self.out_as = views, out_as
        self.dropout_p, self.is_causal, self.scale = dropout_p, is_causal, scale

    def fused(self, x):
        return _attention_fn.attention_on_views(x, self.views, self.chain, self.out_as,
                                                self.dropout_p, self.is_causal, self.scale)


fuse.register_rule(drop_identity_dropouts)
fuse.register_rule(attention_on_views)
