"""`compare_grads`: check gradients worked out by hand against the engine's, tensor by
tensor, in the order backward computes them.

    tensors = {"h": h, "logits": logits, "loss": loss}     # named tensors of a forward
    for t in tensors.values():
        t.retain_grad()                                    # keep non-leaf gradients
    loss.backward()
    report = mt.inspect.compare_grads(tensors, {"loss": dloss, "logits": dlogits, "h": dh})
    print(report)                  # one line per tensor; the first wrong one with a hint
    report.ok, report.first_wrong  # True/False, the name of the first wrong one (or None)

Each line says `exact` (every element equal), `close` (the largest error relative to the
largest gradient element, within `rtol`), `WRONG` (the largest absolute error and the
index where it sits, both values there), `WRONG SHAPE` (both shapes, and the sum over
the axes the forward broadcast when the answer has the broadcast shape), `WRONG DTYPE`
(an answer in float32, an integer or a bool type where the engine's gradient is float64),
`ERROR` (computing it raised, or the answer is no array of real numbers: a ragged list, a
string, a complex array, an object; the line names the type it needs), or `missing` (no
gradient given). NaN where the engine's gradient has NaN counts as equal. The report stops at the first wrong one:
what comes after it was computed from it. There it names the ops that turned the
gradients below it into this one, each with the math line of its backward rule (the
first line of the Node class's docstring), and the later tensors that inherit the error.
"""
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from microtensor.core._core import Tensor
from microtensor.inspect.visits import backward_order

__all__ = ["compare_grads", "backward_names", "GradReport", "GradLine", "retain_grads", "math_line",
           "math_rule"]

# the default rtol per dtype of the engine's gradient: a few hundred ulps of the
# largest element, which separates rounding from a wrong rule by orders of magnitude
RTOL = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2}
GOOD = ("exact", "close")


def math_line(node):
    """The math of a node's backward rule: the first line of its class docstring (of its
    kernel's, for the elementwise nodes that share one class and differ by kernel)."""
    lines = _rule_lines(node)
    return lines[0] if lines else "(no math line)"


# a backward term of a rule's docstring: dx =, dW[idx[i]] +=, dx_i =, dmask = ...
_BACKWARD_TERM = re.compile(r"(?<![A-Za-z0-9_])d[A-Za-z_][\w\[\]]*\s*\+?=(?!=)")


def _first_paragraph(doc):
    lines = []
    for line in (doc or "").strip().splitlines():
        if not line.strip():
            break
        lines.append(" ".join(line.split()))
    return lines


def _kernel_lines(node):
    """An elementwise node's rule, from its kernel's docstring ('d tanh(x) = g * (1 - y^2)'),
    past the signature line Cython puts first; [] for other nodes."""
    kernel = None if isinstance(node, type) else getattr(node, "kernel", None)
    doc = getattr(kernel, "__doc__", None) or ""
    parts = [p for p in doc.strip().split("\n\n") if p.strip()]
    if parts and re.match(r"^\w+\(.*\)$", parts[0].strip()):       # the signature
        parts = parts[1:]
    return _first_paragraph(parts[0]) if parts else []


def _rule_lines(node):
    cls = node if isinstance(node, type) else type(node)
    return _kernel_lines(node) or _first_paragraph(cls.__doc__)


def math_rule(node):
    """(forward, backward): the math of a node's rule in full, from the first paragraph of
    its class docstring (the forward, then the backward from its first `dX =` term on).
    An elementwise node's kernel states `d f(x) = ...`: forward y = f(x), backward
    dx = .... A fused rule whose docstring states only the backward gets its forward from
    its `composite` method's docstring (the same op from primitives). '' for a part that
    is not stated. Takes a node or a rule class."""
    cls = node if isinstance(node, type) else type(node)
    kernel = _kernel_lines(node)
    if kernel:
        m = re.match(r"^d\s+(.+?)\s+=\s+(.*)$", kernel[0])
        if m:
            return f"y = {m.group(1)}", "\n".join([f"dx = {m.group(2)}"] + kernel[1:])
    text = "\n".join(_rule_lines(node))
    m = _BACKWARD_TERM.search(text)
    forward, backward = (text[:m.start()], text[m.start():]) if m else (text, "")
    forward = forward.strip().rstrip(";,").strip()
    if not forward and getattr(cls, "composite", None) is not None:
        forward = "\n".join(_first_paragraph(cls.composite.__doc__))
    return forward, backward.strip()


