"""mt.inspect (gradient recorder, graph exporter), detect_anomaly, and the scalar study
of examples/residual_flow.py."""
import os
import re
import sys

import numpy as np
import pytest

import microtensor as mt
from microtensor import inspect as mti
from microtensor import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def norm(t):
    return float(np.linalg.norm(np.asarray(t.numpy() if isinstance(t, mt.Tensor) else t,
                                           dtype=np.float64)))


def randn(*shape):
    return mt.randn(*shape, dtype=mt.float64, requires_grad=True)


class Residual(nn.Module):
    """y = x + W2 tanh(W1 x): one skip connection around a two-layer branch."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return x + self.proj(self.fc(x).tanh())


# ---- the recorder ------------------------------------------------------------------

def test_watched_tensors_match_retained_grads():
    rec = mti.GradientRecorder()
    x = randn(4, 3)
    w = randn(3, 5)
    h = rec.watch((x @ w).tanh(), "h")
    h.retain_grad()
    out = rec.watch(h * h + h, "out")
    out.retain_grad()
    rec.watch(x, "x")
    (out * mt.randn(4, 5, dtype=mt.float64)).sum().backward()
    for name, t in (("h", h), ("out", out), ("x", x)):
        assert rec[name].norm == pytest.approx(norm(t.grad), rel=1e-12)
    assert rec["x"].norm > 0 and rec["h"].norm != rec["out"].norm
    assert "tensor (4, 3)" in rec.table()


def test_remove_hooks_stops_recording_on_leaves():
    rec = mti.GradientRecorder()
    x = rec.watch(randn(3), "x")
    (x * 2.0).sum().backward()
    first = rec["x"].norm
    assert first == pytest.approx(2.0 * np.sqrt(3.0), rel=1e-12)
    rec.remove_hooks()
    (x * 5.0).sum().backward()
    assert rec["x"].norm == first


def test_watch_rejects_tensors_without_grad():
    rec = mti.GradientRecorder()
    with pytest.raises(RuntimeError):
        rec.watch(mt.randn(3), "x")
    with pytest.raises(TypeError):
        rec.watch(np.ones(3), "x")


def test_module_norms_match_retained_grads():
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = randn(5, 6)
    rec = mti.GradientRecorder(model)
    with rec:
        h1 = model[0](x)
        h2 = model[1](h1)
        out = model[2](h2)
    for t in (h1, h2, out):
        t.retain_grad()
    (out * mt.randn(5, 3, dtype=mt.float64)).sum().backward()
    assert [r.name for r in rec] == ["0", "1", "2"]
    assert rec["0"].input_norm == pytest.approx(norm(x.grad), rel=1e-12)
    assert rec["0"].output_norm == pytest.approx(norm(h1.grad), rel=1e-12)
    assert rec["1"].input_norm == pytest.approx(norm(h1.grad), rel=1e-12)
    assert rec["1"].output_norm == pytest.approx(norm(h2.grad), rel=1e-12)
    assert rec["2"].input_norm == pytest.approx(norm(h2.grad), rel=1e-12)
    assert rec["2"].output_norm == pytest.approx(norm(out.grad), rel=1e-12)
    lin = model[0]
    by_hand = np.sqrt(norm(lin.weight.grad) ** 2 + norm(lin.bias.grad) ** 2)
    assert rec["0"].param_norm == pytest.approx(by_hand, rel=1e-12)
    assert rec["1"].param_norm is None          # Tanh has no parameters


def test_whole_model_call_and_nesting():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = randn(3, 4)
    rec = mti.GradientRecorder(model)
    with rec:
        out = model(x)
    out.retain_grad()
    out.sum().backward()
    # children finish first, the container last
    assert [r.name for r in rec] == ["0", "1", "2", ""]
    assert rec[""].input_norm == pytest.approx(norm(x.grad), rel=1e-12)
    assert rec[""].output_norm == pytest.approx(norm(out.grad), rel=1e-12)
    assert rec["2"].input_norm == pytest.approx(rec["1"].output_norm, rel=1e-12)


def test_modules_are_restored_after_the_block():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    rec = mti.GradientRecorder(model)
    with rec:
        model(mt.randn(2, 4))
    assert all("forward" not in m.__dict__ for m in model.modules())
    n = len(rec)
    model(mt.randn(2, 4))            # not recorded any more
    assert len(rec) == n


def test_module_filter_by_type_and_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = mt.randn(2, 4, requires_grad=True)
    for modules, expected in ((nn.Linear, ["0", "2"]), (["1"], ["1"]), (r"[02]", ["0", "2"])):
        rec = mti.GradientRecorder(model, modules=modules)
        with rec:
            model(x)
        assert [r.name for r in rec] == expected


def test_residual_split_sums_to_the_total():
    block = Residual(5).double()
    x = randn(3, 5)
    rec = mti.GradientRecorder(block, keep_grads=True)
    with rec:
        y = block(x)
    y.retain_grad()
    (y * mt.randn(3, 5, dtype=mt.float64)).sum().backward()
    r = rec[""]
    g = r.grads
    # y = x + f(x): dL/dx = dL/dy (skip) + J_f^T dL/dy (branch)
    np.testing.assert_allclose(g["skip"], y.grad.numpy(), rtol=1e-12, atol=0)
    np.testing.assert_allclose(g["skip"] + g["branch"], x.grad.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(g["input"], x.grad.numpy(), rtol=0, atol=0)
    assert r.skip_norm == pytest.approx(norm(y.grad), rel=1e-12)
    assert r.branch_norm == pytest.approx(norm(x.grad.numpy() - y.grad.numpy()), rel=1e-12)
    assert r.input_norm == pytest.approx(norm(x.grad), rel=1e-12)
    assert r.branch_norm > 0
    # the same split per skip connection, labelled by the module that made the branch
    assert len(r.units) == 1 and r.units[0].label == "proj"
    assert r.units[0].skip_norm == pytest.approx(r.skip_norm, rel=1e-12)
    assert r.units[0].branch_norm == pytest.approx(r.branch_norm, rel=1e-12)
    assert r.units[0].total_norm == pytest.approx(r.input_norm, rel=1e-12)


def test_a_doubling_or_a_parameter_free_sum_is_not_a_skip_connection():
    class NotResidual(nn.Module):
        def forward(self, x):
            return x + x.tanh() * 0.5       # no parameters on the second path

    module = NotResidual()
    rec = mti.GradientRecorder(module)
    with rec:
        y = module(randn(3))
    y.sum().backward()
    assert rec[""].skip_norm is None and rec[""].units == []


@pytest.fixture
def models():
    return pytest.importorskip("models")


@pytest.mark.parametrize("prenorm", [True, False])
def test_transformer_block_split(models, prenorm):
    block = models.TransformerBlock(16, 2, prenorm=prenorm).double()
    x = randn(2, 5, 16)
    rec = mti.GradientRecorder(block, keep_grads=True)
    with rec:
        y = block(x)
    y.retain_grad()
    upstream = mt.randn(2, 5, 16, dtype=mt.float64)
    (y * upstream).sum().backward()
    r = rec[""]
    assert r.input_norm == pytest.approx(norm(x.grad), rel=1e-12)
    np.testing.assert_allclose(r.grads["skip"] + r.grads["branch"], x.grad.numpy(),
                               rtol=1e-10, atol=1e-14)
    assert [u.label for u in r.units] == ["attn", "mlp"]
    if prenorm:
        # x + attn(ln_1(x)) + mlp(...): the skip path is the identity
        np.testing.assert_allclose(r.grads["skip"], y.grad.numpy(), rtol=1e-12)
    else:
        # ln_2(z + mlp(z)), z = ln_1(x + attn(x)): the skip path runs through both norms.
        # Recompute it independently: cut the branches with detach() and backprop dL/dy.
        x2 = x.detach().requires_grad_()
        z = block.ln_1(x2 + block.attn(x2).detach())
        y2 = block.ln_2(z + block.mlp(z).detach())
        (skip,) = mt.autograd.grad(y2, x2, grad_outputs=y.grad)
        np.testing.assert_allclose(r.grads["skip"], skip.numpy(), rtol=1e-10, atol=1e-14)
        assert norm(skip.numpy() - y.grad.numpy()) > 1e-3 * norm(skip)


def test_transformer_block_without_residual_has_no_split(models):
    block = models.TransformerBlock(16, 2, residual=False).double()
    rec = mti.GradientRecorder(block)
    with rec:
        y = block(randn(2, 5, 16))
    y.sum().backward()
    assert rec[""].skip_norm is None and rec[""].branch_norm is None
    assert rec[""].input_norm > 0


def test_gpt_blocks_chain(models):
    cfg = models.GPTConfig(vocab_size=30, block_size=8, n_layer=3, n_head=2, n_embd=16)
    model = models.GPT(cfg)
    idx = mt.randint(0, 30, (2, 8))
    rec = mti.GradientRecorder(model, modules=models.TransformerBlock)
    with rec:
        _, loss = model(idx, idx)
    loss.backward()
    names = [r.name for r in rec]
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    for a, b in zip(names, names[1:]):      # block i's output is block i+1's input
        assert rec[b].input_norm == pytest.approx(rec[a].output_norm, rel=1e-6)
    assert all(r.skip_norm is not None and r.branch_norm > 0 for r in rec)
    assert "transformer.h.1" in rec.table()


# ---- detect_anomaly ---------------------------------------------------------------

def test_anomaly_division_by_zero_names_div():
    a = mt.tensor([1.0, 2.0], requires_grad=True)
    b = mt.tensor([0.0, 1.0], requires_grad=True)
    with mt.autograd.detect_anomaly():
        with np.errstate(divide="ignore"):
            q = a / b  # the line that makes the Inf
            with pytest.raises(mt.autograd.AnomalyError) as info:
                q.sum().backward()
    message = str(info.value)
    assert "DivBackward" in message and "Inf" in message
    assert isinstance(info.value, RuntimeError)
    # where it was made: this file, this function, this line
    assert "test_inspect.py" in message and "q = a / b" in message


def test_anomaly_log_of_zero_names_log():
    x = mt.tensor([0.0, 2.0], requires_grad=True)
    with mt.autograd.detect_anomaly():
        with np.errstate(divide="ignore"):
            y = mt.log(x)  # log(0) = -inf; its gradient 1/x is inf
            with pytest.raises(mt.autograd.AnomalyError) as info:
                y.sum().backward()
    assert "LogBackward" in str(info.value)
    assert "y = mt.log(x)" in str(info.value)


def test_anomaly_log_of_a_negative_number():
    # log(-1) is NaN in forward. Its own backward rule (g / x) stays finite, so the
    # anomaly surfaces at the first op whose backward uses that NaN: here the square.
    x = mt.tensor([-1.0, 2.0], requires_grad=True)
    with mt.autograd.detect_anomaly():
        with np.errstate(invalid="ignore"):
            y = mt.log(x)
            loss = (y ** 2).sum()  # the square of a NaN
            with pytest.raises(mt.autograd.AnomalyError) as info:
                loss.backward()
    message = str(info.value)
    assert "PowBackward" in message and "NaN" in message
    assert "loss = (y ** 2).sum()" in message


def test_anomaly_is_silent_on_a_clean_graph():
    mt.manual_seed(0)
    w1, w2 = randn(4, 8), randn(8, 1)
    x = mt.randn(16, 4, dtype=mt.float64)

    def loss_fn():
        return ((mt.tanh(x @ w1) @ w2).sigmoid().log() * -1.0).mean()

    loss_fn().backward()
    expected = (w1.grad.numpy().copy(), w2.grad.numpy().copy())
    w1.grad = w2.grad = None
    with mt.autograd.detect_anomaly():
        loss_fn().backward()
    np.testing.assert_array_equal(w1.grad.numpy(), expected[0])
    np.testing.assert_array_equal(w2.grad.numpy(), expected[1])
    assert not mt.autograd.is_anomaly_enabled()


def test_anomaly_off_outside_the_block():
    a = mt.tensor([1.0], requires_grad=True)
    b = mt.tensor([0.0], requires_grad=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        (a / b).sum().backward()      # no error without detect_anomaly
    assert not np.isfinite(a.grad.numpy()).all()


# ---- the graph exporter -------------------------------------------------------------

def parse_dot(text):
    """Check the DOT text's structure; return (declared node ids, edges, clusters,
    skip edges (the ones drawn in the skip-connection colour))."""
    lines = text.strip().splitlines()
    assert re.fullmatch(r"digraph \w+ \{", lines[0]), lines[0]
    assert lines[-1] == "}"
    depth = 0
    in_quote = False
    previous = ""
    for ch in text:                  # braces balance outside quoted labels
        if ch == '"' and previous != "\\":
            in_quote = not in_quote
        elif not in_quote and ch == "{":
            depth += 1
        elif not in_quote and ch == "}":
            depth -= 1
            assert depth >= 0
        previous = ch
    assert depth == 0 and not in_quote
    declared, edges, clusters, skips = {}, [], 0, []
    for line in lines[1:-1]:
        line = line.strip()
        if m := re.fullmatch(r"(\w+) -> (\w+)( \[.*\])?;", line):
            edges.append((m.group(1), m.group(2)))
            if m.group(3) is not None:
                assert "e07000" in m.group(3)            # only skip edges are styled
                skips.append((m.group(1), m.group(2)))
        elif m := re.fullmatch(r'(\w+) \[label="((?:[^"\\]|\\.)*)"(, .*)?\];', line):
            assert m.group(1) not in declared, f"{m.group(1)} declared twice"
            declared[m.group(1)] = m.group(2)
        elif line.startswith("subgraph cluster_"):
            clusters += 1
    for a, b in edges:
        assert a in declared and b in declared, f"edge {a} -> {b} to an undeclared node"
    return declared, edges, clusters, skips


def count_ops(t):
    """The graph's op count, walking grad_fn.next_functions as a torch user would."""
    seen, work = set(), [t.grad_fn]
    while work:
        fn = work.pop()
        if fn is None or fn.name() == "AccumulateGrad" or id(fn) in seen:
            continue
        seen.add(id(fn))
        work.extend(f for f, _ in fn.next_functions)
    return len(seen)


