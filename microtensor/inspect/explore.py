"""A training step's autograd graph in one self-contained HTML page: `explore`.

    import microtensor as mt
    ex = mt.inspect.explore(lambda: model(x, y), model=model, optimizer=opt,
                            path="explore.html")      # forward, backward, step, page
    ex                                                 # in Jupyter: the page, inline

`explore` runs the step itself, so that it can watch every part of it:

1. forward: given a function that returns the loss (or a tuple whose last item is the
   loss, as GPT's `model(idx, targets)` returns `(logits, loss)`), it calls it inside
   `track_modules(model)`, so each op knows the module call that made it (`h.0.attn`).
   Given a loss tensor instead, the forward has already run: ops that read a parameter
   are grouped under the parameter's module, the others stay ungrouped (pass
   `calls=` from your own `with track_modules(model) as calls:` for full groups);
2. backward: it runs `loss.backward()` once, as you would, under the engine's per-node
   hook, recording the order the engine runs the nodes in, the gradient reaching each
   node's output (summarised) and the norm of the gradient sent along each edge. The
   loss's backward must not have run yet (call `explore` instead of `loss.backward()`);
   afterwards `p.grad` holds the gradients exactly as after `loss.backward()`;
3. the update: with `optimizer=`, `explore` also calls `optimizer.step()` (and nothing
   else: no clipping, no zero_grad) and records each parameter's |Δw| / |w|; with `lr=`
   instead, the plain SGD step lr·|g| / |w| is shown (nothing is changed); with neither,
   |g| / |w|.

Every tensor is summarised (mean, std, min, max, norm, a histogram; tensors of at most
8 numbers also in full; above 2^20 numbers the histogram counts an even sample: summary.py),
never embedded whole, so the page's size grows with the number of nodes, not with the
tensors: a 2-layer GPT's page is about 100 KB, GPT-2 small's (124M parameters) under
half a MB. The page itself (layout, folding, stepping, search) is in explore_page.py.
"""
import html
import json
import math

import numpy as np

from microtensor.core import _core
from microtensor.core._core import Tensor
from microtensor.inspect.calls import track_modules
from microtensor.inspect.compare import math_line, math_rule
from microtensor.inspect.explore_page import render_page
from microtensor.inspect.graph import build_graph
from microtensor.inspect.residual import residual_adds
from microtensor.inspect.summary import summarise, dense_norm, diff_norm, _finite

__all__ = ["explore", "Explorer"]

class _StepWatch:
    """The engine's per-node hook for one backward pass: order, the gradient each node
    received (summarised), the norm sent along each (node, input) edge, and for each
    residual addition z = s + b the two parts of the gradient reaching the stream s:
    skip, what the addition sends to s (dL/dz), and branch, what every other consumer
    of s sends (dL/ds - dL/dz: the branch may read s more than once, and several
    additions may share one stream, each then counting the others as branch)."""

    def __init__(self, adds, bins):
        self.bins = bins
        self.order, self.received, self.sent = [], {}, {}
        self.skip_slots = {(node, s) for node, s, _ in adds}
        self.skip_grad = {}                       # (add node, s) -> dL/dz, dense float64
        self.stream_total = {}                    # key of s -> dL/ds, dense float64
        for node, s, _ in adds:
            self.stream_total[self._key(node.inputs[s])] = None
        self._outer = None

    @staticmethod
    def _key(t):
        return ("node", t._node) if t._node is not None else ("leaf", id(t))

    def hook(self, node, grad):
        outer = self._outer
        # the gradients as the engine hands them on: each summed to its input's shape
        grads = _core.sum_to_inputs(node, tuple(outer(node, grad) if outer is not None
                                                else node.backward(grad)))
        self.order.append(node)
        self.received[node] = summarise(grad, self.bins)
        for i, gi in enumerate(grads):
            # NOTE: a Python scalar operand (x + 1e-5) has no tensor in node.inputs, yet
            # some rules still return a gradient for its slot: nothing receives it
            if gi is None or i >= len(node.inputs) or node.inputs[i] is None:
                continue
            self.sent[(node, i)] = dense_norm(gi)
            key = self._key(node.inputs[i])
            if key not in self.stream_total:
                continue
            dense = gi.dense() if isinstance(gi, _core.SliceGrad) else np.asarray(gi)
            dense = np.asarray(dense, dtype=np.float64)
            total = self.stream_total[key]
            self.stream_total[key] = dense.copy() if total is None else total + dense
            if (node, i) in self.skip_slots:
                self.skip_grad[(node, i)] = dense.copy()
        return grads

    def split(self, node, s):
        """(|skip|, |branch|) at the addition `node` whose stream is input `s`; None for
        a part no gradient reached."""
        skip = self.skip_grad.get((node, s))
        total = self.stream_total.get(self._key(node.inputs[s]))
        if skip is None:
            return None, None if total is None else dense_norm(total)
        return dense_norm(skip), dense_norm(total - skip)

    def __enter__(self):
        self._outer = _core.get_backward_profiler()
        _core.set_backward_profiler(self.hook)
        return self

    def __exit__(self, *exc):
        _core.set_backward_profiler(self._outer)
        return False


