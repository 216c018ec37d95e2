"""The backprop exercise and its checker: mt.inspect.compare_grads on a small model line
by line, the reference answers of examples/backprop_by_hand.py all right, and the
classic mistakes planted in them each named at the right tensor with the right rule."""
import os
import subprocess
import sys

import numpy as np
import pytest

import microtensor as mt
from microtensor import inspect as mti

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import backprop_by_hand as exercise   # noqa: E402
import backprop_solution as solution  # noqa: E402

GOOD = ("exact", "close")


# ---- compare_grads on a small model ----------------------------------------------------

def small_model(dtype=mt.float64):
    """h = x @ W + b;  a = tanh(h);  s = a * c (a side branch);  loss = mean(a^2) + sum(s)."""
    mt.manual_seed(0)
    x = mt.randn(4, 3, dtype=dtype)
    W = mt.randn(3, 5, dtype=dtype, requires_grad=True)
    b = mt.randn(5, dtype=dtype, requires_grad=True)
    c = mt.randn(4, 5, dtype=dtype, requires_grad=True)
    h = x @ W + b
    a = h.tanh()
    s = a * c
    loss = (a ** 2).mean() + s.sum()
    tensors = mti.retain_grads({"W": W, "b": b, "c": c, "h": h, "a": a, "s": s, "loss": loss})
    loss.backward()
    X, A, C = x.numpy().astype(np.float64), a.detach().numpy().astype(np.float64), \
        c.detach().numpy().astype(np.float64)
    ds = np.ones_like(A)
    da = 2 * A / A.size + ds * C
    dh = da * (1 - A ** 2)
    manual = {"loss": 1.0, "s": ds, "a": da, "c": ds * A, "h": dh, "b": dh.sum(0),
              "W": X.T @ dh}
    return tensors, manual


def test_right_answers_are_exact_or_close_in_backward_order():
    tensors, manual = small_model()
    report = mti.compare_grads(tensors, manual)
    assert report.ok and report.first_wrong is None
    assert [line.status in GOOD for line in report.lines] == [True] * 7
    names = [line.name for line in report.lines]
    assert names[0] == "loss" and names.index("s") < names.index("a") < names.index("h")
    assert names.index("h") < names.index("W") and names.index("h") < names.index("b")
    assert report["loss"].status == "exact"
    assert "7 of 7 right: all done" in str(report)


def test_wrong_values_name_the_index_and_both_values():
    tensors, manual = small_model()
    dh = manual["h"].copy()
    dh[2, 3] += 0.5
    manual["h"] = dh
    report = mti.compare_grads(tensors, manual)
    assert not report.ok and report.first_wrong == "h"
    line = report.lines[-1]
    assert line.name == "h" and line.status == "wrong"
    assert line.index == (2, 3) and line.max_abs == pytest.approx(0.5)
    assert line.mine_value - line.engine_value == pytest.approx(0.5)
    assert all(other.good for other in report.lines[:-1])
    # the gradients computed from h's: W and b inherit, c (from a's branch) does not
    assert sorted(report.inherit) == ["W", "b"] and report["c"].good
    assert ("TanhBackward", mti.math_line(tensors["a"].grad_fn)) in report.hint
    assert report.sources == ["a"]
    text = str(report)
    assert "WRONG" in text and "at [2, 3]" in text and "TanhBackward" in text
    assert "dx = g * f'(x)" in text or "tanh" in text.lower()
    assert "inherit the error (2, not checked): " in text