def test_dot_of_an_expression():
    a, b = randn(3), randn(3)
    c = (a * b + a).tanh()
    loss = (c ** 2).sum()
    text = mti.to_dot(loss, names={"a": a, "b": b})
    declared, edges, _, skips = parse_dot(text)
    ops = [k for k, label in declared.items() if "Backward" in label]
    assert len(ops) == count_ops(loss) == 5
    labels = list(declared.values())
    assert any(label.startswith("a\\n(3,)") for label in labels)
    assert any(label.startswith("b\\n(3,)") for label in labels)
    for name in ("MulBackward", "AddBackward", "TanhBackward", "PowBackward", "SumBackward"):
        assert sum(name in label for label in labels) == 1
    # a is read by the mul and by the add: two edges out of it
    a_id = next(k for k, label in declared.items() if label.startswith("a\\n"))
    assert sum(1 for s, _ in edges if s == a_id) == 2
    assert len(edges) == 7
    # a*b + a has the shape of a residual unit (a + f(a), f with the trainable b): the
    # edge from a into the addition is marked as its skip path
    add_id = next(k for k, label in declared.items() if label.startswith("AddBackward"))
    assert skips == [(a_id, add_id)]


def test_dot_names_parameters_and_groups_by_module():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = mt.randn(3, 4)
    with mti.track_modules(model) as calls:
        out = model(x).sum()
    declared, edges, clusters, _ = parse_dot(mti.to_dot(out, module=model, calls=calls))
    labels = " ".join(declared.values())
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert name in labels
    assert clusters == 3                     # one box per called layer
    assert sum("Backward" in v for v in declared.values()) == count_ops(out)
    # collapsed: one node per layer, the root's own sum stays an op
    declared, edges, _, _ = parse_dot(mti.to_dot(out, module=model, calls=calls, collapse=True))
    modules = [v for v in declared.values() if "Linear" in v or "Tanh" in v]
    assert len(modules) == 3 and len(declared) == 4
    assert len(edges) == 3
    with pytest.raises(ValueError):
        mti.to_dot(out, module=model, collapse=True)    # needs calls