def _loss_of(result):
    if isinstance(result, (tuple, list)) and result:
        result = result[-1]
    if not isinstance(result, Tensor):
        raise TypeError("explore: the function must return the loss (a scalar tensor) or a "
                        f"tuple whose last item is the loss, got {type(result).__name__}")
    return result


def _groups_from_params(graph, model):
    """Without module calls: an op that reads a parameter belongs to its module."""
    names = {id(p): n for n, p in model.named_parameters()}
    for nid, members in graph.origin.items():
        node = graph.nodes[nid]
        if node.kind == "param" and node.group is None:
            name = names.get(id(members[0]), "")
            node.group = name.rsplit(".", 1)[0] if "." in name else None
    for nid, members in graph.origin.items():
        if graph.nodes[nid].kind != "op":
            continue
        for inp in members[0].inputs:
            if inp is not None and inp._node is None and id(inp) in names:
                name = names[id(inp)]
                graph.nodes[nid].group = name.rsplit(".", 1)[0] if "." in name else None
                break


def _group_table(graph, calls, fold):
    """[{name, parent, type, folded}] for every group that owns a node (and its
    ancestors); `fold`: 'auto' folds the repeated blocks (items of a ModuleList, such as
    transformer.h.0) when the graph has more than 40 nodes, 'none' nothing, a list those
    names."""
    used = {n.group for n in graph.nodes.values() if n.group}
    parent, kind = {}, {}
    if calls is not None:
        for call in calls.calls:
            if call.name:
                parent[call.name] = call.parent.name if call.parent and call.parent.name else None
                kind[call.name] = type(call.module).__name__
    names = set()
    for g in used:
        while g and g not in names:
            names.add(g)
            p = parent.get(g)
            if p is None and g not in parent and "." in g:
                p = g.rsplit(".", 1)[0]          # grouped by parameter name: by prefix
            parent.setdefault(g, p)
            g = p
    if fold == "auto":
        folded = {g for g in names if len(graph.nodes) > 40
                  and g.split("#")[0].rsplit(".", 1)[-1].isdigit()}
    elif fold in (None, "none", False):
        folded = set()
    elif isinstance(fold, (list, tuple, set)):
        unknown = sorted(set(fold) - names)
        if unknown:
            raise ValueError(f"explore: fold names groups that own no node: {unknown}; the "
                             f"groups are {sorted(names)}")
        folded = set(fold)
    else:
        raise ValueError(f"explore: fold must be 'auto', 'none' or a list of group names, got "
                         f"{fold!r}")
    order = sorted(names, key=lambda g: (g.count("."), g))
    return [{"name": g, "parent": parent.get(g), "type": kind.get(g, ""),
             "folded": g in folded} for g in order]