def test_shape_missing_and_error_lines():
    tensors, manual = small_model()
    manual["W"] = manual["W"].T
    report = mti.compare_grads(tensors, manual)
    assert report.first_wrong == "W" and report["W"].status == "wrong shape"
    assert report["W"].mine_shape == (5, 3) and report["W"].shape == (3, 5)
    assert "yours (5, 3), engine (3, 5)" in str(report)

    tensors, manual = small_model()
    del manual["a"]
    manual["c"] = None
    report = mti.compare_grads(tensors, manual)
    assert report.first_wrong is None and not report.ok
    assert sorted(report.missing) == ["a", "c"]
    assert "missing, next: " in str(report)

    tensors, manual = small_model()
    manual["h"] = ValueError("shapes do not fit")
    report = mti.compare_grads(tensors, manual)
    assert report.first_wrong == "h" and report["h"].status == "error"
    assert "ValueError: shapes do not fit" in str(report)

    tensors, manual = small_model()
    manual["a"] = manual["a"] * np.nan
    report = mti.compare_grads(tensors, manual)
    assert report.first_wrong == "a" and "NaN" in report["a"].message


def test_close_depends_on_the_gradient_dtype_and_rtol():
    tensors, manual = small_model(mt.float32)
    manual["h"] = manual["h"] * (1 + 1e-6)
    report = mti.compare_grads(tensors, manual)
    assert report["h"].status == "close" and report.ok
    tensors, manual = small_model(mt.float64)
    manual["h"] = manual["h"] * (1 + 1e-6)
    assert mti.compare_grads(tensors, manual).first_wrong == "h"
    assert mti.compare_grads(tensors, manual, rtol=1e-5).ok


def test_stop_false_checks_every_tensor():
    tensors, manual = small_model()
    manual["a"] = manual["a"] + 1
    report = mti.compare_grads(tensors, manual, stop=False)
    assert report.first_wrong == "a" and len(report.lines) == 7 and report.unchecked == []
    assert report["c"].status == "close" or report["c"].status == "exact"


def test_the_engines_gradients_can_be_given_directly():
    tensors, manual = small_model()
    grads = {name: t.grad.numpy() for name, t in tensors.items()}
    assert mti.compare_grads(grads, manual).ok
    manual["b"] = manual["b"] * 2
    report = mti.compare_grads(grads, manual)
    assert report.first_wrong == "b" and report["b"].status == "wrong"
    assert [line.name for line in report.lines] == ["W", "b"]      # the order given
    assert report.hint == [] and "first wrong: b" in str(report)
    with pytest.raises(TypeError, match="not a float gradient"):
        mti.compare_grads({"ids": np.arange(3)}, {})


def test_usage_errors_say_what_to_do():
    tensors, manual = small_model()
    with pytest.raises(TypeError):
        mti.compare_grads([tensors["h"]], manual)
    with pytest.raises(KeyError, match="nope"):
        mti.compare_grads(tensors, {"nope": 1.0})
    x = mt.randn(3, dtype=mt.float64, requires_grad=True)
    y = x * 2
    loss = y.sum()
    loss.backward()                     # y.retain_grad() was never called
    with pytest.raises(ValueError, match="retain_grad"):
        mti.compare_grads({"y": y, "loss": loss}, {})


# ---- the engine's visit order ------------------------------------------------------------

def test_backward_order_is_the_order_the_engine_visits():
    p, idx, targets, _ = exercise.make_problem(3)
    tensors, _ = exercise.forward(p, idx, targets)
    predicted = mti.backward_order(tensors["loss"])
    with mti.BackwardTrace() as trace:
        tensors["loss"].backward()
    assert len(trace.order) == len(predicted) > 100
    assert trace.order == predicted
    # every node ran after every node that read its output
    position = trace.position()
    for node in trace.order:
        for inp in node.inputs:
            if inp is not None and inp._node is not None:
                assert position[inp._node] > position[node]
    assert mt.core._core.get_backward_profiler() is None     # the hook is gone afterwards


def test_trace_records_what_each_node_sent():
    x = mt.randn(3, 4, dtype=mt.float64, requires_grad=True)
    w = mt.randn(4, dtype=mt.float64, requires_grad=True)
    y = (x * w).sum()
    with mti.BackwardTrace(keep_grads=True) as trace:
        y.backward()
    mul = y.grad_fn.inputs[0].grad_fn
    assert [n.name() for n in trace.order] == ["SumBackward", "MulBackward"]
    np.testing.assert_allclose(trace.sent_grads[(mul, 0)], x.grad.numpy())
    assert trace.sent[(mul, 1)] == pytest.approx(np.linalg.norm(w.grad.numpy()))