def retain_grads(tensors):
    """t.retain_grad() on every non-leaf tensor of a dict (or list) that requires grad;
    returns its argument, so `retain_grads({...})` can wrap the dict."""
    for t in (tensors.values() if isinstance(tensors, dict) else tensors):
        if isinstance(t, Tensor) and t.requires_grad and t.grad_fn is not None:
            t.retain_grad()
    return tensors


@dataclass
class GradLine:
    """The check of one tensor. status: exact / close / wrong / wrong shape / wrong dtype
    / error / missing; the numbers that say how close or how wrong."""
    name: str
    status: str
    shape: tuple
    mine_shape: Optional[tuple] = None
    max_rel: Optional[float] = None
    max_abs: Optional[float] = None
    index: Optional[tuple] = None
    mine_value: Optional[float] = None
    engine_value: Optional[float] = None
    message: str = ""

    @property
    def good(self):
        return self.status in GOOD

    def text(self, width):
        head = f"{self.name:<{width}}  {str(self.shape):<16}"
        if self.status == "exact":
            return f"{head}exact"
        if self.status == "close":
            return f"{head}close      max rel err {self.max_rel:.1e}"
        if self.status == "wrong":
            where = ", ".join(str(i) for i in self.index)
            return (f"{head}WRONG      max abs err {self.max_abs:.3g} at [{where}]: yours "
                    f"{self.mine_value:.6g}, engine {self.engine_value:.6g}"
                    + (f" ({self.message})" if self.message else ""))
        if self.status == "wrong shape":
            return (f"{head}WRONG SHAPE yours {self.mine_shape}, engine {self.shape}"
                    + (f": {self.message}" if self.message else ""))
        if self.status == "wrong dtype":
            return f"{head}WRONG DTYPE {self.message}"
        if self.status == "error":
            return f"{head}ERROR      {self.message}"
        return f"{head}missing" + (f"    {self.message}" if self.message else "")


@dataclass
class GradReport:
    """What `compare_grads` found. `lines` in backward order, up to the first wrong one;
    `first_wrong` its name (None when there is none); `hint` the ops (name and math line)
    that compute its gradient from the ones before it, `sources` those tensors,
    `inherit` the later tensors computed from it, `unchecked` every tensor after it."""
    lines: list
    first_wrong: Optional[str] = None
    hint: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    inherit: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)
    total: int = 0
    readers: int = 0

    @property
    def ok(self):
        """Every tensor checked and exact or close."""
        return self.first_wrong is None and all(line.good for line in self.lines)

    @property
    def missing(self):
        return [line.name for line in self.lines if line.status == "missing"]

    def __getitem__(self, name):
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def __str__(self):
        width = max([len("tensor")] + [len(line.name) for line in self.lines])
        out = [f"{'tensor':<{width}}  {'shape':<16}result (in the order backward computes them)"]
        out += [line.text(width) for line in self.lines]
        good = sum(line.good for line in self.lines)
        if self.first_wrong is None:
            left = self.missing
            out.append(f"{good} of {self.total} right" + (
                f"; {len(left)} missing, next: {left[0]}" if left else ": all done"))
            return "\n".join(out)
        out.append("")
        status = {line.name: line.status for line in self.lines}
        right = self.sources and all(status.get(n) in GOOD for n in self.sources)
        if not self.hint:
            out.append(f"first wrong: {self.first_wrong}")
        else:
            out.append(f"first wrong: {self.first_wrong}. Its gradient comes from "
                       + (", ".join(self.sources) if self.sources else "the output")
                       + (" (all right above)" if right else "")
                       + " through:")
        for op, math in self.hint:
            out.append(f"  {op:<20}{math}")
        if self.readers > 1:
            out.append(f"{self.first_wrong} is read by {self.readers} ops: its gradient is the "
                       "sum of what each of them sends back")
        if self.inherit:
            shown = ", ".join(self.inherit[:8]) + (" ..." if len(self.inherit) > 8 else "")
            out.append(f"inherit the error ({len(self.inherit)}, not checked): {shown}")
        rest = [n for n in self.unchecked if n not in set(self.inherit)]
        if rest:
            out.append(f"not checked either ({len(rest)}): " + ", ".join(rest[:8])
                       + (" ..." if len(rest) > 8 else ""))
        return "\n".join(out)

    def __repr__(self):
        return (f"GradReport(ok={self.ok}, first_wrong={self.first_wrong!r}, "
                f"checked={len(self.lines)} of {self.total})")


