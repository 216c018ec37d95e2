"""mt.inspect.explore: the page's data against the engine (Python), and the page itself in
a real headless Chromium (tests/_browser.py; those tests skip where no chromium exists)."""
import html
import importlib.util
import json
import math
import os
import re
import sys

import numpy as np
import pytest

import microtensor as mt
from microtensor import inspect as mti
from microtensor import nn
from microtensor.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _browser  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def norm(a):
    a = np.asarray(a.numpy() if isinstance(a, mt.Tensor) else a, dtype=np.float64)
    return float(np.linalg.norm(a))


def tiny_gpt(residual=True, n_layer=2):
    models = pytest.importorskip("models")
    mt.manual_seed(3)
    model = models.GPT(models.GPTConfig(vocab_size=11, block_size=8, n_layer=n_layer,
                                        n_head=2, n_embd=16, residual=residual))
    x = mt.randint(0, 11, (2, 8))
    y = mt.randint(0, 11, (2, 8))
    return model, x, y


class MLP(nn.Module):
    """float64, a residual MLP block and a plain one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = x + self.proj(self.fc(x).tanh())
        return self.head(h)


def mlp_case():
    mt.manual_seed(5)
    model = MLP().double()
    x = mt.randn(4, 6, dtype=mt.float64, requires_grad=True)
    r = mt.randn(4, 3, dtype=mt.float64)
    return model, x, r


def explored(case):
    """(explorer, model, loss, graph, trace) for one of the cases below, through the
    tensor form of explore (forward tracked by the test) under a BackwardTrace."""
    if case == "mlp":
        model, x, r = mlp_case()
        with mti.track_modules(model) as calls:
            loss = (model(x) * r).sum()
        names = {"x": x}
    else:
        model, x, y = tiny_gpt(residual=case == "gpt")
        with mti.track_modules(model) as calls:
            _, loss = model(x, y)
        names = None
    graph = mti.build_graph(loss, module=model, calls=calls, names=names)
    expected_order = mti.backward_order(loss)
    with mti.BackwardTrace() as trace:
        ex = mti.explore(loss, model=model, calls=calls, names=names)
    return ex, model, loss, graph, trace, expected_order


CASES = ["gpt", "gpt_no_residual", "mlp"]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return explored(request.param)


# ---- the data, against the engine ----------------------------------------------------

def test_node_and_edge_count_equal_the_graphs(case):
    ex, model, loss, graph, _, _ = case
    data = ex.data
    assert len(data["nodes"]) == len(graph.nodes) == data["meta"]["nodes"]
    assert {n["id"] for n in data["nodes"]} == set(graph.nodes)
    assert {(e["s"], e["t"]) for e in data["edges"]} == set(graph.edges)
    ops = sorted(n["op"] for n in data["nodes"] if n["kind"] == "op")
    assert ops == sorted(graph.origin[i][0].name() for i, n in graph.nodes.items()
                         if n.kind == "op")


def test_parameter_gradient_norms_equal_the_engines(case):
    ex, model, *_ = case
    by_name = dict(model.named_parameters())
    params = ex.data["params"]
    assert len(params) == len({id(p) for p in model.parameters()})
    for row in params:
        p = by_name[row["name"]]
        assert row["grad_norm"] == pytest.approx(norm(p.grad), rel=1e-12), row["name"]
        node = ex.node(row["id"])
        assert node["grad"]["norm"] == row["grad_norm"]
        assert node["value"]["norm"] == pytest.approx(norm(p), rel=1e-12)
        assert row["ratio"] is None or row["ratio"] == pytest.approx(
            norm(p.grad) / norm(p), rel=1e-12)          # no optimizer, no lr: |g|/|w|


def test_backward_order_is_the_engines(case):
    ex, _, _, graph, trace, expected = case
    ids = {members[0]: i for i, members in graph.origin.items()
           if graph.nodes[i].kind == "op"}
    assert ex.data["order"] == [ids[n] for n in trace.order]
    assert ex.data["order"] == [ids[n] for n in expected]
    assert len(ex.data["order"]) == graph.num_ops
    for k, node_id in enumerate(ex.data["order"]):
        assert ex.node(node_id)["step"] == k


def test_rule_math_lines_and_shapes(case):
    ex, _, _, graph, *_ = case
    for n in ex.data["nodes"]:
        if n["kind"] == "op":
            node = graph.origin[n["id"]][0]
            assert n["math"] == mti.math_line(node) and n["math"] != "(no math line)", n["op"]
            assert (n["forward"], n["backward"]) == mti.math_rule(node), n["op"]
            assert n["forward"] and n["backward"], n["op"]
            assert tuple(n["shape"]) == graph.nodes[n["id"]].shape
            assert n["value"]["numel"] == int(np.prod(n["shape"]))


def test_intermediate_gradients_equal_retained_grads():
    model, x, r = mlp_case()
    with mti.track_modules(model) as calls:
        pre = model.fc(x)
        act = pre.tanh()
        out = model.head(x + model.proj(act))
        loss = (out * r).sum()
    for t in (pre, act, out):
        t.retain_grad()
    graph = mti.build_graph(loss, module=model, calls=calls)
    ex = mti.explore(loss, model=model, calls=calls)
    ids = {members[0]: i for i, members in graph.origin.items()
           if graph.nodes[i].kind == "op"}
    for t in (pre, act, out):
        grad = ex.node(ids[t._node])["grad"]
        g = t.grad.numpy()
        assert grad["norm"] == pytest.approx(norm(g), rel=1e-12)
        assert grad["mean"] == pytest.approx(g.mean(), rel=1e-9, abs=1e-15)
        assert grad["max"] == g.max() and grad["min"] == g.min()
        assert sum(grad["hist"]) == g.size
        value = ex.node(ids[t._node])["value"]
        assert value["std"] == pytest.approx(t.numpy().std(), rel=1e-9)
    # a leaf input's gradient is its .grad
    x_node = next(n for n in ex.data["nodes"] if n["kind"] == "leaf")
    assert x_node["grad"]["norm"] == pytest.approx(norm(x.grad), rel=1e-12)


def test_residual_split_equals_skip_and_branch():
    """z = x + proj(tanh(fc(x))): skip = dL/dz, branch = dL/dx - dL/dz."""
    model, x, r = mlp_case()
    with mti.track_modules(model) as calls:
        z = x + model.proj(model.fc(x).tanh())
        loss = (model.head(z) * r).sum()
    z.retain_grad()
    ex = mti.explore(loss, model=model, calls=calls)
    (row,) = ex.data["residuals"]
    assert row["skip"] == pytest.approx(norm(z.grad), rel=1e-12)
    assert row["branch"] == pytest.approx(norm(x.grad.numpy() - z.grad.numpy()), rel=1e-12)
    assert ex.node(row["node"])["residual"] == {"skip": row["skip"], "branch": row["branch"]}
    edge = next(e for e in ex.data["edges"] if e["t"] == row["node"] and e["skip"])
    assert edge["s"] == row["stream"]


def test_residual_additions_per_block():
    for residual, expected in ((True, 4), (False, 0)):
        model, x, y = tiny_gpt(residual)
        ex = mti.explore(lambda: model(x, y), model=model)
        assert len(ex.data["residuals"]) == expected
        for row in ex.data["residuals"]:
            assert row["skip"] > 0 and row["branch"] > 0


def test_edge_norms_are_the_gradients_sent():
    """An edge from a parameter used once carries the parameter's whole gradient."""
    model, x, r = mlp_case()
    ex = mti.explore(lambda: (model(x) * r).sum(), model=model)
    for row in ex.data["params"]:
        into = [e for e in ex.data["edges"] if e["s"] == row["id"]]
        assert len(into) == 1
        assert into[0]["norm"] == pytest.approx(row["grad_norm"], rel=1e-12)


