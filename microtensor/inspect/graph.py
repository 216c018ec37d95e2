"""The computation graph behind a tensor: `build_graph`, `to_dot`, `render`.

A `Graph` has one node per backward node (an op) and per leaf tensor (a parameter,
named as in `model.named_parameters()`, or another input), with edges in the direction
data flows in forward. With the `ModuleCalls` of `track_modules`, ops are grouped by
the module call that made them (Graphviz clusters) or folded into one box per call
(`collapse=True`). It prints as Graphviz DOT text and draws as a PNG: through `dot`
when Graphviz is installed, otherwise with `drawing.py`'s matplotlib layout.
"""
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from microtensor.core._core import Tensor
from microtensor.inspect.drawing import draw_layered
from microtensor.inspect.residual import residual_adds

__all__ = ["GraphNode", "Graph", "build_graph", "to_dot", "render", "dot_available"]


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
    stream into its addition (drawn thick and orange); `origin` maps a box's id to what
    it stands for: [its backward node], [its leaf tensor], or a collapsed module's nodes.
    Build it with `build_graph(...)`.
    """

    def __init__(self, nodes, edges, root_ids, title="", skip_edges=()):
        self.nodes = nodes
        self.edges = edges
        self.root_ids = root_ids
        self.title = title
        self.skip_edges = set(skip_edges)   # edges into a residual addition from its stream
        self.origin = {}                    # id -> [backward nodes or the leaf tensor]

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
        return draw_layered(self, path, dpi)


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
    for node, s_index, _ in residual_adds(list(op_ids)):
        stream = node.inputs[s_index]
        source = op_ids[stream._node] if stream._node is not None else leaf_ids[id(stream)]
        skip_edges.add((source, op_ids[node]))
    graph = Graph(nodes, edges, root_ids, title, skip_edges)
    # what each box stands for: its backward node, or its leaf tensor
    graph.origin = {nid: [node] for node, nid in op_ids.items()}
    leaf_tensors = {}
    for t in _leaves_under(list(op_ids), roots):
        leaf_tensors.setdefault(id(t), t)
    graph.origin.update({lid: [leaf_tensors[key]] for key, lid in leaf_ids.items()
                         if key in leaf_tensors})
    if collapse:
        graph = _collapse(graph, op_ids, calls, depth)
    return graph


def _leaves_under(nodes, roots):
    """The leaf tensors that require grad among the roots and the nodes' inputs."""
    found = [t for t in roots if t._node is None]
    for node in nodes:
        found += [inp for inp in node.inputs
                  if inp is not None and inp._requires_grad and inp._node is None]
    return found


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
    collapsed = Graph(nodes, edges, root_ids, graph.title, skip_edges)
    collapsed.origin = {}
    for nid, members in graph.origin.items():
        if rename.get(nid) is not None:
            collapsed.origin.setdefault(rename[nid], []).extend(members)
    return collapsed


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
