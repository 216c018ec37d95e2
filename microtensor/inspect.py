"""mt.inspect: instruments for seeing backprop.

Three tools, all built on the engine's public pieces (`t.register_hook`,
`t.retain_grad()`, `grad_fn.name()`, `node.inputs`):

- `GradientRecorder`: for one backward pass, the norm of the gradient arriving at
  chosen tensors, or at the input and output of every module call, with a residual
  block's input gradient split into the part that came through the skip path and the
  part that came through the branch.
- `track_modules`: remembers which module call created which graph node (the recorder
  and the graph exporter use it to name and group things).
- `to_dot` / `render` / `build_graph`: the computation graph behind a tensor as
  Graphviz DOT text, and as a PNG (through `dot` when Graphviz is installed, otherwise
  drawn with matplotlib as a layered DAG).

    import microtensor as mt
    from microtensor import inspect as mti

    rec = mti.GradientRecorder(model)
    with rec:                                # module calls in here get hooks
        logits, loss = model(idx, targets)
    loss.backward()                          # the hooks fill in the records
    print(rec.table())
    rec["transformer.h.3"].input_norm, rec["transformer.h.3"].skip_norm

    print(mti.to_dot(loss, module=model))    # parameters labelled by their names
"""
import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from microtensor import _core
from microtensor._core import Tensor

__all__ = ["GradientRecorder", "GradRecord", "ResidualUnit", "track_modules", "ModuleCalls",
           "Graph", "build_graph", "to_dot", "render", "dot_available", "save_small_png"]


def _norm(array):
    """The 2-norm of a gradient, accumulated in float64 (a float32 sum of 10^6 squares
    loses digits)."""
    return float(math.sqrt(np.sum(np.square(np.asarray(array, dtype=np.float64)))))


def _grad_tensors(obj):
    """The tensors inside a call's arguments or result (tuples, lists, dicts), in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _grad_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _grad_tensors(item)]
    return []


# ---- the graph between a call's outputs and its inputs -------------------------------

def _region(out_tensors, stop_tensors):
    """The op nodes reachable (backwards) from `out_tensors`, not going past
    `stop_tensors`: the part of the graph a module call built.

    Returns (nodes in discovery order, {node: the tensor it produced})."""
    stop_nodes = {t._node for t in stop_tensors if t._node is not None}
    produced = {}
    order = []
    seen = set()
    work = []
    for t in out_tensors:
        node = t._node
        if node is None or node in stop_nodes or node in seen:
            continue
        seen.add(node)
        produced[node] = t
        work.append(node)
    while work:
        node = work.pop()
        order.append(node)
        for inp in node.inputs:
            if inp is None or inp._node is None or not inp._requires_grad:
                continue
            m = inp._node
            if m in stop_nodes or m in seen:
                continue
            seen.add(m)
            produced[m] = inp
            work.append(m)
    return order, produced


def _reaches(start, target, region):
    """(does the graph above tensor `start` contain tensor `target`,
        does it touch a leaf that requires grad other than `target`), inside `region`."""
    target_node = target._node
    found, touches_param = False, False
    work = [start]
    seen = set()
    while work:
        t = work.pop()
        if t is target or (target_node is not None and t._node is target_node):
            found = True
            continue
        node = t._node
        if node is None:
            if t._requires_grad:
                touches_param = True
            continue
        if node in seen or node not in region:
            continue
        seen.add(node)
        for inp in node.inputs:
            if inp is not None and inp._requires_grad:
                work.append(inp)
    return found, touches_param


def _residual_adds(region_nodes):
    """The additions z = s + b inside a region where the branch b was computed from the
    stream s (s is an ancestor of b) through something with parameters: the skip
    connections. Returns [(add_node, index of s, index of b)]."""
    region = set(region_nodes)
    found = []
    for node in region_nodes:
        if node.name() != "AddBackward" or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or not (a._requires_grad and b._requires_grad):
            continue
        if a is b or (a._node is not None and a._node is b._node):
            continue                                  # x + x is a doubling, not a skip
        if tuple(a.shape) != tuple(b.shape):
            continue
        for s_index, (s, branch) in enumerate(((a, b), (b, a))):
            reached, has_params = _reaches(branch, s, region)
            if reached and has_params:
                found.append((node, s_index, 1 - s_index))
                break
    return found


def _skip_path_grad(y, x, region_nodes, residual_adds, grad_y):
    """dL/dx along the skip path alone: a backward pass from y to x through the region
    with every residual branch cut. For y = x + f(x) this is just dL/dy; for a post-norm
    block it is dL/dy carried back through the norms that sit on the skip path.

    Runs inside the hook at y, before the engine has run (or freed) any node of the
    region, calling each node's own backward rule."""
    cut = {(node, b_index) for node, _, b_index in residual_adds}
    region = set(region_nodes)
    x_node = x._node

    def is_x(t):
        return t is x or (x_node is not None and t._node is x_node)

    # the nodes from which x can be reached without crossing a cut edge
    on_path = {}

    def edges(node):
        for i, inp in enumerate(node.inputs):
            if inp is None or not inp._requires_grad or (node, i) in cut:
                continue
            yield i, inp

    # iterative post-order: a node is on the path if one of its kept inputs is x or is
    # on the path
    for root in region_nodes:
        if root in on_path:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in on_path:
                continue
            if not expanded:
                stack.append((node, True))
                for _, inp in edges(node):
                    m = inp._node
                    if m is not None and m in region and m not in on_path and not is_x(inp):
                        stack.append((m, False))
                continue
            hit = False
            for _, inp in edges(node):
                if is_x(inp):
                    hit = True
                elif inp._node is not None and on_path.get(inp._node, False):
                    hit = True
            on_path[node] = hit
    if y._node is None or not on_path.get(y._node, False):
        return np.zeros(x.shape, dtype=np.asarray(grad_y).dtype)

    # Kahn's order over the path nodes, consumers first
    consumers = {n: 0 for n, hit in on_path.items() if hit}
    for node in consumers:
        for _, inp in edges(node):
            m = inp._node
            if m in consumers and not is_x(inp):
                consumers[m] += 1
    pending = {y._node: np.asarray(grad_y)}
    ready = [n for n, c in consumers.items() if c == 0]
    grad_x = None
    while ready:
        node = ready.pop()
        g = pending.pop(node, None)
        grads = node.backward(g) if g is not None else (None,) * len(node.inputs)
        for i, inp in edges(node):
            gi = grads[i]
            if isinstance(gi, _core.SliceGrad):  # a slice's gradient, made dense here
                gi = gi.dense()
            if is_x(inp):
                if gi is not None:
                    grad_x = gi if grad_x is None else grad_x + gi
                continue
            m = inp._node
            if m not in consumers:
                continue
            if gi is not None:
                pending[m] = gi if m not in pending else pending[m] + gi
            consumers[m] -= 1
            if consumers[m] == 0:
                ready.append(m)
    if grad_x is None:
        return np.zeros(x.shape, dtype=np.asarray(grad_y).dtype)
    return np.asarray(grad_x)