def _key(t):
    return t._node if t._node is not None else id(t)


def _graph(tensors):
    """Walk the graph under the named tensors: the op nodes, and for each tensor key
    (its node, or id() for a leaf) the (consumer node, input index) pairs that read it."""
    consumers = {}
    seen = set()
    work = [t._node for t in tensors.values() if t._node is not None]
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        for i, inp in enumerate(node.inputs):
            if inp is None or not inp._requires_grad:
                continue
            consumers.setdefault(_key(inp), []).append((node, i))
            if inp._node is not None and inp._node not in seen:
                work.append(inp._node)
    return seen, consumers


def _ancestors(t, names_by_key):
    """The named tensors whose gradient passes through t's: those t was computed from."""
    found = []
    if t._node is None:
        return found
    work, seen = [t._node], set()
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        for inp in node.inputs:
            if inp is None or not inp._requires_grad:
                continue
            found += names_by_key.get(_key(inp), [])
            if inp._node is not None:
                work.append(inp._node)
    return found


def _hint(t, consumers, names_by_key):
    """The ops between t and the named tensors whose gradients make t's: walk forward
    from t through unnamed outputs. Returns ([(op name, math line)], [source names])."""
    ops, sources = [], []
    work, seen = [_key(t)], set()
    while work:
        key = work.pop(0)
        for node, _ in consumers.get(key, []):
            if node in seen:
                continue
            seen.add(node)
            ops.append(node)
            named = names_by_key.get(node)
            if named:
                sources += [n for n in named if n not in sources]
            else:
                work.append(node)
    # distinct rules, each with its math line
    hint, shown = [], set()
    for node in ops:
        if type(node) in shown:
            continue
        shown.add(type(node))
        hint.append((node.name(), math_line(node)))
    return hint, sources


def _what(value):
    """A learner's answer in a few words: its type, and a glimpse of a short one."""
    kind = type(value).__name__
    a = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, (str, bytes)):
        return f"{a} {kind} ({value[:20]!r}{'...' if len(value) > 20 else ''})"
    if isinstance(value, (list, tuple)):
        return f"{a} {kind} of {len(value)} items numpy cannot make one array of numbers " \
               "from (ragged, or not numbers)"
    if isinstance(value, np.ndarray):
        return f"a numpy array of dtype {value.dtype}"
    return f"{a} {kind}"


def _needs(engine):
    return f"a {engine.dtype} numpy array of shape {tuple(engine.shape)}"


def _as_array(mine, engine):
    """(array, None) or (None, the ERROR message) for an answer: a tensor, an array, a
    number, a nested list; anything else is named with the type it needs."""
    if isinstance(mine, Tensor):
        mine = mine.detach().numpy()
    try:
        array = np.asarray(mine)
    except Exception:            # a ragged list, a torch tensor that requires grad, ...
        return None, f"yours is {_what(mine)}; it needs to be {_needs(engine)}"
    if array.dtype.kind == "c" and engine.dtype.kind != "c":
        return None, (f"yours is complex ({array.dtype}); the gradient of a real tensor is "
                      f"real: it needs to be {_needs(engine)}")
    if array.dtype.kind not in "biuf" + ("c" if engine.dtype.kind == "c" else ""):
        return None, f"yours is {_what(mine)}; it needs to be {_needs(engine)}"
    return array, None


def _broadcast_hint(mine_shape, shape):
    """On WRONG SHAPE: the sum that turns a gradient of the broadcast shape into the
    tensor's, when the answer's shape is the tensor's broadcast (axes not summed)."""
    if len(mine_shape) < len(shape):
        if len(mine_shape) == 2 and tuple(mine_shape) == tuple(shape)[::-1]:
            return "transposed?"
        return ""
    try:
        if np.broadcast_shapes(shape, mine_shape) != tuple(mine_shape):
            raise ValueError
    except ValueError:
        if len(mine_shape) == len(shape) == 2 and tuple(mine_shape) == tuple(shape)[::-1]:
            return "transposed?"
        if int(np.prod(mine_shape)) == int(np.prod(shape)) and \
                [n for n in mine_shape if n != 1] == [n for n in shape if n != 1]:
            return f"the same numbers with axes of size 1 dropped or added: reshape to {shape}"
        return ""
    lead = len(mine_shape) - len(shape)
    added = list(range(lead))
    ones = [lead + i for i, n in enumerate(shape) if n == 1 and mine_shape[lead + i] != 1]
    if not added and not ones:
        return ""
    words = []
    for axis in added:
        words.append(f"axis {axis} (the batch axis broadcast in the forward)" if axis == 0
                     else f"axis {axis} (added by broadcasting in the forward)")
    for axis in ones:
        words.append(f"axis {axis} (size 1 in the tensor, broadcast to "
                     f"{mine_shape[axis]} in the forward)")
    axes = added + ones
    spelled = str(axes[0]) if len(axes) == 1 else str(tuple(axes))
    if not ones:
        code = f"g.sum(axis={spelled})"
    elif not added:
        code = f"g.sum(axis={spelled}, keepdims=True)"
    else:
        code = f"g.sum(axis={spelled}, keepdims=True).reshape({shape})"
    return "sum over " + " and ".join(words) + ": " + code