# ---- the exercise ------------------------------------------------------------------------

def solution_functions(**replace):
    functions = {name: getattr(solution, name) for name in exercise.FUNCTION_NAMES}
    functions.update(replace)
    return functions


@pytest.fixture(scope="module")
def solved():
    return exercise.check(solution_functions())


def test_the_solution_is_right_everywhere(solved):
    report, tensors = solved
    assert report.ok, str(report)
    assert len(report.lines) == len(tensors) == 52
    assert [line.name for line in report.lines] == mti.compare.backward_names(tensors)
    assert sorted(exercise.FUNCTION_NAMES) == sorted(
        n for n in dir(solution) if n.startswith("d_"))


def test_every_tensor_has_its_function_and_the_template_has_them_all():
    import backprop_template as template
    names = {n for n in dir(template) if n.startswith("d_")}
    assert names == set(exercise.FUNCTION_NAMES)
    report, _ = exercise.check({n: getattr(template, n) for n in names})
    assert report.first_wrong is None and len(report.missing) == 51
    assert report.lines[0].status == "exact"          # d_loss is written for you
    assert "d_logprobs is not written yet" in str(report)


def _k_no_transpose(f, d, p):
    return d["scores"] @ f["q"] * p["scale"]


def _y_no_transpose(f, d, p):
    return d["attn_out"] @ p["Wo"]


def _pos_emb_no_sum(f, d, p):
    return d["x0"]


def _var_no_sum(f, d, p):
    x, mean, var = f["in"], f["mean"], f["var"]
    return d["xhat"] * (x - mean) * -0.5 * (var + p["eps"]) ** -1.5


def _logprobs_no_mean(f, d, p):
    B, T = f["targets"].shape
    g = np.zeros_like(f["logprobs"])
    b, t = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    g[b, t, f["targets"]] = -d["loss"]
    return g


def _x_last_no_mean_n(f, d, p):
    x, mean, var = f["ln_f.in"], f["ln_f.mean"], f["ln_f.var"]
    n = x.shape[-1]
    return (d["ln_f.xhat"] / np.sqrt(var + p["eps"]) + d["ln_f.var"] * 2 * (x - mean) / n
            + d["ln_f.mean"])


def _masked_columns(f, d, p):
    att, g = f["att"], d["att"]
    return att * (g - (g * att).sum(-2, keepdims=True))


def _masked_diagonal_only(f, d, p):
    att, g = f["att"], d["att"]
    return att * (1 - att) * g


def _mid_no_residual(f, d, p):
    return solution._into_layer_norm(f, d, p, "ln2.")


def _x_no_residual(f, d, p):
    return solution._into_layer_norm(f, d, p, "ln1.")


# (the mistake, the function it replaces, the tensor the report must name first, a rule
# the hint must show)
MISTAKES = [
    ("missing transpose in dk = dscores^T q", "d_k", _k_no_transpose, "h1.k", "MatmulBackward"),
    ("missing transpose of Wo", "d_y", _y_no_transpose, "h1.y", "MatmulBackward"),
    ("pos_emb not summed over the batch", "d_pos_emb", _pos_emb_no_sum, "pos_emb",
     "AddBackward"),
    ("var not summed over the features", "d_ln_var", _var_no_sum, "ln_f.var", "MulBackward"),
    ("missing 1/N of the mean in the loss", "d_logprobs", _logprobs_no_mean, "logprobs",
     "MeanBackward"),
    ("missing 1/n of the layer norm's mean", "d_x_last", _x_last_no_mean_n, "x2",
     "MeanBackward"),
    ("softmax Jacobian summed over the wrong axis", "d_masked", _masked_columns, "h1.masked",
     "SoftmaxBackward"),
    ("softmax Jacobian's diagonal only", "d_masked", _masked_diagonal_only, "h1.masked",
     "SoftmaxBackward"),
    ("residual gradient not added at mid", "d_mid", _mid_no_residual, "h1.mid", "AddBackward"),
    ("residual gradient not added at a layer's input", "d_x", _x_no_residual, "x1",
     "AddBackward"),
]