# ---- which module call made which node -------------------------------------------

@dataclass
class ModuleCall:
    """One call of a module: its name (a second call of the same module is `name#1`),
    the tensors it got and returned, its parent call and its depth below the root."""
    name: str
    module: object
    inputs: list
    outputs: list
    parent: Optional["ModuleCall"] = None
    depth: int = 0
    children: list = field(default_factory=list)


class ModuleCalls:
    """The module calls seen inside `track_modules(model)`, and the owner of each graph
    node: the innermost call that created it."""

    def __init__(self, root):
        self.root = root
        self.calls = []
        self.owner = {}          # node -> ModuleCall
        self.param_names = {}    # id(parameter) -> qualified name
        if root is not None:
            for name, p in root.named_parameters():
                self.param_names.setdefault(id(p), name)

    def owner_name(self, node):
        """The name of the call that created `node`, or None for nodes made outside
        every tracked call."""
        call = self.owner.get(node)
        return None if call is None else call.name


class track_modules:
    """`with track_modules(model) as calls:` wraps the `forward` of `model` and of every
    submodule (selected by `modules`, see GradientRecorder) so each call is recorded,
    with the graph nodes it created. Leaving the block restores the modules."""

    def __init__(self, model, modules=None):
        if not hasattr(model, "named_modules"):
            raise TypeError(f"track_modules needs an nn.Module, got {type(model).__name__}")
        self.model = model
        self.select = _module_filter(modules)
        self.calls = ModuleCalls(model)
        self._patched = []
        self._stack = []
        self._counts = {}

    # subclasses (the recorder) add hooks here
    def on_call(self, call, region_nodes, produced):
        pass

    def __enter__(self):
        seen = set()
        for name, module in self.model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._patch(name, module)
        return self.calls

    def __exit__(self, *exc):
        for module, had_own, old in reversed(self._patched):
            # NOTE: the wrapper lives in the instance __dict__, shadowing the class's
            # forward; deleting it brings the class method back.
            if had_own:
                module.__dict__["forward"] = old
            else:
                module.__dict__.pop("forward", None)
        self._patched.clear()
        return False

    def _patch(self, name, module):
        had_own = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        original = module.forward
        tracker = self

        def forward(*args, **kwargs):
            parent = tracker._stack[-1] if tracker._stack else None
            count = tracker._counts.get(name, 0)
            tracker._counts[name] = count + 1
            call = ModuleCall(name if count == 0 else f"{name}#{count}", module,
                              _grad_tensors((args, kwargs)), [], parent,
                              0 if parent is None else parent.depth + 1)
            tracker._stack.append(call)
            try:
                result = original(*args, **kwargs)
            finally:
                tracker._stack.pop()
            call.outputs = _grad_tensors(result)
            tracker._finish(call)
            return result

        forward.__wrapped__ = original
        module.__dict__["forward"] = forward
        self._patched.append((module, had_own, old))

    def _finish(self, call):
        ins = [t for t in call.inputs if t._requires_grad]
        outs = [t for t in call.outputs if t._requires_grad]
        region_nodes, produced = _region(outs, ins)
        owner = self.calls.owner
        for node in region_nodes:
            owner.setdefault(node, call)     # children returned first and kept theirs
        self.calls.calls.append(call)
        if call.parent is not None:
            call.parent.children.append(call)
        if self.select(call.name.split("#")[0], call.module):
            self.on_call(call, region_nodes, produced)


