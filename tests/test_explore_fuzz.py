"""A fuzzer for mt.inspect.explore: random programs explored, each page's data checked
against the engine.

The programs are the differential fuzzer's (tests/test_fuzz_torch.py: one to three
leaves, contiguous or viewed, a few ops from its table reading any earlier value, some
with a Python scalar operand, some in place, NaN and inf now and then), plus a few ops
of the explorer's own interest: a constant tensor operand, `+ eps` in a denominator, a
custom `mt.autograd.Function`, an integer-tensor index and a residual addition whose
branch reads the stream again. The leaves are the parameters of a Module. The loss is
a random weighted sum of every live value, as there.

Each program runs twice from the same leaves: once with a plain `loss.backward()` (the
engine's answer), once through `explore` with every intermediate value's gradient
retained. Then, from the JSON embedded in the page (`<script id="explorer-data">`):
node, op and edge counts equal the graph's (walked here), the order has one entry per
op, the params rows name the Module's parameters in the graph with the norms of their
`p.grad`, and every op node's gradient is the retained gradient of the tensor it made.
Where the plain backward raises, explore raises the same class; otherwise it must not
raise at all.

    pytest tests/test_explore_fuzz.py                                   # CI: 40 programs
    MT_EXPLORE_FUZZ_PROGRAMS=400 pytest tests/test_explore_fuzz.py       # a longer run
"""
import json
import os
import re
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import microtensor as mt
import microtensor.nn.functional as MF
from microtensor import inspect as mti

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
fz = pytest.importorskip("test_fuzz_torch")      # its program generator (needs torch)
import _browser  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROGRAMS = int(os.environ.get("MT_EXPLORE_FUZZ_PROGRAMS", "40"))
BROWSER_PAGES = 8                  # of those, the first ones also opened in Chromium
COUNT = [0, 0]         # programs explored, of which refused as a plain backward refuses


from test_explore_graphs import Cube, walk  # noqa: E402  (y = k x^3; the graph walk)


def _flat_index(L, F, x):
    flat = x.reshape(-1)
    return flat[L.tensor([0, flat.shape[0] - 1, 0])]


# name -> (arity, fn(lib, F, *args, **params), params(shapes)), as fz.OPS
EXTRA = {
    "times_constant": (1, lambda L, F, x: x * (L.ones(tuple(x.shape), dtype=x.dtype) * 0.5), fz._none),
    "over_abs_eps": (1, lambda L, F, x: x / (x.abs() + 1e-3), fz._none),
    "custom_function": (1, lambda L, F, x: Cube.apply(x, 0.5), fz._none),
    "flat_int_index": (1, _flat_index, fz._none),
    "residual_twice": (1, lambda L, F, x: x + L.tanh(x * 2.0) * x, fz._none),
}
TABLE = dict(fz.OPS, **EXTRA)


@st.composite
def programs(draw):
    dtype, inputs, steps, seed = draw(fz.programs())
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(EXTRA)))
        steps.insert(draw(st.integers(0, len(steps))), (name, [draw(st.integers(0, 1000))], 0))
    return dtype, inputs, steps, seed


def build(program, draw=None, params=None):
    """The program in microtensor, its leaves a Module's parameters: (model, values,
    loss or None, the params drawn per step)."""
    dtype, inputs, steps, seed = program
    model = mt.nn.Module()
    values = []
    for k, (shape, layout, special, s, mixed) in enumerate(inputs):
        base, view = fz.make_leaf(shape, layout, special, s, "float64" if mixed else dtype)
        p = mt.nn.Parameter(mt.tensor(base))
        model.register_parameter(f"p{k}", p)
        values.append(view(p))
    drawn = [] if params is None else params
    for i, (name, picks, _) in enumerate(steps):
        arity, fn, params_for = TABLE[name]
        args = [values[j % len(values)] for j in picks]
        if params is None:
            drawn.append(draw(params_for([tuple(a.shape) for a in args]), label=name))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn(mt, MF, *args, **drawn[i])
        except Exception:                     # noqa: BLE001 (a refused step is skipped)
            continue
        if isinstance(out, mt.Tensor):
            values.append(out)
    r = np.random.default_rng(seed)
    loss = None
    for v in values:
        if not fz.is_float(v) or not v.requires_grad:
            continue
        w = mt.tensor(r.standard_normal(tuple(v.shape)).astype(v.numpy().dtype))
        term = (v * w).sum()
        loss = term if loss is None else loss + term
    return model, values, loss, drawn


def finite_summary(a):
    """(norm of the finite entries or None, count of the others), as the page keeps them."""
    a = np.asarray(a, dtype=np.float64).ravel()
    good = a[np.isfinite(a)]
    return (float(np.linalg.norm(good)) if good.size else None), int(a.size - good.size)


def page_data(html):
    return json.loads(re.search(r'<script type="application/json" id="explorer-data">(.*?)'
                                r'</script>', html, re.S).group(1))


def check_norm(shown, expected, what):
    if expected is None:
        assert shown is None, what
    else:
        assert shown == pytest.approx(expected, rel=1e-9, abs=1e-300), what