@pytest.mark.parametrize("what, fname, wrong, expected, rule", MISTAKES,
                         ids=[m[0] for m in MISTAKES])
def test_a_planted_mistake_is_named_first(what, fname, wrong, expected, rule):
    report, tensors = exercise.check(solution_functions(**{fname: wrong}))
    assert report.first_wrong == expected, str(report)
    assert report.lines[-1].name == expected
    assert report.lines[-1].status in ("wrong", "wrong shape")
    assert all(line.good for line in report.lines[:-1])
    assert rule in [op for op, _ in report.hint], report.hint
    for op, math in report.hint:
        assert "=" in math                          # the rule's math line, not a bare name
    # what was computed from it inherits the error: the token embeddings always do,
    # unless the mistake sits at the very bottom
    if expected not in ("pos_emb",):
        assert "tok_emb" in report.inherit
    assert report.lines[-1].name not in report.inherit
    assert f"first wrong: {expected}." in str(report)


def test_a_function_that_raises_is_an_error_line_with_its_place(tmp_path):
    source = open(exercise.SOLUTION).read().replace(
        'return d["mlp_out"] @ p["W2"].T', 'return d["mlp_out"] @ p["W2"]')
    path = tmp_path / "mine.py"
    path.write_text(source)
    functions = exercise.load_functions("backprop_by_hand.py", str(path))
    report, _ = exercise.check(functions)
    line = report.lines[-1]
    assert report.first_wrong == "h1.gelu" and line.status == "error"
    number = source.splitlines().index('    return d["mlp_out"] @ p["W2"]') + 1
    assert f"mine.py line {number}" in line.message and "ValueError" in line.message


def test_a_gradient_read_before_it_exists_is_missing_with_the_reason():
    def d_logits(f, d, p):
        return d["ln_f.out"]           # not computed yet: comes later in backward
    report, _ = exercise.check(solution_functions(d_logits=d_logits))
    assert report["logits"].status == "missing"
    assert "needs dL/dln_f.out first" in report["logits"].message


# ---- the script --------------------------------------------------------------------------