def explore(loss, path=None, model=None, optimizer=None, lr=None, calls=None, names=None,
            title=None, fold="auto", bins=24):
    """Run one training step's backward pass (and update) under watch and return an
    `Explorer`: the page as `.html`, its data as `.data`; `.save(path)`; shown inline in
    Jupyter. With `path`, the page is written there too. See the module doc for what
    runs; `names` {name: tensor} labels other leaves (inputs) as in build_graph."""
    if callable(loss) and not isinstance(loss, Tensor):
        if model is None:
            raise ValueError("explore: with a function, pass model= so that its module "
                             "calls can be tracked")
        with track_modules(model) as calls:
            loss = _loss_of(loss())
    if not isinstance(loss, Tensor):
        raise TypeError(f"explore takes the loss tensor or a function returning it, got "
                        f"{type(loss).__name__}")
    if not loss.requires_grad or loss._node is None:
        raise ValueError("explore: the loss does not require grad (no graph behind it); "
                         "was it computed under no_grad, or from tensors without grad?")
    if lr is not None and optimizer is not None:
        raise ValueError("explore: give optimizer= (its step is taken and measured) or lr= "
                         "(a plain SGD step is worked out), not both")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"explore: lr must be a positive number, got {lr!r}")
    graph = build_graph(loss, module=model, calls=calls, names=names)
    if calls is None and model is not None:
        _groups_from_params(graph, model)
    groups = _group_table(graph, calls, fold)

    op_nodes = {members[0]: nid for nid, members in graph.origin.items()
                if graph.nodes[nid].kind == "op"}
    leaves = {nid: members[0] for nid, members in graph.origin.items()
              if graph.nodes[nid].kind != "op"}
    # the tensor each op produced: the root, or an input of one of its consumers
    outputs = {loss._node: loss}
    for node in op_nodes:
        for inp in node.inputs:
            if inp is not None and inp._node is not None:
                outputs.setdefault(inp._node, inp)
    values = {nid: summarise(outputs[node].numpy(), bins) for node, nid in op_nodes.items()}
    values.update({nid: summarise(t.numpy(), bins) for nid, t in leaves.items()})
    # in the parameter's own dtype: a float64 copy of GPT-2's weights would take 1 GB
    weights_before = {nid: np.array(t.numpy(), copy=True)
                      for nid, t in leaves.items() if graph.nodes[nid].kind == "param"
                      and optimizer is not None}

    adds = residual_adds(list(op_nodes))
    watch = _StepWatch(adds, bins)
    try:
        with watch:
            loss.backward()
    except RuntimeError as e:
        if "second time" in str(e):
            raise RuntimeError("explore runs the backward pass itself, and this loss's "
                               "backward has already run: call explore(loss) instead of "
                               "loss.backward(), or pass a function that computes the "
                               "loss") from None
        raise
    if optimizer is not None:
        optimizer.step()

    data = {"title": title or f"backward of {loss._node.name()}", "nodes": [], "edges": [],
            "order": [op_nodes[n] for n in watch.order if n in op_nodes],
            "groups": groups, "residuals": [], "params": []}
    position = {nid: k for k, nid in enumerate(data["order"])}
    update_kind = ("optimizer step |Δw|/|w| (" + type(optimizer).__name__ + ")"
                   if optimizer is not None else
                   f"SGD step lr·|g|/|w| (lr={lr:g})" if lr is not None else "|g|/|w|")
    data["meta"] = {"loss": _finite(loss.item()) if loss.numel() == 1 else None,
                    "update_kind": update_kind, "nodes": len(graph.nodes),
                    "ops": graph.num_ops, "bins": bins}
    for nid, gnode in graph.nodes.items():
        label = gnode.label.split("\n")[0]
        entry = {"id": nid, "kind": gnode.kind, "label": label, "group": gnode.group,
                 "shape": list(gnode.shape), "value": values[nid], "grad": None,
                 "step": position.get(nid)}
        if gnode.kind == "op":
            node = graph.origin[nid][0]
            out = outputs[node]
            forward, backward = math_rule(node)
            entry.update(op=node.name(), math=math_line(node), forward=forward,
                         backward=backward, dtype=str(out.dtype))
            entry["grad"] = watch.received.get(node)
        else:
            t = leaves[nid]
            entry.update(op="leaf", math="", dtype=str(t.dtype))
            if t.grad is not None:
                entry["grad"] = summarise(t.grad.numpy(), bins)
        if gnode.kind == "param":
            entry["param"] = _param_entry(label, entry, leaves[nid], weights_before.get(nid),
                                          optimizer, lr)
            data["params"].append(dict(entry["param"], id=nid))
        data["nodes"].append(entry)
    index = {e["id"]: e for e in data["nodes"]}

    def source_id(t):
        return op_nodes.get(t._node) if t._node is not None else next(
            (nid for nid, leaf in leaves.items() if leaf is t), None)
    squares = {}
    for (node, i), n in watch.sent.items():
        if node not in op_nodes:
            continue
        a = source_id(node.inputs[i])
        if a is not None:
            key = (a, op_nodes[node])
            squares[key] = squares.get(key, 0.0) + n * n
    seen = set()
    for a, b in graph.edges:
        if (a, b) in seen:
            continue
        seen.add((a, b))
        norm = math.sqrt(squares[(a, b)]) if (a, b) in squares else None
        data["edges"].append({"s": a, "t": b, "norm": norm, "skip": (a, b) in graph.skip_edges})
    for node, s, b in adds:
        skip, branch = watch.split(node, s)
        row = {"node": op_nodes[node], "stream": source_id(node.inputs[s]),
               "branch_input": source_id(node.inputs[b]), "skip": skip, "branch": branch}
        data["residuals"].append(row)
        index[row["node"]]["residual"] = {"skip": skip, "branch": branch}
    return Explorer(data, path)