def test_dot_of_a_transformer_block(models):
    block = models.TransformerBlock(16, 2)
    x = mt.randn(1, 4, 16, requires_grad=True)
    with mti.track_modules(block) as calls:
        y = block(x)
    declared, edges, clusters, skips = parse_dot(mti.to_dot(y, module=block, calls=calls,
                                                            names={"x": x}))
    labels = list(declared.values())
    assert sum("Backward" in v for v in labels) == count_ops(y)
    for p, _ in block.named_parameters():
        assert any(v.startswith(p + "\\n") for v in labels), p
    assert clusters >= 4                     # ln_1, attn, ln_2, mlp (and their layers)
    x_id = next(k for k, v in declared.items() if v.startswith("x\\n"))
    assert len(skips) == 2 and x_id in {source for source, _ in skips}
    declared, edges, _, skips = parse_dot(mti.to_dot(y, module=block, calls=calls,
                                                     names={"x": x}, collapse=True))
    labels = " ".join(declared.values())
    for name in ("ln_1", "attn", "ln_2", "mlp"):
        assert name in labels
    adds = [k for k, v in declared.items() if v.startswith("AddBackward")]
    assert len(adds) == 2                                     # the residual additions
    x_id = next(k for k, v in declared.items() if v.startswith("x\\n"))
    # the skip path: x -> first addition -> second addition
    first, second = adds if (x_id, adds[0]) in edges else adds[::-1]
    assert sorted(skips) == sorted([(x_id, first), (first, second)])


