"""Which tensors of a call are one object, or share memory: part of a plan's key and guards.

A recording knows a tensor by its identity: every tensor the function was given gets a
slot, and an op that reads that object again, however the function reached it, reads the
slot. So a recording of `f(x, x)` for `a + 10 * b` reads one slot twice, and replaying it
for `f(x, y)` would give `x + 10 * x`. The same happens when an argument is also a global,
a closure variable, an item of a list the function reads, or a module's tensor (a
parameter, a buffer, a plain tensor attribute): the plan reads the argument where the
function read the other name. So the aliasing of a call is part of what a plan holds for:

- **among the arguments** (in the key, `among`): which tensor arguments, container items
  included, are the same object as an earlier one, and which overlap one in memory (two
  objects that are views of one storage: `x` and `x[1:]`, `x` and `x.T`);
- **between the arguments and the rest** (a guard of each plan, `Beside`): which
  arguments are, or overlap, a tensor the function reaches otherwise: the names it reads
  (and the items of a tuple, list or dict held there), the tensors of every module it
  reaches (parameters, buffers, tensor attributes and the items of a tuple, list or dict
  attribute), and the tensors its records hold as they are (externals).

A call whose aliasing differs from a plan's records another plan (or brings back one that
matches): a replay never reads one argument where the function read another object.
Two views of one storage that touch no common element (`x[:2]`, `x[2:]`) do not overlap.
"""
import operator

import numpy as np

from microtensor.core._core import Tensor

_MAX_WORK = 1 << 16      # np.shares_memory's effort; past it, two views count as overlapping


def _span(array):
    """(lowest, one past the highest) byte address an array touches, or None if empty."""
    if array.size == 0:
        return None
    low = high = array.__array_interface__["data"][0]
    for n, stride in zip(array.shape, array.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + array.itemsize


def _share(a, b):
    """Whether two arrays have an element in common (exactly, within _MAX_WORK)."""
    try:
        return bool(np.shares_memory(a, b, max_work=_MAX_WORK))
    except np.exceptions.TooHardError:
        return True


def among(tensors):
    """The aliasing among a call's tensor arguments, in their order: () when every one is
    its own object with memory of its own, else ((i, j, how), ...) for each pair where
    argument i is argument j ("same") or overlaps it ("overlaps"), j < i."""
    if len(tensors) < 2:
        return ()
    first, spans, found = {}, [], []
    for i, t in enumerate(tensors):
        j = first.setdefault(id(t), i)
        if j != i:
            found.append((i, j, "same"))
            continue
        span = _span(t._data)
        if span is not None:
            spans.append((span[0], span[1], i, t._data))
    # a sweep over the spans by their start: only spans that meet are compared
    spans.sort(key=lambda s: (s[0], s[2]))
    open_ = []
    for low, high, i, data in spans:
        open_ = [s for s in open_ if s[0] > low]
        for _, k, other in open_:
            if _share(data, other):
                found.append((max(i, k), min(i, k), "overlaps"))
        open_.append((high, i, data))
    return tuple(sorted(found))


def tensors_in(value, out):
    """Append the tensors in value, or in a tuple, list or dict it is (one level)."""
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        out.extend(v for v in value if isinstance(v, Tensor))
    elif isinstance(value, dict):
        out.extend(v for v in value.values() if isinstance(v, Tensor))
    return out


def reachable(names, modules, externals):
    """The tensors a call reaches other than through its arguments: those the names it
    reads hold (names.py), those of the modules it reaches (guards.py: each module's
    __dict__ and its parameters and buffers), and the plan's externals. Each once.
    (Not every global of the function's module: a script's loop rebinds its globals
    (`x, y = get_batch()`), and a guard on those objects would fail at every call.)"""
    found = []
    for _, _, _, value in names:
        tensors_in(value, found)
    for instance in modules:
        for name, value in instance.__dict__.items():
            if name in ("_parameters", "_buffers"):
                found.extend(v for v in value.values() if isinstance(v, Tensor))
            elif name != "_modules" and not name.endswith("_hooks"):
                tensors_in(value, found)
    found.extend(externals)
    return list({id(t): t for t in found}.values())


class Beside:
    """A plan's guard on its arguments' aliasing with the tensors it reaches otherwise
    (held: their ids stay theirs). `signature` is that aliasing as recorded."""

    def __init__(self, reached, inputs):
        self.tensors = reached
        self.ids = {id(t): t for t in reached}
        self._arrays = None           # the tensors' arrays when the spans were taken
        self.signature = self.of(inputs)

    def _spans(self):
        arrays = [t._data for t in self.tensors]
        if self._arrays is None or not all(map(operator.is_, arrays, self._arrays)):
            self._spanned = [_span(a) or (0, 0) for a in arrays]   # empty: meets nothing
            self._arrays = arrays
        return self._arrays

    def of(self, inputs):
        """((i, id of the tensor, how), ...) for each argument i that is ("same") or
        overlaps ("overlaps") a reached tensor."""
        if not self.tensors or not inputs:
            return ()
        arrays = self._spans()
        found = []
        for i, t in enumerate(inputs):
            if id(t) in self.ids:
                found.append((i, id(t), "same"))
            span = _span(t._data)
            if span is None:
                continue
            low, high = span
            for k, (lo, hi) in enumerate(self._spanned):
                if (lo < high and hi > low and self.tensors[k] is not t
                        and _share(t._data, arrays[k])):
                    found.append((i, id(self.tensors[k]), "overlaps"))
        return tuple(found)

    def holds(self, inputs):
        return self.of(inputs) == self.signature