def test_groups_from_module_calls_and_folding():
    model, x, y = tiny_gpt(n_layer=3)
    ex = mti.explore(lambda: model(x, y), model=model)
    groups = {g["name"]: g for g in ex.data["groups"]}
    assert {f"transformer.h.{i}" for i in range(3)} <= set(groups)
    assert groups["transformer.h.1.attn"]["parent"] == "transformer.h.1"
    folded = sorted(g for g, row in groups.items() if row["folded"])
    assert folded == [f"transformer.h.{i}" for i in range(3)]
    attn = [n for n in ex.data["nodes"] if n["op"] == "AttentionBackward"]
    assert sorted(n["group"] for n in attn) == [f"transformer.h.{i}.attn" for i in range(3)]
    none = mti.explore(lambda: model(x, y), model=model, fold="none")
    assert not any(g["folded"] for g in none.data["groups"])


def test_update_sizes_with_an_optimizer_and_with_lr():
    model, x, r = mlp_case()
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    ex = mti.explore(lambda: (model(x) * r).sum(), model=model, optimizer=opt)
    for row in ex.data["params"]:
        p = dict(model.named_parameters())[row["name"]]
        step = p.numpy() - before[row["name"]]
        assert norm(step) > 0                                   # the step was taken
        assert row["update_norm"] == pytest.approx(norm(step), rel=1e-9)
        assert row["ratio"] == pytest.approx(norm(step) / norm(before[row["name"]]), rel=1e-9)
        assert row["update_norm"] == pytest.approx(0.1 * row["grad_norm"], rel=1e-9)
    model, x, r = mlp_case()
    ex = mti.explore(lambda: (model(x) * r).sum(), model=model, lr=0.01)
    for row in ex.data["params"]:
        assert row["ratio"] == pytest.approx(0.01 * row["grad_norm"] / row["weight_norm"])
    assert "lr=0.01" in ex.data["meta"]["update_kind"]