def _module_filter(modules):
    """None: every module; a type or tuple of types; an iterable of names; a regex
    string; or a callable(name, module) -> bool."""
    if modules is None:
        return lambda name, module: True
    if isinstance(modules, type) or (isinstance(modules, tuple) and modules
                                     and all(isinstance(m, type) for m in modules)):
        return lambda name, module: isinstance(module, modules)
    if isinstance(modules, str):
        pattern = re.compile(modules)
        return lambda name, module: pattern.fullmatch(name) is not None
    if callable(modules):
        return modules
    names = set(modules)
    return lambda name, module: name in names


# ---- the gradient recorder ---------------------------------------------------------

@dataclass
class ResidualUnit:
    """One skip connection z = s + b(s) inside a module: the gradient reaching the stream
    s splits into dL/dz (straight through the addition) and J_b^T dL/dz (through the
    branch b). `label` names the module that computed b when it was a module call."""
    label: str
    skip_norm: Optional[float] = None
    branch_norm: Optional[float] = None
    total_norm: Optional[float] = None


@dataclass
class GradRecord:
    """What one backward pass sent to a watched tensor or through one module call.

    input_norm   |dL/dx| at the call's input tensor(s) (all of them together);
    output_norm  |dL/dy| at its output tensor(s);
    skip_norm    for a residual module, |skip| where skip = dL/dx along the skip path
                 alone (dL/dy for y = x + f(x));
    branch_norm  |dL/dx - skip|, the part that went through the branch(es);
    units        the same split for each skip connection inside the module;
    param_norm   (a property) |dL/dθ| over the module's parameters, from their .grad.
    `grads` holds the arrays ('input', 'output', 'skip', 'branch') with keep_grads=True.
    """
    name: str
    kind: str = "module"
    type: str = ""
    input_norm: Optional[float] = None
    output_norm: Optional[float] = None
    skip_norm: Optional[float] = None
    branch_norm: Optional[float] = None
    units: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    module: object = field(default=None, repr=False, compare=False)

    @property
    def param_norm(self):
        """|dL/dθ| over the module's parameters, read from their `.grad` (so it is this
        backward pass's gradient when .grad was zeroed before it, as in a training step).
        None for tensors, for modules without parameters, and before backward."""
        if self.module is None:
            return None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(math.sqrt(sum(_norm(g._data) ** 2 for g in grads)))

    @property
    def norm(self):
        """For a watched tensor: the norm of its gradient."""
        return self.output_norm

    @property
    def is_residual(self):
        return self.skip_norm is not None