def _check(name, engine, mine, rtol, atol):
    engine = np.asarray(engine._data if isinstance(engine, Tensor) else engine)
    shape = tuple(engine.shape)
    if mine is None:
        return GradLine(name, "missing", shape)
    if isinstance(mine, BaseException):
        where = getattr(mine, "where", "")
        return GradLine(name, "error", shape, message=f"{type(mine).__name__}: {mine}"
                                                      + (f" ({where})" if where else ""))
    mine, problem = _as_array(mine, engine)
    if problem:
        return GradLine(name, "error", shape, message=problem)
    dtype = mine.dtype
    if mine.shape != shape:
        if mine.size == 1 and engine.size == 1:
            mine = mine.reshape(shape)
        else:
            return GradLine(name, "wrong shape", shape, mine_shape=tuple(mine.shape),
                            message=_broadcast_hint(tuple(mine.shape), shape))
    # the dtype the gradient needs: the engine's, or one that holds it exactly (a float64
    # answer to a float32 gradient is fine; float32, an integer or a bool is flagged)
    low = dtype.kind not in "fc" or np.promote_types(dtype, engine.dtype) != dtype
    wide = np.complex128 if engine.dtype.kind == "c" else np.float64
    mine = mine.astype(wide)
    ref = engine.astype(wide)
    nan_mine, nan_ref = np.isnan(mine), np.isnan(ref)
    same = (mine == ref) | (nan_mine & nan_ref)       # NaN where the engine has NaN: equal
    if same.all():
        if low:
            return GradLine(name, "wrong dtype", shape, max_rel=0.0, max_abs=0.0,
                            message=f"{dtype}, expected {engine.dtype} (the values are equal)")
        return GradLine(name, "exact", shape, max_rel=0.0, max_abs=0.0)
    diff = np.where(same, 0.0, np.abs(mine - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max())
    finite = np.abs(ref[np.isfinite(ref)])
    scale = float(finite.max()) if finite.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    if rtol is None:
        rtol = RTOL.get(engine.dtype, 1e-4)
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), shape)) if shape else ()
    if max_abs <= atol or max_rel <= rtol:
        if low:
            return GradLine(name, "wrong dtype", shape, max_rel=max_rel, max_abs=max_abs,
                            message=f"{dtype}, expected {engine.dtype} (the values are "
                                    f"close: max rel err {max_rel:.1e})")
        return GradLine(name, "close", shape, max_rel=max_rel, max_abs=max_abs)
    if low and dtype.kind == "f" and max_rel <= RTOL.get(np.dtype(dtype), 1e-2) * 10:
        return GradLine(name, "wrong dtype", shape, max_rel=max_rel, max_abs=max_abs,
                        index=index, message=f"{dtype}, expected {engine.dtype} (equal to "
                        f"{dtype}'s rounding, max rel err {max_rel:.1e}: compute in "
                        f"{engine.dtype})")
    message = "yours holds NaN or Inf where the engine's does not" \
        if not (np.isfinite(mine) | same).all() else ""
    if low:
        message = f"{dtype}, expected {engine.dtype}" + (f"; {message}" if message else "")
    return GradLine(name, "wrong", shape, max_rel=max_rel, max_abs=max_abs, index=index,
                    mine_value=_real(mine[index]), engine_value=_real(ref[index]),
                    message=message)


def _real(value):
    value = complex(value)
    return value.real if value.imag == 0 else value


def _order(tensors, consumers, roots):
    if roots is None:
        consumed = set(consumers)
        roots = [t for t in tensors.values() if _key(t) not in consumed]
    order = backward_order(roots)
    position = {node: i for i, node in enumerate(order)}

    def when(item):
        index, (name, t) = item
        if t._node is not None:
            return (position.get(t._node, len(order)), index)
        # a leaf's gradient is complete once the last op that read it has run
        last = max((position.get(node, -1) for node, _ in consumers.get(id(t), [])),
                   default=len(order))
        return (last + 0.5, index)
    return [name for _, (name, _) in sorted(enumerate(tensors.items()), key=when)]


