"""A backward pass drawn on its graph: `GradientFlow`.

From a `Graph` (build_graph) and a `BackwardTrace` of the backward pass through it:
when the engine first reached each box, the norm of the gradient that went along each
edge (edges drawn wider for larger norms, on a log scale), and at each residual
addition z = s + b how the gradient reaching the stream s splits into the part that
came straight through the addition (skip, dL/dz) and the part that came back through
the branch b (branch = dL/ds - dL/dz). `draw(ax, step)` draws the state after the
engine's first `step` visits; examples/graph.py --animate makes a GIF of the steps.
"""
import math

from microtensor.core._core import Tensor

from microtensor.inspect.drawing import layout
from microtensor.inspect.residual import residual_adds
from microtensor.inspect.visits import grad_norm

__all__ = ["GradientFlow"]

COLORS = {"waiting": "#e8e8e8", "done": "#ffd7a0", "now": "#ff7f2a",
          "param": "#bcd8f0", "leaf": "#fff2a8"}
CHAR_W, LINE_H = 0.075, 0.19      # inches per character / per line at fontsize 8


def _short(label):
    """A box's first line, with 'Backward' dropped: 'AddBackward' -> 'Add'."""
    first = label.split("\n")[0]
    if " = " in first:
        first = first.split(" = ")[0]
    return first.replace("Backward", "") or first