class GradientRecorder(track_modules):
    """Record, for one backward pass, the gradient norms at chosen tensors and at the
    input and output of every module call made inside `with recorder:`.

        rec = GradientRecorder(model, modules=TransformerBlock, keep_grads=False)
        with rec:
            logits, loss = model(idx, targets)
        loss.backward()
        rec.table()

    `modules` selects which calls to record (None: all; a type or tuple of types; a
    list of names; a regex on the qualified name; or callable(name, module)).
    `residual=True` splits the input gradient of modules that contain skip connections
    (an addition z = s + b where b was computed from s through parameters) into skip and
    branch parts. Tensors can be watched without a model: `x = rec.watch(x, "x")`.
    Hooks stay on the graph, so records fill in when backward runs (inside or after the
    `with` block); a second backward through a retained graph overwrites them. Hooks on
    leaf tensors outlive the graph: `remove_hooks()` takes them off.
    """

    def __init__(self, model=None, modules=None, residual=True, keep_grads=False):
        self.residual = residual
        self.keep_grads = keep_grads
        self.records = {}
        self._leaf_handles = []
        if model is not None:
            super().__init__(model, modules)
        else:
            self.model = None
            self._patched = []

    def __enter__(self):
        if self.model is not None:
            super().__enter__()
        return self

    def __exit__(self, *exc):
        if self.model is not None:
            super().__exit__(*exc)
        return False

    def __getitem__(self, name):
        return self.records[name]

    def __iter__(self):
        return iter(self.records.values())

    def __len__(self):
        return len(self.records)

    def clear(self):
        self.records.clear()

    def _hook(self, tensor, fn):
        """tensor.register_hook(fn), remembering the handle when the tensor is a leaf:
        a leaf keeps its hooks for life (a non-leaf's go with its graph)."""
        handle = tensor.register_hook(fn)
        if tensor.grad_fn is None:
            self._leaf_handles.append(handle)
        return handle

    def remove_hooks(self):
        """Unregister the hooks this recorder put on leaf tensors (watched leaves, leaf
        inputs of module calls), so later backward passes do not update the records."""
        for handle in self._leaf_handles:
            handle.remove()
        self._leaf_handles.clear()

    def _keep(self, record, key, array):
        if self.keep_grads:
            record.grads[key] = np.array(array, copy=True)

    # -- chosen tensors ------------------------------------------------------------
    def watch(self, tensor, name=None):
        """Record the norm of the gradient reaching `tensor` (leaf or not); returns it."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"watch() takes a tensor, got {type(tensor).__name__}")
        if not tensor.requires_grad:
            raise RuntimeError("cannot watch a tensor that doesn't require grad")
        name = name or f"tensor{len(self.records)}"
        if name in self.records:
            raise ValueError(f"a record named {name!r} exists already")
        record = self.records[name] = GradRecord(name, kind="tensor", type=str(tuple(tensor.shape)))

        def hook(grad):
            record.output_norm = _norm(grad._data)
            self._keep(record, "output", grad._data)
        self._hook(tensor, hook)
        return tensor

    # -- module calls --------------------------------------------------------------
    def on_call(self, call, region_nodes, produced):
        ins = [t for t in call.inputs if t._requires_grad]
        outs = [t for t in call.outputs if t._requires_grad]
        record = self.records[call.name] = GradRecord(call.name, type=type(call.module).__name__,
                                                      module=call.module)
        _hook_group(self, outs, record, "output_norm")
        residual_adds = []
        if (self.residual and len(ins) == 1 and len(outs) == 1
                and tuple(ins[0].shape) == tuple(outs[0].shape)):
            # region_nodes run from the output back; the units read better in forward order
            residual_adds = _residual_adds(region_nodes)[::-1]
        if not residual_adds:
            _hook_group(self, ins, record, "input_norm")
            return
        x, y = ins[0], outs[0]
        skip_box = {}

        def at_output(grad):
            skip = _skip_path_grad(y, x, region_nodes, residual_adds, grad._data)
            skip_box["skip"] = skip
            record.skip_norm = _norm(skip)
            self._keep(record, "skip", skip)

        def at_input(grad):
            total = grad._data
            record.input_norm = _norm(total)
            self._keep(record, "input", total)
            skip = skip_box.pop("skip", None)
            if skip is not None:
                branch = total - skip
                record.branch_norm = _norm(branch)
                self._keep(record, "branch", branch)
        self._hook(y, at_output)
        self._hook(x, at_input)
        self._hook_units(record, call, residual_adds, produced)

    def _hook_units(self, record, call, residual_adds, produced):
        """Per skip connection z = s + b: skip = dL/dz, branch = dL/ds - dL/dz."""
        child_outputs = {}
        for other in call.children:
            for t in other.outputs:
                if t._node is not None:
                    child_outputs[t._node] = other.name.rsplit(".", 1)[-1]
        # the addition's output tensor (z): the tensor its node produced
        for k, (node, s_index, b_index) in enumerate(residual_adds):
            s, b = node.inputs[s_index], node.inputs[b_index]
            label = child_outputs.get(b._node, f"branch{k}")
            unit = ResidualUnit(label)
            record.units.append(unit)
            z = produced.get(node)
            if z is None:
                continue
            box = {}

            def at_z(grad, unit=unit, box=box):
                box["z"] = np.array(grad._data, copy=True)
                unit.skip_norm = _norm(grad._data)

            def at_s(grad, unit=unit, box=box):
                unit.total_norm = _norm(grad._data)
                gz = box.pop("z", None)
                if gz is not None:
                    unit.branch_norm = _norm(grad._data - gz)
            self._hook(z, at_z)
            self._hook(s, at_s)

    # -- reading the records -------------------------------------------------------
    def table(self, units=False):
        """The records as a text table (norms to 4 significant digits); with `units`,
        one extra row per skip connection inside a module."""
        def fmt(v):
            return "-" if v is None else f"{v:.4g}"
        rows = [("name", "type", "|dL/d in|", "|dL/d out|", "|skip|", "|branch|", "|dL/dθ|")]
        for r in self.records.values():
            if r.kind == "tensor":
                rows.append((r.name, f"tensor {r.type}", "", fmt(r.norm), "", "", ""))
                continue
            rows.append((r.name or "(root)", r.type, fmt(r.input_norm), fmt(r.output_norm),
                         fmt(r.skip_norm), fmt(r.branch_norm), fmt(r.param_norm)))
            if units:
                for u in r.units:
                    rows.append((f"  + {u.label}", "skip connection", fmt(u.total_norm), "",
                                 fmt(u.skip_norm), fmt(u.branch_norm), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                 for row in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        return "\n".join(lines)


def _hook_group(recorder, tensors, record, attr):
    """Hook every tensor of a call's inputs (or outputs): `record.<attr>` becomes the
    joint norm of the gradients that reached them, updated as each one arrives."""
    squares = {}
    for i, t in enumerate(tensors):
        key = t._node if t._node is not None else id(t)
        if key in squares:                          # the same tensor twice: once
            continue
        squares[key] = None

        def hook(grad, key=key):
            squares[key] = _norm(grad._data) ** 2
            setattr(record, attr, math.sqrt(sum(v for v in squares.values() if v is not None)))
            if len(squares) == 1:
                recorder._keep(record, attr.split("_")[0], grad._data)
        recorder._hook(t, hook)


# ---- the computation graph as DOT text and as a picture ------------------------------

@dataclass
class GraphNode:
    """One box of the drawn graph: an op (kind 'op'), a leaf tensor ('param' when it is a
    module's parameter, else 'leaf'), or a collapsed module ('module')."""
    id: str
    kind: str
    label: str
    shape: tuple = ()
    group: Optional[str] = None    # the module call that owns it (None: outside modules)
    count: int = 1                 # ops folded into a 'module' box


class Graph:
    """The computation graph behind one or more tensors, ready to print or draw.

    `nodes` maps id -> GraphNode, `edges` is a list of (source id, target id) in the
    direction data flows in forward (an input points at the op that reads it; backward
    walks the arrows the other way); `skip_edges` are the edges that carry a residual
    stream into its addition (drawn thick and orange). Build it with `build_graph(...)`.
    """

    def __init__(self, nodes, edges, root_ids, title="", skip_edges=()):
        self.nodes = nodes
        self.edges = edges
        self.root_ids = root_ids
        self.title = title
        self.skip_edges = set(skip_edges)   # edges into a residual addition from its stream

    @property
    def num_ops(self):
        return sum(1 for n in self.nodes.values() if n.kind == "op")

    def to_dot(self, clusters=True):
        """Graphviz DOT text. With `clusters`, nodes owned by a module call are drawn
        inside a box labelled with the module's name (nested as the calls nest)."""
        lines = ["digraph microtensor {",
                 "  graph [rankdir=TB, fontname=Helvetica, fontsize=10];",
                 "  node [fontname=Helvetica, fontsize=9, style=filled];",
                 "  edge [arrowsize=0.6];"]
        if self.title:
            lines.append(f"  label={_dot_quote(self.title)}; labelloc=t;")
        style = {"op": 'shape=box, style="rounded,filled", fillcolor="#e8e8e8"',
                 "param": 'shape=box, fillcolor="#bcd8f0"',
                 "leaf": 'shape=box, fillcolor="#fff2a8"',
                 "module": 'shape=box3d, fillcolor="#c8eac0"'}

        def node_line(n, indent):
            extra = ', penwidth=2, color="#c04000"' if n.id in self.root_ids else ""
            return f"{indent}{n.id} [label={_dot_quote(n.label)}, {style[n.kind]}{extra}];"

        groups = {}
        for n in self.nodes.values():
            groups.setdefault(n.group if clusters else None, []).append(n)
        # clusters nest by name prefix: "h.0.attn" sits inside "h.0"
        names = sorted(g for g in groups if g is not None)
        children = {}
        for g in names:
            parent = None
            for other in names:
                if other != g and g.startswith(other + ".") and (
                        parent is None or len(other) > len(parent)):
                    parent = other
            children.setdefault(parent, []).append(g)
        for n in groups.get(None, []):
            lines.append(node_line(n, "  "))
        counter = [0]

        def emit(g, depth):
            indent = "  " * depth
            counter[0] += 1
            lines.append(f"{indent}subgraph cluster_{counter[0]} {{")
            lines.append(f"{indent}  label={_dot_quote(g)}; style=rounded; color=\"#808080\";")
            for n in groups.get(g, []):
                lines.append(node_line(n, indent + "  "))
            for c in children.get(g, []):
                emit(c, depth + 1)
            lines.append(f"{indent}}}")
        for g in children.get(None, []):
            emit(g, 1)
        for a, b in self.edges:
            extra = ' [color="#e07000", penwidth=2]' if (a, b) in self.skip_edges else ""
            lines.append(f"  {a} -> {b}{extra};")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def save_png(self, path, dpi=90, engine="auto"):
        """Draw the graph to a PNG: with Graphviz's `dot` when it is installed (and
        engine is 'auto' or 'dot'), otherwise with matplotlib ('matplotlib')."""
        if engine not in ("auto", "dot", "matplotlib"):
            raise ValueError(f"engine must be 'auto', 'dot' or 'matplotlib', got {engine!r}")
        if engine == "dot" or (engine == "auto" and dot_available()):
            if not dot_available():
                raise RuntimeError("engine='dot' needs Graphviz's `dot` program on PATH")
            subprocess.run(["dot", "-Tpng", f"-Gdpi={dpi}", "-o", str(path)],
                           input=self.to_dot().encode(), check=True)
            return path
        return _draw_layered(self, path, dpi)


def dot_available():
    """True when Graphviz's `dot` program is on PATH."""
    return shutil.which("dot") is not None


def _dot_quote(text):
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _shape_text(shape):
    return str(tuple(int(s) for s in shape))


def build_graph(tensors, module=None, calls=None, names=None, collapse=False, depth=0,
                title=""):
    """The computation graph behind `tensors` (a tensor or a list of them).

    module   an nn.Module: its parameters are labelled by their qualified names;
    calls    the ModuleCalls from `with track_modules(model) as calls:` (needed to
             group by module): each op knows the module call that created it;
    names    {name: tensor} to label other tensors (inputs, intermediates);
    collapse False: every op is a node (grouped in clusters when `calls` is given);
             True: one node per module call at `depth` below the root call (0: the
             modules the root's forward calls directly), ops outside any such call stay
             as they are; parameters fold into the module that uses them.
    """
    roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if not roots or not all(isinstance(t, Tensor) for t in roots):
        raise TypeError("build_graph takes a tensor or a list of tensors")
    if collapse and calls is None:
        raise ValueError("collapse=True needs to know which module made each op: run the "
                         "forward inside `with mt.inspect.track_modules(model) as calls:` "
                         "and pass calls=calls")
    param_names = {}
    if calls is not None:
        param_names.update(calls.param_names)
    if module is not None:
        for name, p in module.named_parameters():
            param_names.setdefault(id(p), name)
    tensor_names = {}
    for name, t in (names or {}).items():
        tensor_names[id(t)] = name
        if t._node is not None:
            tensor_names[id(t._node)] = name

    # walk the graph once: op nodes, leaves, and edges input -> consumer
    op_ids, leaf_ids = {}, {}
    out_shape = {}
    nodes, edges = {}, []
    work = []
    root_ids = set()

    def visit_tensor(t):
        """The graph id of tensor t (an op node or a leaf), registering it once."""
        if t._node is not None:
            node = t._node
            if node not in op_ids:
                op_ids[node] = f"op{len(op_ids)}"
                out_shape[node] = tuple(t.shape)
                work.append(node)
            return op_ids[node]
        key = id(t)
        if key not in leaf_ids:
            leaf_ids[key] = f"leaf{len(leaf_ids)}"
            pname = param_names.get(key)
            label = pname or tensor_names.get(key) or "input"
            nodes[leaf_ids[key]] = GraphNode(leaf_ids[key], "param" if pname else "leaf",
                                             f"{label}\n{_shape_text(t.shape)}", tuple(t.shape),
                                             _param_group(pname, calls))
        return leaf_ids[key]

    for t in roots:
        if not t.requires_grad:
            raise ValueError("the tensor does not require grad, so it has no graph to draw")
        root_ids.add(visit_tensor(t))
    while work:
        node = work.pop()
        nid = op_ids[node]
        for inp in node.inputs:
            if inp is None or not inp._requires_grad:
                continue
            edges.append((visit_tensor(inp), nid))
    for node, nid in op_ids.items():
        label = node.name()
        if id(node) in tensor_names:
            label = f"{tensor_names[id(node)]} = {label}"
        group = calls.owner_name(node) if calls is not None else None
        group = group or None            # the root call's own ops sit outside clusters
        nodes[nid] = GraphNode(nid, "op", f"{label}\n{_shape_text(out_shape[node])}",
                               out_shape[node], group)
    # the skip connections: the stream's edge into each residual addition
    skip_edges = set()
    for node, s_index, _ in _residual_adds(list(op_ids)):
        stream = node.inputs[s_index]
        source = op_ids[stream._node] if stream._node is not None else leaf_ids[id(stream)]
        skip_edges.add((source, op_ids[node]))
    graph = Graph(nodes, edges, root_ids, title, skip_edges)
    if collapse:
        graph = _collapse(graph, op_ids, calls, depth)
    return graph


def _param_group(pname, calls):
    """The call that owns a parameter: the module whose name prefixes it."""
    if pname is None or calls is None:
        return None
    owner = pname.rsplit(".", 1)[0] if "." in pname else ""
    called = {c.name for c in calls.calls}
    while owner and owner not in called:
        owner = owner.rsplit(".", 1)[0] if "." in owner else ""
    return owner or None


def _collapse(graph, op_ids, calls, depth):
    """One node per module call at `depth` below the root; edges between them merged."""
    by_name = {c.name: c for c in calls.calls}
    target = {}                      # graph id -> collapsed group name or None

    def at_depth(name):
        """The call at depth + 1 that contains `name`'s call, or None when the op belongs
        to a shallower call (those ops stay visible: e.g. a block's residual additions)."""
        call = by_name.get(name)
        if call is None or call.depth < depth + 1:
            return None
        while call.depth > depth + 1:
            call = call.parent
        return call.name

    for node, nid in op_ids.items():
        target[nid] = at_depth(calls.owner_name(node))
    for nid, n in graph.nodes.items():
        if n.kind != "op":
            target[nid] = at_depth(n.group) if n.group is not None else None
    nodes, edges, seen = {}, [], set()
    counts = {}
    for nid, n in graph.nodes.items():
        g = target[nid]
        if g is None:
            nodes[nid] = GraphNode(n.id, n.kind, n.label, n.shape, n.group)
        else:
            if n.kind == "op":
                counts[g] = counts.get(g, 0) + 1
    module_ids = {}
    for g in sorted(counts, key=lambda name: [c.name for c in calls.calls].index(name)):
        mid = f"mod{len(module_ids)}"
        module_ids[g] = mid
        module = by_name[g].module
        ops = f"{counts[g]} op" + ("s" if counts[g] > 1 else "")
        nodes[mid] = GraphNode(mid, "module", f"{g}\n{type(module).__name__}, {ops}", (), None,
                               counts[g])
    # parameters of a collapsed module disappear into it; other targets map to the box
    rename = {}
    for nid in graph.nodes:
        g = target[nid]
        rename[nid] = nid if g is None else module_ids.get(g)
    root_ids = {rename[r] for r in graph.root_ids if rename.get(r)}
    for a, b in graph.edges:
        ra, rb = rename.get(a), rename.get(b)
        if ra is None or rb is None or ra == rb or (ra, rb) in seen:
            continue
        seen.add((ra, rb))
        edges.append((ra, rb))
    skip_edges = {(rename[a], rename[b]) for a, b in graph.skip_edges
                  if rename.get(a) and rename.get(b) and rename[a] != rename[b]}
    return Graph(nodes, edges, root_ids, graph.title, skip_edges)


def to_dot(tensors, module=None, calls=None, names=None, collapse=False, depth=0,
           clusters=True, title=""):
    """The computation graph behind `tensors` as Graphviz DOT text (see build_graph)."""
    return build_graph(tensors, module, calls, names, collapse, depth, title).to_dot(clusters)


def render(tensors, path, module=None, calls=None, names=None, collapse=False, depth=0,
           title="", dpi=90, engine="auto"):
    """Draw the graph behind `tensors` to `path`: a .dot path gets DOT text, anything else
    a PNG (Graphviz when installed, else matplotlib). Returns the Graph."""
    graph = build_graph(tensors, module, calls, names, collapse, depth, title)
    if str(path).endswith(".dot"):
        with open(path, "w") as f:
            f.write(graph.to_dot())
    else:
        graph.save_png(path, dpi=dpi, engine=engine)
    return graph


# ---- a layered drawing with matplotlib (when Graphviz is missing) -----------------

def _layout(graph, box_w, gap_x=0.25):
    """A layered (Sugiyama-style) layout in the direction of data flow.

    1. layers: longest path from the sources, then sources (parameters, inputs) pulled
       down to sit just above their first consumer;
    2. an edge spanning several layers gets a waypoint in each layer it crosses, so it
       can bend around the boxes in between;
    3. order inside a layer by the barycentre of the neighbours, sweeping down and up;
    4. x positions: each box moves towards the mean x of its neighbours, then boxes are
       pushed apart to their minimum spacing, a few rounds.
    Returns (rows of ids, {id: x}, {edge index: [waypoint ids]}, widths incl. waypoints).
    """
    ids = list(graph.nodes)
    preds = {i: [] for i in ids}
    succs = {i: [] for i in ids}
    for a, b in graph.edges:
        preds[b].append(a)
        succs[a].append(b)
    indeg = {i: len(set(preds[i])) for i in ids}
    order, ready = [], [i for i in reversed(ids) if indeg[i] == 0]
    done_preds = {i: set() for i in ids}
    while ready:
        i = ready.pop()
        order.append(i)
        for j in dict.fromkeys(succs[i]):
            done_preds[j].add(i)
            if len(done_preds[j]) == indeg[j]:
                ready.append(j)
    if len(order) < len(ids):
        # NOTE: a cycle can only come from a collapsed view whose grouping does not
        # follow the order of the forward pass; break it by appending what is left
        order += [i for i in ids if i not in set(order)]
    layer = {}
    for i in order:
        layer[i] = 1 + max((layer[p] for p in preds[i] if p in layer), default=-1)
    for i in reversed(order):
        if not preds[i] and succs[i]:
            layer[i] = min(layer[s] for s in succs[i]) - 1
    widths = dict(box_w)
    up = {i: list(preds[i]) for i in ids}      # neighbours one layer up / down, waypoints
    down = {i: list(succs[i]) for i in ids}    # included
    waypoints = {}
    for k, (a, b) in enumerate(graph.edges):
        span = layer[b] - layer[a]
        if span <= 1:
            continue
        chain = [a]
        for step in range(1, span):
            w = f"_w{k}_{step}"
            layer[w] = layer[a] + step
            widths[w] = 0.1
            up[w], down[w] = [], []
            chain.append(w)
        chain.append(b)
        for u, v in zip(chain, chain[1:]):
            down[u].append(v)
            up[v].append(u)
        down[a].remove(b)
        up[b].remove(a)
        waypoints[k] = chain[1:-1]
    rows = {}
    for i in order + [w for chain in waypoints.values() for w in chain]:
        rows.setdefault(layer[i], []).append(i)
    keys = sorted(rows)
    rows = [rows[k] for k in keys]
    slot = {}
    for row in rows:
        for x, i in enumerate(row):
            slot[i] = x
    for sweep in range(8):
        sequence = rows if sweep % 2 == 0 else rows[::-1]
        for row in sequence:
            def bary(i):
                near = [slot[j] for j in (up[i] if sweep % 2 == 0 else down[i])]
                return sum(near) / len(near) if near else slot[i]
            row.sort(key=bary)
            for x, i in enumerate(row):
                slot[i] = x
    xpos = {}
    for row in rows:
        x = 0.0
        for i in row:
            xpos[i] = x + widths[i] / 2
            x += widths[i] + gap_x
    for _ in range(12):
        for row in rows:
            desired = []
            for i in row:
                near = [xpos[j] for j in up[i] + down[i]]
                desired.append(sum(near) / len(near) if near else xpos[i])
            # place left to right at the desired x, never closer than the spacing allows
            placed = []
            for i, want in zip(row, desired):
                if placed:
                    j = placed[-1]
                    want = max(want, xpos[j] + (widths[j] + widths[i]) / 2 + gap_x)
                xpos[i] = want
                placed.append(i)
            # then shift the row so its overshoot is shared evenly
            shift = sum(d - xpos[i] for i, d in zip(row, desired)) / len(row)
            for i in row:
                xpos[i] += shift
    left = min(xpos[i] - widths[i] / 2 for i in xpos)
    for i in xpos:
        xpos[i] -= left
    return rows, xpos, waypoints, widths


def _draw_layered(graph, path, dpi=90):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    from matplotlib.path import Path as MplPath
    from matplotlib.patches import PathPatch, FancyArrowPatch

    colors = {"op": "#e8e8e8", "param": "#bcd8f0", "leaf": "#fff2a8", "module": "#c8eac0"}
    char_w, line_h = 0.068, 0.16    # inches per character / per text line at fontsize 7
    box_w = {i: max(0.5, char_w * max(len(s) for s in n.label.split("\n")) + 0.16)
             for i, n in graph.nodes.items()}
    box_h = {i: line_h * len(n.label.split("\n")) + 0.1 for i, n in graph.nodes.items()}
    rows, xpos, waypoints, widths = _layout(graph, box_w)
    gap_y, margin = 0.35, 0.2
    title_h = 0.35 if graph.title else 0.0
    row_h = [max([box_h[i] for i in row if i in box_h] or [0.1]) for row in rows]
    width = max(max(xpos[i] + widths[i] / 2 for i in xpos) + 2 * margin,
                char_w * 1.3 * len(graph.title) + 2 * margin)
    height = sum(row_h) + gap_y * (len(rows) - 1) + 2 * margin + title_h
    offset_x = (width - 2 * margin - max(xpos[i] + widths[i] / 2 for i in xpos)) / 2 + margin
    center = {}
    y = height - margin - title_h
    for row, rh in zip(rows, row_h):
        for i in row:
            center[i] = (xpos[i] + offset_x, y - rh / 2)
        y -= rh + gap_y
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    if graph.title:
        ax.text(width / 2, height - margin - title_h / 2 + 0.05, graph.title, ha="center",
                va="center", fontsize=9, weight="bold")
    for k, (a, b) in enumerate(graph.edges):
        skip = (a, b) in graph.skip_edges
        color, lw = ("#e07000", 1.6) if skip else ("#707070", 0.7)
        (xa, ya), (xb, yb) = center[a], center[b]
        points = [(xa, ya - box_h[a] / 2)]
        points += [center[w] for w in waypoints.get(k, [])]
        points.append((xb, yb + box_h[b] / 2))
        if len(points) > 2:
            # a smooth bend through the waypoints, the arrow head on the last segment
            verts = [points[0]]
            codes = [MplPath.MOVETO]
            for p in points[1:-1]:
                verts.append(p)
                codes.append(MplPath.LINETO)
            ax.add_patch(PathPatch(MplPath(verts, codes), fc="none", ec=color, lw=lw))
            points = points[-2:]
        ax.add_patch(FancyArrowPatch(points[0], points[1], arrowstyle="-|>", color=color,
                                     lw=lw, mutation_scale=7, shrinkA=0, shrinkB=0.5))
    for i, n in graph.nodes.items():
        cx, cy = center[i]
        w, h = box_w[i], box_h[i]
        root = i in graph.root_ids
        ax.add_patch(FancyBboxPatch((cx - w / 2, cy - h / 2), w, h,
                                    boxstyle="round,pad=0.0,rounding_size=0.05",
                                    fc=colors[n.kind], ec="#c04000" if root else "#404040",
                                    lw=1.6 if root else 0.6))
        ax.text(cx, cy, n.label, ha="center", va="center", fontsize=7, family="monospace")
    save_small_png(fig, path, dpi)
    plt.close(fig)
    return path


def save_small_png(fig, path, dpi=90, colors=64):
    """Save a matplotlib figure as a PNG with an adaptive palette of `colors` colours
    (line drawings need no more), which keeps files at a few tens of KB."""
    import io
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    try:
        from PIL import Image
    except ImportError:          # matplotlib ships with Pillow, but be safe
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
        return path
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path