def _param_entry(name, entry, t, before, optimizer, lr):
    grad_norm = entry["grad"]["norm"] if entry["grad"] and "norm" in entry["grad"] else None
    weight_norm = dense_norm(before if before is not None else t.numpy())
    row = {"name": name, "grad_norm": grad_norm, "weight_norm": weight_norm,
           "update_norm": None, "ratio": None}
    if before is not None:
        row["update_norm"] = diff_norm(t.numpy(), before)
    elif lr is not None and grad_norm is not None:
        row["update_norm"] = lr * grad_norm
    elif grad_norm is not None:
        row["update_norm"] = grad_norm
    if row["update_norm"] is not None and weight_norm > 0:
        row["ratio"] = row["update_norm"] / weight_norm
    return row


class Explorer:
    """The explorer page of one step: `.html` (the self-contained page), `.data` (what it
    shows, as a dict), `.save(path)`, and `_repr_html_` for Jupyter (the page in an
    iframe, so that its script runs)."""

    def __init__(self, data, path=None):
        self.data = data
        self.html = render_page(data)
        self.path = None
        if path is not None:
            self.save(path)

    def save(self, path):
        """Write the page to `path` (UTF-8); returns the path."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        self.path = str(path)
        return self.path

    def node(self, node_id):
        """The data of one node by its id ('op3', 'leaf0')."""
        for entry in self.data["nodes"]:
            if entry["id"] == node_id:
                return entry
        raise KeyError(f"no node {node_id!r} in this graph")

    def _repr_html_(self):
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                'style="width:100%;height:640px;border:1px solid #ccc" '
                'title="microtensor explorer"></iframe>')

    def __repr__(self):
        meta = self.data["meta"]
        where = f", saved to {self.path}" if self.path else ""
        return (f"<Explorer: {meta['nodes']} nodes ({meta['ops']} ops), "
                f"{len(self.html) // 1024} KB{where}>")

    def to_json(self):
        return json.dumps(self.data)