def test_bad_input_names_the_problem():
    model, x, r = mlp_case()
    loss = (model(x) * r).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward has already run"):
        mti.explore(loss)
    with pytest.raises(TypeError, match="loss tensor"):
        mti.explore(np.ones(3))
    with pytest.raises(ValueError, match="does not require grad"):
        mti.explore(mt.ones(3).sum())
    with pytest.raises(ValueError, match="not both"):
        mti.explore((model(x) * r).sum(), optimizer=mt.optim.SGD(model.parameters(), lr=1),
                    lr=0.1)
    with pytest.raises(ValueError, match="own no node"):
        mti.explore(lambda: (model(x) * r).sum(), model=model, fold=["nothing"])
    with pytest.raises(ValueError, match="model="):
        mti.explore(lambda: (model(x) * r).sum())
    with pytest.raises(TypeError, match="last item is the loss"):
        mti.explore(lambda: "loss", model=model)


def test_nonfinite_values_are_counted_and_the_json_stays_valid():
    w = mt.tensor([1.0, float("nan"), 2.0, float("inf")], requires_grad=True)
    ex = mti.explore((w * 2.0).sum())
    leaf = next(n for n in ex.data["nodes"] if n["kind"] == "param" or n["kind"] == "leaf")
    assert leaf["value"]["nonfinite"] == 2 and leaf["value"]["max"] == 2.0
    text = re.search(r'id="explorer-data">(.*?)</script>', ex.html, re.S).group(1)
    assert json.loads(text)["nodes"]        # strict JSON: no NaN or Infinity tokens
    assert "NaN" not in text and "Infinity" not in text


