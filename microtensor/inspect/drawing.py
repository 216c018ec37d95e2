"""A layered drawing of a `Graph` with matplotlib, for when Graphviz is missing, and
`save_small_png`, which keeps line drawings at a few tens of KB."""

__all__ = ["layout", "draw_layered", "save_small_png"]


def layout(graph, box_w, gap_x=0.25):
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


def draw_layered(graph, path, dpi=90):
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
    rows, xpos, waypoints, widths = layout(graph, box_w)
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