def test_render_png_with_matplotlib(tmp_path):
    a, b = randn(3), randn(3)
    loss = ((a * b).exp() + a).sum()
    path = tmp_path / "g.png"
    graph = mti.render(loss, path, names={"a": a, "b": b}, engine="matplotlib")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert graph.num_ops == count_ops(loss)
    mti.render(loss, tmp_path / "g.dot")
    parse_dot((tmp_path / "g.dot").read_text())


def test_graph_of_a_tensor_without_grad_is_an_error():
    with pytest.raises(ValueError):
        mti.to_dot(mt.randn(3))


# ---- the scalar study -------------------------------------------------------------

@pytest.fixture(scope="module")
def residual_flow():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import residual_flow
    finally:
        sys.path.pop(0)
    return residual_flow


@pytest.mark.parametrize("shortcut", [False, True])
def test_scalar_stack_equals_the_closed_form(residual_flow, shortcut):
    for depth in range(1, 21):
        grad, visited = residual_flow.scalar_stack(depth, shortcut)
        # the visited points by hand, then the product of the slopes
        x, points = 1.0, []
        for _ in range(depth):
            points.append(x)
            x = x + np.tanh(0.5 * x) if shortcut else np.tanh(0.5 * x)
        np.testing.assert_allclose(visited, points, rtol=1e-14)
        slopes = 0.5 * (1.0 - np.tanh(0.5 * np.array(points)) ** 2)
        closed = np.prod(1.0 + slopes) if shortcut else np.prod(slopes)
        assert grad == pytest.approx(closed, rel=1e-12)
        by_formula = residual_flow.scalar_closed_form(visited, shortcut)
        assert by_formula == pytest.approx(closed, rel=1e-12)
    if not shortcut:
        assert grad < 1e-6          # 20 plain layers: vanished
    else:
        assert grad > 1.0