def self_contained(page):
    """The page's problems as a list: any URL, external source, import or fetch."""
    problems = []
    for pattern in (r"https?:", r"\bsrc\s*=", r"<link\b", r"@import", r"url\((?!#)",
                    r"\bfetch\(", r"XMLHttpRequest", r"//[a-z0-9.-]+\.[a-z]{2,}/"):
        if re.search(pattern, page, re.I):
            problems.append(pattern)
    return problems


def test_the_page_is_self_contained_and_small(tmp_path):
    model, x, y = tiny_gpt()
    ex = mti.explore(lambda: model(x, y), model=model, path=tmp_path / "p.html")
    page = (tmp_path / "p.html").read_text(encoding="utf-8")
    assert page == ex.html
    assert self_contained(page) == []
    assert self_contained(page.replace("</style>", "@import 'x.css';</style>")) != []
    assert page.count("<script") == 2 and "<script src" not in page
    assert len(page) < 150_000
    frame = ex._repr_html_()
    assert frame.startswith("<iframe srcdoc=")
    assert html.unescape(re.search(r'srcdoc="(.*?)"', frame, re.S).group(1)) == page


@pytest.fixture(scope="module")
def main_job_page(tmp_path_factory):
    """examples/explore.py with its defaults: the main job's model, one step."""
    spec = importlib.util.spec_from_file_location("explore_example",
                                                  os.path.join(ROOT, "examples", "explore.py"))
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = str(tmp_path_factory.mktemp("main") / "explore.html")
    assert module.main(["--out", path]) == 0
    return path


def test_main_job_page_size(main_job_page):
    page = open(main_job_page, encoding="utf-8").read()
    assert self_contained(page) == []
    assert len(page.encode()) < 1_000_000          # the 2-layer, 128-wide GPT: ~100 KB
    data = json.loads(re.search(r'id="explorer-data">(.*?)</script>', page, re.S).group(1))
    assert data["meta"]["ops"] > 40 and "AdamW" in data["meta"]["update_kind"]
    for n in data["nodes"]:                        # no tensor embedded whole
        assert len(n["value"].get("values", [])) <= 8


# ---- in a real browser ---------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if _browser.find_chromium() is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; "
                    ".ci/run installs it)")
    with _browser.Browser() as b:
        b.resize(1400, 900)
        yield b


@pytest.fixture(scope="module")
def gpt_page(tmp_path_factory):
    model, x, y = tiny_gpt()
    with mti.BackwardTrace() as trace:
        ex = mti.explore(lambda: model(x, y), model=model)
    path = str(tmp_path_factory.mktemp("page") / "gpt.html")
    ex.save(path)
    return ex, model, trace, "file://" + path


def test_browser_renders_every_node(browser, gpt_page):
    ex, *_, url = gpt_page
    browser.open(url)
    count = len(ex.data["nodes"])
    assert browser.eval("explorer.nodeCount()") == count
    # blocks folded at first sight: fewer boxes, the blocks as group boxes
    assert browser.eval("explorer.renderedCount()") < count
    groups = browser.eval("[...document.querySelectorAll('g.node[data-kind=group]')]"
                          ".map(e => e.dataset.id)")
    assert sorted(groups) == ["g:transformer.h.0", "g:transformer.h.1"]
    browser.eval("explorer.unfoldAll()")
    assert browser.eval("document.querySelectorAll('g.node:not([data-kind=group])').length") \
        == count
    ids = browser.eval("[...document.querySelectorAll('g.node')].map(e => e.dataset.id)")
    assert sorted(ids) == sorted(n["id"] for n in ex.data["nodes"])
    assert browser.eval("document.querySelectorAll('path.edge').length") == len(ex.data["edges"])