class GradientFlow:
    """The gradient's path through `graph` in the backward pass that `trace` watched
    (BackwardTrace(keep_grads=True), so that residual splits can be computed).

    steps      the boxes in the order the engine first reached them;
    box_step   {box id: its index in steps} (a leaf: when its gradient was complete);
    edge_norm  {(a, b): |gradient| sent from b back to a} over the graph's edges;
    splits     {add box id: (|skip|, |branch|, step when both were known)}.
    """

    def __init__(self, graph, trace):
        self.graph = graph
        position = trace.position()
        box_of, leaf_box = {}, {}
        for box, members in graph.origin.items():
            for m in members:
                if not isinstance(m, Tensor):
                    box_of[m] = box
                else:
                    leaf_box[id(m)] = box

        def source(t):
            return box_of.get(t._node) if t._node is not None else leaf_box.get(id(t))

        first = {}
        for node in trace.order:
            box = box_of.get(node)
            if box is not None and box not in first:
                first[box] = position[node]
        squares, edge_time, consumers = {}, {}, {}
        edges = set(graph.edges)
        for (node, i), norm in trace.sent.items():
            t = node.inputs[i]
            key = t._node if t._node is not None else id(t)
            consumers.setdefault(key, []).append((node, i))
            a, b = source(t), box_of.get(node)
            if a is None or b is None or a == b or (a, b) not in edges:
                continue
            squares[(a, b)] = squares.get((a, b), 0.0) + norm * norm
            edge_time[(a, b)] = max(edge_time.get((a, b), -1), position[node])
        for box in graph.nodes:
            if box not in first:        # a leaf: complete once its last consumer has run
                times = [t for (a, _), t in edge_time.items() if a == box]
                if times:
                    first[box] = max(times) + 0.5
        self.steps = sorted(first, key=first.get)
        self.box_step = {box: k for k, box in enumerate(self.steps)}
        self.edge_norm = {e: math.sqrt(v) for e, v in squares.items()}
        self.edge_step = {e: self._step_at(t, first) for e, t in edge_time.items()}
        self.splits = {}
        nodes = [m for members in graph.origin.values() for m in members
                 if not isinstance(m, Tensor)]
        for add, s_index, _ in residual_adds(nodes):
            s = add.inputs[s_index]
            key = s._node if s._node is not None else id(s)
            skip = trace.sent_grads.get((add, s_index))
            others = [c for c in consumers.get(key, []) if c != (add, s_index)]
            if skip is None or not others or any(c not in trace.sent_grads for c in others):
                continue
            branch = sum(trace.sent_grads[c] for c in others)
            when = max(position[m] for m, _ in others + [(add, s_index)])
            self.splits[box_of[add]] = (grad_norm(skip), grad_norm(branch),
                                        self._step_at(when, first))

    def _step_at(self, time, first):
        """The step (index into steps) by which the engine had made `time` visits."""
        done = [k for k, box in enumerate(self.steps) if first[box] <= time]
        return max(done) if done else 0

    def norm_range(self):
        values = [v for v in self.edge_norm.values() if v > 0]
        return (min(values), max(values)) if values else (1.0, 1.0)

    # -- drawing ---------------------------------------------------------------------
    def geometry(self):
        """Box centres and sizes in inches, from drawing.layout (layers in forward order,
        top to bottom)."""
        labels = {i: _short(n.label) for i, n in self.graph.nodes.items()}
        box_w = {i: max(0.55, CHAR_W * len(text) + 0.2) for i, text in labels.items()}
        rows, xpos, waypoints, widths = layout(self.graph, box_w, gap_x=0.35)
        row_h, gap = LINE_H + 0.12, 0.2
        center = {}
        for r, row in enumerate(rows):
            for i in row:
                center[i] = (xpos[i], -r * (row_h + gap))
        return labels, box_w, row_h, center, waypoints

    def draw(self, ax, step=None, scale=None, title="", notes=None, splits=True):
        """The state after the engine's visit number `step` (None: the end). `scale` =
        (smallest, largest) norm for the edge widths (default: this pass's own); `notes`
        {box id: text} written beside boxes once reached; `splits` labels the residual
        additions with their skip and branch norms."""
        from matplotlib.patches import FancyBboxPatch
        step = len(self.steps) - 1 if step is None else step
        lo, hi = scale or self.norm_range()
        span = max(math.log10(hi) - math.log10(lo), 1e-9)
        labels, box_w, row_h, center, waypoints = self.geometry()
        for k, (a, b) in enumerate(self.graph.edges):
            pts = [center[a]] + [center[w] for w in waypoints.get(k, [])] + [center[b]]
            xs, ys = zip(*pts)
            norm = self.edge_norm.get((a, b))
            passed = norm is not None and self.edge_step.get((a, b), 1 << 30) <= step
            if not passed:
                ax.plot(xs, ys, color="#c8c8c8", lw=0.6, zorder=1)
                continue
            if norm <= 0:
                ax.plot(xs, ys, color="#a0a0a0", lw=0.6, ls=":", zorder=1)
                continue
            width = 0.8 + 6.0 * min(max((math.log10(norm) - math.log10(lo)) / span, 0.0), 1.0)
            skip = (a, b) in self.graph.skip_edges
            ax.plot(xs, ys, color="#d05000" if skip else "#3060b0", lw=width, zorder=2,
                    solid_capstyle="round", alpha=0.85)
        for i, n in self.graph.nodes.items():
            cx, cy = center[i]
            k = self.box_step.get(i)
            if k is None or k > step:
                fc = COLORS.get(n.kind, COLORS["waiting"]) if n.kind in ("param", "leaf") \
                    else COLORS["waiting"]
                ec, lw = "#909090", 0.6
            else:
                fc = COLORS["now"] if k == step else COLORS["done"]
                ec, lw = "#603000", 1.0
            w = box_w[i]
            ax.add_patch(FancyBboxPatch((cx - w / 2, cy - row_h / 2), w, row_h,
                                        boxstyle="round,pad=0.0,rounding_size=0.06", fc=fc,
                                        ec=ec, lw=lw, zorder=3))
            ax.text(cx, cy, labels[i], ha="center", va="center", fontsize=8, zorder=4,
                    family="monospace")
            split = self.splits.get(i) if splits else None
            if split is not None and split[2] <= step:
                ax.text(cx + w / 2 + 0.1, cy, f"skip {split[0]:.2g}\nbranch {split[1]:.2g}",
                        ha="left", va="center", fontsize=7.5, color="#803000", zorder=4)
            if notes and i in notes and (k is not None and k <= step):
                ax.text(cx + w / 2 + 0.1, cy, notes[i], ha="left", va="center",
                        fontsize=7.5, color="#203060", zorder=4)
        xs = [c[0] for c in center.values()]
        ys = [c[1] for c in center.values()]
        ax.set_xlim(min(xs) - 1.0, max(xs) + 2.0)
        ax.set_ylim(min(ys) - 0.4, max(ys) + 0.4)
        ax.set_aspect("equal")
        ax.axis("off")
        if title:
            ax.set_title(title, fontsize=9)
        return ax