def run(*argv, cwd=None):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, "backprop_by_hand.py"), *argv],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_script_solution_template_and_listing(tmp_path):
    result = run("--solution")
    assert result.returncode == 0, result.stderr
    assert "52 of 52 right: all done" in result.stdout
    result = run("--mine", os.path.join(EXAMPLES, "backprop_template.py"))
    assert result.returncode == 1 and "51 missing, next: logprobs" in result.stdout
    result = run()
    assert result.returncode == 0 and "d_logprobs" in result.stdout and "cp " in result.stdout
    mine = tmp_path / "mine.py"
    mine.write_text(open(exercise.SOLUTION).read().replace("/ (B * T)", ""))
    result = run("--mine", str(mine))
    assert result.returncode == 1 and "first wrong: logprobs." in result.stdout
    assert "MeanBackward" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("def d_loss(f, d, p)\n    return 1\n", "line 1: syntax error"),
    ("import numpy as np\n", "defines none of the functions"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    (b"\xff\xfe not text", "not UTF-8"),
    ("dir", "is a directory"),
])
def test_a_bad_file_is_a_one_line_error(tmp_path, content, fragment):
    path = tmp_path / "mine.py"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    result = run("--mine", str(path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("backprop_by_hand.py: error: "), result.stderr
    assert fragment in lines[0]


# ---- answers the checker cannot compare, dtypes, NaN, broadcast shapes ----------------------

def one(engine, mine, **kw):
    """The line of one gradient checked on its own (the engine's gradient given directly)."""
    report = mti.compare_grads({"g": engine}, {"g": mine}, **kw)
    return report["g"], str(report)


class Strange:
    pass


MALFORMED = [
    ("ragged list", [[1.0, 2.0, 3.0, 4.0, 5.0], [1.0]], "list"),
    ("ragged nested arrays", [np.zeros(5), np.zeros(3)], "list"),
    ("string", "dL/dh", "str"),
    ("bytes", b"\x00\x01", "bytes"),
    ("None inside a list", [None, 1.0, 2.0, 3.0, 4.0], "list"),
    ("a dict", {"g": np.zeros(5)}, "dict"),
    ("a set", {1.0, 2.0}, "set"),
    ("an object", Strange(), "Strange"),
    ("strings in an array", np.array(["a"] * 5), "<U1"),
    ("a function", lambda: 0, "function"),
]


@pytest.mark.parametrize("what, answer, kind", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_an_answer_numpy_cannot_compare_is_one_error_line(what, answer, kind):
    engine = np.arange(5.0)
    line, text = one(engine, answer)
    assert line.status == "error" and not line.good
    assert kind in line.message and "float64 numpy array of shape (5,)" in line.message
    error_lines = [ln for ln in text.splitlines() if "ERROR" in ln]
    assert len(error_lines) == 1 and error_lines[0].startswith("g ")
    assert "Traceback" not in text


@pytest.mark.parametrize("imag", [0.0, 1e-3, 2.0])
def test_a_complex_answer_is_an_error_not_its_real_part(imag):
    engine = np.linspace(-1, 1, 6).reshape(2, 3)
    line, text = one(engine, engine + 1j * imag)
    assert line.status == "error" and "complex" in line.message
    assert "float64 numpy array of shape (2, 3)" in line.message
    # a tensor or a list of complex numbers: the same
    assert one(engine, (engine + 1j * imag).tolist())[0].status == "error"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32, np.bool_])
def test_a_dtype_below_the_engines_is_named(dtype):
    rng = np.random.default_rng(1)
    engine = rng.standard_normal((3, 4)) if np.dtype(dtype).kind == "f" \
        else rng.integers(0, 2, (3, 4)).astype(np.float64)
    line, text = one(engine, engine.astype(dtype))
    assert line.status == "wrong dtype" and not line.good, text
    assert f"{np.dtype(dtype)}, expected float64" in text
    # as a microtensor tensor too
    if np.dtype(dtype).kind == "f":
        line, text = one(engine, mt.from_numpy(engine.astype(dtype)))
        assert f"{np.dtype(dtype)}, expected float64" in text


def test_float32_equal_when_printed_says_float32():
    engine = np.array([0.1, 1 / 3, 2 / 3, np.pi])
    mine = engine.astype(np.float32)
    line, text = one(engine, mine)
    assert f"{float(mine[1]):.6g}" == f"{engine[1]:.6g}"          # equal when printed
    assert "WRONG DTYPE float32, expected float64" in text
    # a float32 answer that is wrong as well: both said
    line, text = one(engine, (engine * 2).astype(np.float32))
    assert line.status == "wrong" and "float32, expected float64" in text


@pytest.mark.parametrize("engine_dtype", [np.float32, np.float64])
def test_an_answer_at_least_as_precise_as_the_engine_is_fine(engine_dtype):
    engine = np.linspace(-2, 2, 7).astype(engine_dtype)
    assert one(engine, engine.astype(np.float64))[0].status == "exact"
    assert one(engine, engine.astype(np.float64).tolist())[0].status == "exact"


@pytest.mark.parametrize("where", [[0], [2, 5], [0, 1, 2, 3, 4, 5, 6, 7]])
def test_nan_in_the_same_places_is_a_match(where):
    engine = np.linspace(1, 2, 8)
    engine[where] = np.nan
    engine_inf = engine.copy()
    engine_inf[-1] = -np.inf if 7 not in where else np.nan
    assert one(engine, engine.copy())[0].status == "exact"
    assert one(engine_inf, engine_inf.copy())[0].status == "exact"
    close = engine * (1 + 1e-12)
    assert one(engine, close)[0].status in ("exact", "close")
    if len(where) < 8:
        # NaN where the engine has a number, or a number where it has NaN: wrong
        other = engine.copy()
        other[[i for i in range(8) if i not in where][0]] = np.nan
        line, _ = one(engine, other)
        assert line.status == "wrong" and "NaN" in line.message
        filled = np.nan_to_num(engine, nan=1.0)
        assert one(engine, filled)[0].status == "wrong"


BROADCASTS = [
    # engine shape, the answer's (un-summed) shape, axes named, the sum's code
    ((5,), (4, 5), ["axis 0 (the batch axis"], "g.sum(axis=0)"),
    ((8, 16), (4, 8, 16), ["axis 0 (the batch axis"], "g.sum(axis=0)"),
    ((16,), (4, 8, 16), ["axis 0 (the batch axis", "axis 1 (added"], "g.sum(axis=(0, 1))"),
    ((4, 1, 16), (4, 8, 16), ["axis 1 (size 1"], "g.sum(axis=1, keepdims=True)"),
    ((1, 5), (3, 4, 5), ["axis 0", "axis 1 (size 1"],
     "g.sum(axis=(0, 1), keepdims=True).reshape((1, 5))"),
    ((2, 1, 1), (2, 3, 4), ["axis 1 (size 1", "axis 2 (size 1"],
     "g.sum(axis=(1, 2), keepdims=True)"),
]


@pytest.mark.parametrize("shape, mine_shape, words, code", BROADCASTS,
                         ids=[f"{b[0]}<-{b[1]}" for b in BROADCASTS])
def test_wrong_shape_from_a_missing_sum_names_the_axes(shape, mine_shape, words, code):
    rng = np.random.default_rng(0)
    g = rng.standard_normal(mine_shape)         # the gradient of the broadcast result
    engine = g.sum(axis=tuple(range(len(mine_shape) - len(shape))))
    engine = engine.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1),
                        keepdims=True).reshape(shape)
    line, text = one(engine, g)
    assert line.status == "wrong shape"
    assert f"yours {mine_shape}, engine {shape}" in text
    for word in words:
        assert word in line.message, line.message
    assert code in line.message
    # the code the line prints is the fix
    fixed = eval(code, {"g": g})
    assert one(engine, fixed)[0].status in ("exact", "close")