def backward_names(tensors, roots=None):
    """The names of {name: tensor} in the order backward completes their gradients (the
    order of compare_grads' report): a tensor made by an op when the engine runs that
    op's rule, a leaf once the last op that read it has run. `roots` as in compare_grads."""
    _, consumers = _graph(tensors)
    return _order(tensors, consumers, roots)


def compare_grads(named, manual, *, rtol=None, atol=0.0, stop=True, roots=None):
    """Check gradients computed by hand against the engine's, one line per tensor in the
    order backward computed them.

    named    {name: tensor} after backward: leaves (their .grad) and intermediates on
             which t.retain_grad() was called before backward (`retain_grads`); or
             {name: gradient} (a numpy array, or a tensor that does not require grad),
             the engine's gradients themselves, checked in the order given;
    manual   {name: gradient} as numpy arrays (or tensors, or numbers); a name that is
             absent or None is `missing`; an exception instance is `error`, and so
             is an answer that is no array of real numbers (one line naming its type);
             an answer of lower precision than the engine's gradient is `wrong dtype`;
    rtol     the largest error, relative to the largest element of the engine's
             gradient, still called `close` (None: 1e-9 for float64 gradients, 1e-4 for
             float32); atol an absolute floor (default 0);
    stop     end the report at the first wrong tensor (the ones after it were computed
             from it); False checks every tensor;
    roots    the tensor(s) backward started from (default: the named tensors no other
             named tensor was computed from, e.g. the loss).
    Returns a GradReport: print it; .ok, .first_wrong, .lines, .inherit in code.
    """
    if not isinstance(named, dict):
        raise TypeError("compare_grads: named must be a dict {name: tensor or gradient}, "
                        f"got {type(named).__name__}")
    if not isinstance(manual, dict):
        raise TypeError("compare_grads: manual must be a dict {name: gradient}, got "
                        f"{type(manual).__name__}")
    unknown = [n for n in manual if n not in named]
    if unknown:
        raise KeyError(f"compare_grads: gradients given for names not in `named`: "
                       f"{', '.join(map(str, unknown))}")
    tensors, engine = {}, {}
    for name, value in named.items():
        if isinstance(value, Tensor) and value.requires_grad:
            tensors[name] = value
            engine[name] = value.grad
        else:
            try:
                engine[name] = np.asarray(value._data if isinstance(value, Tensor) else value,
                                          dtype=None)
            except (TypeError, ValueError):
                raise TypeError(f"compare_grads: named[{name!r}] is neither a tensor nor a "
                                f"gradient ({type(value).__name__})") from None
            if engine[name].dtype.kind not in "fc":
                raise TypeError(f"compare_grads: named[{name!r}] is not a float gradient "
                                f"(dtype {engine[name].dtype})")
    no_grad = [n for n in tensors if engine[n] is None]
    if no_grad:
        raise ValueError(
            f"compare_grads: no gradient in .grad for {', '.join(no_grad[:6])}"
            f"{' ...' if len(no_grad) > 6 else ''}: call retain_grad() on intermediate "
            "tensors before backward (mt.inspect.retain_grads(tensors)), and check that "
            "they lead to the loss")
    names_by_key = {}
    for name, t in tensors.items():
        names_by_key.setdefault(_key(t), []).append(name)
    _, consumers = _graph(tensors)
    if len(tensors) == len(named):
        ordered = _order(tensors, consumers, roots)
    else:
        ordered = list(named)        # plain gradients: no graph to take an order from
    report = GradReport([], total=len(ordered))
    for k, name in enumerate(ordered):
        line = _check(name, engine[name], manual.get(name), rtol, atol)
        report.lines.append(line)
        if line.good or line.status == "missing":
            continue
        if report.first_wrong is None:
            report.first_wrong = name
            t = tensors.get(name)
            if t is not None:
                report.hint, report.sources = _hint(t, consumers, names_by_key)
                report.readers = len(consumers.get(_key(t), []))
                inherit = set(_ancestors(t, names_by_key))
                report.inherit = [n for n in ordered[k + 1:] if n in inherit]
            if stop:
                report.unchecked = ordered[k + 1:]
                break
    return report