@pytest.mark.parametrize("which", [0, 5, -1])
def test_browser_click_shows_the_engines_gradient_norm(browser, gpt_page, which):
    ex, model, _, url = gpt_page
    browser.open(url)
    name, p = list(model.named_parameters())[which]
    node_id = next(r["id"] for r in ex.data["params"] if r["name"] == name)
    browser.eval(f"explorer.unfoldAll(); document.querySelector('g.node[data-id=\"{node_id}\"]')"
                 ".scrollIntoView({block: 'center', inline: 'center'})")
    box = browser.eval(f"(() => {{ const r = document.querySelector('g.node[data-id=\"{node_id}\"] "
                       "rect').getBoundingClientRect(); return [r.x + r.width / 2, "
                       "r.y + r.height / 2]; })()")
    browser.click(*box)                               # a real mouse click on the box
    info = browser.eval("explorer.selectedInfo()")
    assert info["id"] == node_id and info["label"] == name
    engine = norm(p.grad)
    assert info["paramGradNorm"] == pytest.approx(engine, rel=1e-12)
    assert info["gradNorm"] == pytest.approx(engine, rel=1e-12)
    assert float(info["gradNormText"]) == pytest.approx(engine, rel=1e-3)  # shown, 4 digits
    assert browser.eval("location.hash") == f"#node={node_id}"