@pytest.mark.parametrize("shape, mine_shape", [((3, 5), (5, 3)), ((4, 5), (2, 10)),
                                               ((5,), (6,)), ((4, 5), (4,))])
def test_wrong_shape_that_no_sum_explains_names_no_sum(shape, mine_shape):
    line, text = one(np.ones(shape), np.ones(mine_shape))
    assert line.status == "wrong shape" and "sum over" not in text


def test_the_exercise_names_the_batch_sum_of_the_position_embeddings():
    report, _ = exercise.check(solution_functions(d_pos_emb=_pos_emb_no_sum))
    line = report["pos_emb"]
    assert line.status == "wrong shape" and "sum over axis 0 (the batch axis" in line.message
    assert "g.sum(axis=0)" in str(report)


ODD_RETURNS = [
    ("ragged", lambda f, d, p: [[0.0] * 3, [0.0]], "list"),
    ("string", lambda f, d, p: "todo", "str"),
    ("None", lambda f, d, p: None, "returned None"),
    ("object", lambda f, d, p: Strange(), "Strange"),
    ("complex", lambda f, d, p: solution.d_logprobs(f, d, p) + 0j, "complex"),
    ("float32", lambda f, d, p: solution.d_logprobs(f, d, p).astype(np.float32),
     "float32, expected float64"),
]