def explore_and_check(data, pages=None):
    program = data.draw(programs(), label="program")
    ref_model, _, reference, params = build(program, draw=data.draw)
    assume(reference is not None and reference.requires_grad)
    ref_error = None
    try:
        reference.backward()
    except Exception as e:                    # noqa: BLE001 (explore must raise the same)
        ref_error = e
    model, values, loss, _ = build(program, params=params)
    if ref_error is not None:
        with pytest.raises(type(ref_error)):
            mti.explore(loss, model=model)
        COUNT[1] += 1
        return
    for v in values:
        if v._node is not None and v.requires_grad:
            v.retain_grad()
    nodes, leaves, edges = walk(loss)
    ex = mti.explore(loss, model=model)
    d = page_data(ex.html)
    # counts
    assert len(d["nodes"]) == d["meta"]["nodes"] == len(nodes) + len(leaves)
    assert d["meta"]["ops"] == len(nodes) == len(d["order"]) == len(set(d["order"]))
    assert sum(n["kind"] == "op" for n in d["nodes"]) == len(nodes)
    assert len(d["edges"]) == len(edges)
    assert sorted(n["step"] for n in d["nodes"] if n["step"] is not None) == list(range(len(nodes)))
    # the params rows: the Module's parameters in the graph, with their .grad norms
    ref_params = dict(ref_model.named_parameters())
    in_graph = {name for name, p in model.named_parameters() if id(p) in leaves}
    assert sorted(row["name"] for row in d["params"]) == sorted(in_graph)
    for row in d["params"]:
        engine = ref_params[row["name"]].grad
        mine = dict(model.named_parameters())[row["name"]].grad
        if engine is None:
            assert row["grad_norm"] is None and mine is None, row["name"]
            continue
        np.testing.assert_array_equal(mine.numpy(), engine.numpy())
        expected, nonfinite = finite_summary(engine.numpy())
        check_norm(row["grad_norm"], expected, row["name"])
        node = next(n for n in d["nodes"] if n["id"] == row["id"])
        assert node["grad"]["nonfinite"] == nonfinite
    # every op node's gradient: the retained gradient of the tensor it made
    by_node = {}
    for v in values:
        if v._node is not None and v._node in nodes and v.grad is not None:
            by_node[v._node] = v
    graph = mti.build_graph(loss, module=model)
    ids = {members[0]: nid for nid, members in graph.origin.items()
           if graph.nodes[nid].kind == "op"}
    shown = {n["id"]: n for n in d["nodes"]}
    for node, v in by_node.items():
        g = shown[ids[node]]["grad"]
        expected, nonfinite = finite_summary(v.grad.numpy())
        assert g["numel"] == v.numel() and g["nonfinite"] == nonfinite, node.name()
        check_norm(g.get("norm"), expected, node.name())
    for row in d["residuals"]:
        assert row["skip"] is None or row["skip"] >= 0
    if pages is not None and len(pages) < BROWSER_PAGES:
        pages.append((ex.html, len(d["nodes"]), len(d["edges"])))
    COUNT[0] += 1


SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
PAGES = []


@settings(max_examples=PROGRAMS, **SETTINGS)
@given(data=st.data())
def test_random_graphs_explored_against_the_engine(data):
    explore_and_check(data, PAGES)


def test_fuzzed_pages_render_in_a_browser(tmp_path):
    """The first pages of the run above, opened in Chromium: every node drawn once
    unfolded, every edge, and the stepper runs to the end."""
    if _browser.find_chromium() is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    assert PAGES, "the fuzz test above must run first (it keeps the pages)"
    print(f"{COUNT[0] + COUNT[1]} programs explored ({COUNT[1]} whose backward raises)")
    with _browser.Browser() as b:
        b.resize(1200, 800)
        for k, (page, n_nodes, n_edges) in enumerate(PAGES):
            path = tmp_path / f"p{k}.html"
            path.write_text(page, encoding="utf-8")
            b.open("file://" + str(path))
            b.eval("explorer.unfoldAll()")
            assert b.eval("explorer.renderedCount()") == n_nodes
            assert b.eval("document.querySelectorAll('path.edge').length") == n_edges
            steps = b.eval("explorer.order().length")
            for _ in range(steps + 1):
                b.eval("explorer.step()")
            assert b.eval("explorer.litOrder().length") == steps


def test_a_wrong_gradient_on_the_page_is_caught(monkeypatch):
    """The check can fail: a summary with its norm doubled is noticed."""
    explore_module = sys.modules["microtensor.inspect.explore"]
    real = explore_module.summarise

    def doubled(array, bins=24):
        out = real(array, bins)
        if "norm" in out and out["norm"] > 0:
            out["norm"] *= 2
        return out
    monkeypatch.setattr(explore_module, "summarise", doubled)

    @settings(max_examples=5, **SETTINGS)
    @given(data=st.data())
    def run(data):
        explore_and_check(data)
    with pytest.raises(AssertionError):
        run()