def test_browser_stepping_follows_the_engines_order(browser, gpt_page):
    ex, _, trace, url = gpt_page
    browser.open(url)
    browser.eval("explorer.unfoldAll()")
    order = ex.data["order"]
    assert len(order) == len(trace.order) > 40
    # the engine's own order, from the BackwardTrace around explore
    assert [ex.node(i)["op"] for i in order] == [n.name() for n in trace.order]
    for k in range(1, len(order) + 1):
        assert browser.eval("explorer.step()") == k
        if k in (1, 2, len(order) // 2, len(order)):
            assert browser.eval("explorer.litOrder()") == order[:k]
            lit = browser.eval("[...document.querySelectorAll('g.node[data-lit=\"1\"]')]"
                               ".map(e => e.dataset.id)")
            assert sorted(lit) == sorted(order[:k])
            now = browser.eval("document.querySelector('g.node.now').dataset.id")
            assert now == order[k - 1]
    assert browser.eval("explorer.step()") == len(order)       # stays at the end
    assert browser.eval("explorer.back()") == len(order) - 1
    assert browser.eval("explorer.litOrder()") == order[:-1]
    assert browser.eval("explorer.reset()") == 0 and browser.eval("explorer.litOrder()") == []


def test_browser_permalink_selects_the_node(browser, gpt_page):
    ex, *_, url = gpt_page
    target = next(n for n in ex.data["nodes"] if n["op"] == "AttentionBackward")
    browser.open(url + "#node=" + target["id"])
    info = browser.eval("explorer.selectedInfo()")
    assert info["id"] == target["id"] and info["math"] == target["math"]
    assert info["gradNorm"] == pytest.approx(target["grad"]["norm"], rel=1e-12)
    assert target["forward"] in info["panelText"] and target["backward"] in info["panelText"]
    assert "dv = P^T @ g" in target["backward"]
    # the node sat inside a folded block: selecting it unfolded the block
    assert browser.eval(f"!!document.querySelector('g.node[data-id=\"{target['id']}\"]')")


def test_browser_search_finds_by_name(browser, gpt_page):
    ex, *_, url = gpt_page
    browser.open(url)
    hits = browser.eval("explorer.search('c_attn.weight')")
    expected = [n["id"] for n in ex.data["nodes"] if "c_attn.weight" in n["label"]]
    assert sorted(hits) == sorted(expected) and len(hits) == 2


def test_browser_makes_no_network_request(browser, main_job_page):
    browser.events.clear()
    url = "file://" + main_job_page
    seconds = browser.open(url)
    assert browser.requests() == [url]
    ready_ms = int(browser.eval("document.body.dataset.readyMs"))
    assert ready_ms < 2000, f"the page took {ready_ms} ms to be ready"
    assert seconds < 10
    assert browser.eval("explorer.nodeCount()") > 40


# ---- the layout: group boxes by module path -------------------------------------------

GEOMETRY_JS = r"""(() => {
  const num = (el, k) => parseFloat(el.getAttribute(k));
  const boxes = [...document.querySelectorAll('rect.gbox')].map(r => ({g: r.dataset.g,
    x0: num(r, 'x'), y0: num(r, 'y'), x1: num(r, 'x') + num(r, 'width'),
    y1: num(r, 'y') + num(r, 'height')}));
  const nodes = [...document.querySelectorAll('g.node')].map(el => {
    const m = /translate\(([-\d.e]+),\s*([-\d.e]+)\)/.exec(el.getAttribute('transform'));
    const r = el.querySelector('rect'), x = parseFloat(m[1]), y = parseFloat(m[2]);
    return {id: el.dataset.id, x0: x, y0: y, x1: x + num(r, 'width'), y1: y + num(r, 'height')};
  });
  const notes = [...document.querySelectorAll('g.node text.note')].map(t => {
    const b = t.getBBox(), m = /translate\(([-\d.e]+),\s*([-\d.e]+)\)/.exec(
      t.parentNode.getAttribute('transform'));
    const x = parseFloat(m[1]) + b.x, y = parseFloat(m[2]) + b.y;
    return {id: t.parentNode.dataset.id, x0: x, y0: y, x1: x + b.width, y1: y + b.height};
  });
  return {boxes, nodes, notes};
})()"""


def _inside(a, b):
    return a["x0"] >= b["x0"] and a["y0"] >= b["y0"] and a["x1"] <= b["x1"] and a["y1"] <= b["y1"]


def _overlap(a, b):
    return a["x0"] < b["x1"] and b["x0"] < a["x1"] and a["y0"] < b["y1"] and b["y0"] < a["y1"]


def check_group_geometry(browser, data):
    """No two sibling group boxes overlap, a box sits inside its parent's, and every node
    (and the skip/branch note beside it) lies inside exactly the boxes of its module path
    (its unfolded groups), touching no other box."""
    geo = browser.eval(GEOMETRY_JS)
    groups = {g["name"]: g for g in data["groups"]}
    folded = set(browser.eval("explorer.data.groups.filter(g => g.folded).map(g => g.name)"))

    def path(group):
        chain = []
        while group:
            chain.append(group)
            group = groups[group]["parent"]
        return [g for g in chain if not any(a in folded for a in path_up(g))]

    def path_up(group):
        chain = []
        while group:
            chain.append(group)
            group = groups[group]["parent"]
        return chain
    boxes = {b["g"]: b for b in geo["boxes"]}
    assert len(boxes) == len(geo["boxes"]) == len([g for g in groups if not any(
        a in folded for a in path_up(g))])
    names = sorted(boxes)
    for i, a in enumerate(names):
        parent = groups[a]["parent"]
        if parent is not None:
            assert _inside(boxes[a], boxes[parent]), (a, parent)
        for b in names[i + 1:]:
            if groups[b]["parent"] == parent:
                assert not _overlap(boxes[a], boxes[b]), (a, b, boxes[a], boxes[b])
    by_id = {n["id"]: n for n in data["nodes"]}
    for kind, items in (("node", geo["nodes"]), ("note", geo["notes"])):
        for item in items:
            if item["id"].startswith("g:"):
                own = path(groups[item["id"][2:]]["parent"])
            else:
                own = path(by_id[item["id"]]["group"])
            for name, box in boxes.items():
                if name in own:
                    assert _inside(item, box), (kind, item["id"], name)
                else:
                    assert not _overlap(item, box), (kind, item["id"], "inside", name)
    return geo


def test_browser_group_boxes_never_overlap(browser, gpt_page, main_job_page):
    ex, *_, url = gpt_page
    for page, data in ((url, ex.data), ("file://" + main_job_page, None)):
        browser.open(page)
        data = data or browser.eval("explorer.data")
        check_group_geometry(browser, data)                 # folded blocks
        browser.eval("explorer.unfoldAll()")
        geo = check_group_geometry(browser, data)           # every group open
        assert len(geo["boxes"]) >= 10 and len(geo["notes"]) == 2 * len(data["residuals"])
        browser.eval("explorer.fold('transformer.h.1')")
        check_group_geometry(browser, data)


def test_group_geometry_check_can_fail(browser, gpt_page):
    """The check sees a box moved onto its sibling."""
    ex, *_, url = gpt_page
    browser.open(url)
    browser.eval("explorer.unfoldAll()")
    browser.eval("(() => { const r = document.querySelector('rect.gbox[data-g=\"transformer.wpe\"]');"
                 " const s = document.querySelector('rect.gbox[data-g=\"transformer.wte\"]');"
                 " r.setAttribute('y', s.getAttribute('y')); r.setAttribute('x', s.getAttribute('x')); })()")
    with pytest.raises(AssertionError):
        check_group_geometry(browser, ex.data)


# ---- the panel: the rule's forward and backward; a gradient once the stepper made it ---

def test_browser_gradient_shows_once_the_stepper_reaches_it(browser, gpt_page):
    ex, model, _, url = gpt_page
    browser.open(url)
    browser.eval("explorer.unfoldAll()")
    order = ex.data["order"]
    node = next(n for n in ex.data["nodes"] if n["op"] == "AttentionBackward")
    k = node["step"]
    assert 0 < k < len(order) - 1
    browser.eval(f"explorer.select('{node['id']}')")
    info = browser.eval("explorer.selectedInfo()")          # before stepping: final
    assert info["gradWhen"] == "final" and "final" in info["panelText"]
    assert info["gradNorm"] == pytest.approx(node["grad"]["norm"], rel=1e-12)
    for _ in range(k):
        browser.eval("explorer.step()")
    info = browser.eval("explorer.selectedInfo()")          # its rule has not run yet
    assert info["gradWhen"] == "waiting" and info["gradNorm"] is None
    assert fmt_like(node["grad"]["norm"]) not in info["panelText"]
    browser.eval("explorer.step()")                          # now it has
    info = browser.eval("explorer.selectedInfo()")
    assert info["gradWhen"] == "reached"
    assert info["gradNorm"] == pytest.approx(node["grad"]["norm"], rel=1e-12)
    browser.eval("explorer.back()")
    assert browser.eval("explorer.selectedInfo()")["gradNorm"] is None
    # a parameter: its .grad is complete once the last op reading it has run
    row = next(r for r in ex.data["params"] if r["name"] == "transformer.wte.weight")
    readers = [ex.node(e["t"])["step"] for e in ex.data["edges"] if e["s"] == row["id"]]
    done = max(readers) + 1
    assert len(readers) == 2                                  # tied: embedding and head
    browser.eval("explorer.reset()")
    browser.eval(f"explorer.select('{row['id']}')")
    for _ in range(done - 1):
        browser.eval("explorer.step()")
    info = browser.eval("explorer.selectedInfo()")
    assert info["gradWhen"] == "waiting" and info["paramGradNorm"] is None
    browser.eval("explorer.step()")
    info = browser.eval("explorer.selectedInfo()")
    assert info["paramGradNorm"] == pytest.approx(row["grad_norm"], rel=1e-12)
    # the skip/branch numbers beside an addition: hidden until its stream's gradient is made
    browser.eval("explorer.reset(); explorer.step()")
    hidden = browser.eval("[...document.querySelectorAll('g.node text.note')]"
                          ".map(t => t.style.visibility)")
    assert hidden and set(hidden) == {"hidden"}
    while browser.eval("explorer.step()") < len(order):
        pass
    shown = browser.eval("[...document.querySelectorAll('g.node text.note')]"
                         ".map(t => t.style.visibility)")
    assert set(shown) == {"visible"}


def fmt_like(v):
    """The page's 4-digit form of a number (fmt in the page's script), for 1e-3 <= v < 1e4."""
    return f"{v:.4g}"


FUSED = ["LayerNormBackward", "RMSNormBackward", "SoftmaxBackward", "LogSoftmaxBackward",
         "CrossEntropyBackward", "GeluBackward", "AttentionBackward", "EmbeddingBackward",
         "LinearBackward", "SiluBackward", "DropoutBackward", "RopeBackward",
         "MSELossBackward", "BinaryCrossEntropyBackward"]


def fused_rules():
    """Every rule class (a backward node) defined in the homes of F's ops (ops/layers.py,
    activations.py, normalization.py, losses.py, attention.py, rope.py, ...): the fused ops."""
    import importlib
    from microtensor.core._core import Node
    found = {}
    homes = {row.module for row in mt.ops.registry() if row.scope == "F"}
    assert "microtensor.ops.layers" in homes and "microtensor.ops.attention" in homes, homes
    for module_name in sorted(homes):
        module = importlib.import_module(module_name)
        for name, cls in vars(module).items():
            if isinstance(cls, type) and issubclass(cls, Node) and cls.__module__ == module.__name__:
                found[name] = cls
    return found


def test_every_fused_rule_states_its_forward_and_backward():
    rules = fused_rules()
    assert set(FUSED) <= set(rules)
    for name, cls in rules.items():
        forward, backward = mti.math_rule(cls)
        assert "=" in forward and not forward.startswith("d"), (name, forward)
        assert re.match(r"d\w", backward) and "=" in backward, (name, backward)
    # the rule's whole first paragraph: LayerNorm's backward spans two lines
    forward, backward = mti.math_rule(rules["LayerNormBackward"])
    assert forward.startswith("y = (x - mean)") and "dw = sum_rows(g * xhat)" in backward
    assert mti.math_rule(rules["RopeBackward"])[0].startswith("y = x cos")   # from composite


def test_browser_panel_shows_each_fused_ops_forward_and_backward(browser, tmp_path):
    mt.manual_seed(1)
    x = mt.randn(2, 3, 4, dtype=mt.float64, requires_grad=True)
    w, b = mt.ones(4, dtype=mt.float64, requires_grad=True), mt.zeros(4, dtype=mt.float64,
                                                                        requires_grad=True)
    W = mt.randn(4, 4, dtype=mt.float64, requires_grad=True)
    E = mt.randn(5, 4, dtype=mt.float64, requires_grad=True)
    h = F.layer_norm(x, (4,), w, b) + F.rms_norm(x, (4,), w) + F.embedding(
        mt.tensor([[0, 1, 2]]), E)
    h = F.gelu(F.linear(h, W)) + F.silu(h)
    q = h.reshape(2, 1, 3, 4)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(6, 4)
    loss = F.cross_entropy(a, mt.tensor([0, 1, 2, 3, 0, 1])) + F.log_softmax(a, -1).mean() \
        + F.softmax(a, -1).pow(2).sum()
    ex = mti.explore(loss, names={"x": x})
    ops = {n["op"]: n for n in ex.data["nodes"] if n["kind"] == "op"}
    want = ["LayerNormBackward", "RMSNormBackward", "EmbeddingBackward", "GeluBackward",
            "LinearBackward", "SiluBackward", "AttentionBackward", "CrossEntropyBackward",
            "LogSoftmaxBackward", "SoftmaxBackward"]
    assert set(want) <= set(ops)
    rules = fused_rules()
    path = tmp_path / "fused.html"
    ex.save(path)
    browser.open("file://" + str(path))
    for op in want:
        node = ops[op]
        browser.eval(f"explorer.select('{node['id']}')")
        info = browser.eval("explorer.selectedInfo()")
        forward, backward = mti.math_rule(rules[op])
        assert (node["forward"], node["backward"]) == (forward, backward)
        assert forward and backward, op
        assert info["forward"] == forward and info["backward"] == backward, op