@pytest.mark.parametrize("what, fn, fragment", ODD_RETURNS, ids=[r[0] for r in ODD_RETURNS])
def test_the_exercise_reports_an_odd_return_on_one_line(what, fn, fragment):
    report, _ = exercise.check(solution_functions(d_logprobs=fn))
    assert report.first_wrong == "logprobs", str(report)
    assert fragment in report["logprobs"].text(10)
    assert "(4, 8, " in str(report) or what == "float32"


def test_the_script_reports_a_ragged_answer_without_a_traceback(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(open(exercise.SOLUTION).read() + "\n\ndef d_logprobs(f, d, p):\n"
                    "    return [[1.0, 2.0], [3.0]]\n")
    result = run("--mine", str(mine))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [ln for ln in result.stdout.splitlines() if "ERROR" in ln]
    assert len(lines) == 1 and lines[0].startswith("logprobs") and "list" in lines[0]


# ---- watching the backward pass (graph.py --animate) ---------------------------------------

import graph as graph_example   # noqa: E402


def test_the_flow_lights_boxes_in_the_engines_order_and_splits_each_residual_add():
    flow = graph_example.traced_flow(2, True, seed=0)
    labels = [flow.graph.nodes[b].label.splitlines()[0] for b in flow.steps]
    assert labels[0] == "CrossEntropyBackward" and labels[-1] == "x"
    assert len(flow.splits) == 4                     # two residual adds per block
    # along the stream, every box is reached after the boxes its output feeds
    for a, b in flow.graph.edges:
        assert flow.box_step[b] < flow.box_step[a], (labels, a, b)
    assert all(norm > 0 for norm in flow.edge_norm.values())

    # the split against retained gradients: skip = |dL/dz|, branch = |dL/ds - dL/dz|
    loss, graph, x = graph_example.residual_stack(2, True, seed=0)
    nodes = {m for members in graph.origin.values() for m in members
             if not isinstance(m, mt.Tensor)}
    adds = mti.residual.residual_adds(list(nodes))
    outputs = {}
    for node in nodes:
        for t in node.inputs:
            if t is not None and t._node is not None:
                outputs[t._node] = t
    pairs = []
    for add, s_index, _ in adds:
        s, z = add.inputs[s_index], outputs[add]
        for t in (s, z):
            if t.grad_fn is not None:
                t.retain_grad()
        pairs.append((s, z))
    loss.backward()
    expected = sorted((np.linalg.norm(z.grad.numpy()),
                       np.linalg.norm(s.grad.numpy() - z.grad.numpy())) for s, z in pairs)
    got = sorted((skip, branch) for skip, branch, _ in flow.splits.values())
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_animate_writes_a_small_gif_and_two_stills(tmp_path):
    from PIL import Image
    code = graph_example.main(["--animate", "--deep", "3", "--out", str(tmp_path)])
    assert code == 0
    gif = tmp_path / "backward_pass.gif"
    with Image.open(gif) as im:
        assert im.n_frames >= 10 and im.size[0] < 800 and im.size[1] < 900
    assert gif.stat().st_size < 400_000
    for name in ("backward_pass.png", "backward_depth.png"):
        with Image.open(tmp_path / name) as im:
            assert im.size[0] > 300


def test_a_trace_and_a_recorders_residual_split_share_the_engines_hook():
    """The recorder's skip streams take over the engine's per-node hook during backward;
    a BackwardTrace around them keeps seeing every node, and gets its hook back."""
    from models import TransformerBlock
    mt.manual_seed(0)
    block = TransformerBlock(8, 2)
    x = mt.randn(1, 4, 8, requires_grad=True)
    alone = mti.backward_order(block(x).sum())
    recorder = mti.GradientRecorder(block)
    with recorder:
        y = block(x)
    with mti.BackwardTrace() as trace:
        y.sum().backward()
        assert mt.core._core.get_backward_profiler() == trace._hook
    assert [n.name() for n in trace.order] == [n.name() for n in alone]
    assert recorder[""].skip_norm is not None and recorder[""].branch_norm > 0
    assert mt.core._core.get_backward_profiler() is None
