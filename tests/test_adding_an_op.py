"""docs/ADDING_AN_OP.md is followed, not just read: its code blocks are the repository's
code verbatim, and the rule and registry row it shows, renamed to a new op and saved as a
new family file of microtensor/ops/ (nothing else changed), make a working op in a fresh
process: mt.<op>, t.<op>, its row and class, gradients to second order, a profiler line
and a replayed mt.compile plan."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import microtensor as mt

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ADDING_AN_OP.md"
EXAMPLE = "microtensor/ops/nan.py"      # the op the walkthrough adds

TAGGED_BLOCK = re.compile(r"<!-- from: (\S+) -->\n```python\n(.*?)\n```", re.S)


def tagged_blocks():
    """(path, code) of every fenced block with a `<!-- from: PATH -->` line above it."""
    return TAGGED_BLOCK.findall(DOC.read_text(encoding="utf-8"))


def test_every_tagged_block_is_verbatim_in_its_file():
    blocks = tagged_blocks()
    assert len(blocks) >= 6, f"only {len(blocks)} tagged blocks in {DOC.name}"
    untagged = DOC.read_text(encoding="utf-8").count("```python") - len(blocks)
    assert untagged == 0, f"{untagged} python block(s) without a `<!-- from: PATH -->` line"
    for path, code in blocks:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert code in source, f"this block of {DOC.name} is not in {path} any more:\n{code}"


def test_the_walkthrough_shows_all_three_steps():
    paths = [path for path, _ in tagged_blocks()]
    assert EXAMPLE in paths and "tests/test_ops.py" in paths
    rule = "\n".join(code for path, code in tagged_blocks() if path == EXAMPLE)
    for piece in ("class FmaxBackward(DifferentiableRule):",
                  "def create_graph(self, g):", "declare_saved(FmaxBackward)",
                  "needs_graph(", "attach(", 'register_op("fmax", fmax, kind="pointwise")'):
        assert piece in rule, f"the walkthrough's code lost {piece!r}"


def renamed(code):
    """The walkthrough's op under new names, so that it registers a new row: fmax ->
    fmax_walkthrough (numpy's np.fmax and the helper _fmax_like keep their names)."""
    code = code.replace("FmaxBackward", "FmaxWalkthroughBackward")
    code = re.sub(r"(?<![.\w])fmax\b", "fmax_walkthrough", code)
    return re.sub(r"(?<![.\w])fmin\b", "fmin_walkthrough", code)


# Runs in a child: the parent's microtensor must not get the new rows. The child only
# imports microtensor: the package finds the new family file by itself.
CHILD = r'''
import importlib, sys
import numpy as np
import microtensor as mt
from microtensor.autograd.higher_order import rule_for
from microtensor.profiler import Profiler

family = "microtensor.ops." + sys.argv[1]
assert family in sys.modules, "the package did not import the new family file"
module = sys.modules[family]
fmax_walkthrough, Backward = module.fmax_walkthrough, module.FmaxWalkthroughBackward

# the registry row made the function, the method and the row, with its class
assert mt.fmax_walkthrough is fmax_walkthrough, "mt.fmax_walkthrough is not the function"
assert mt.Tensor.__dict__["fmax_walkthrough"] is fmax_walkthrough, "no method in the class"
rows = {row.name: row for row in mt.ops.registry()}
assert rows["fmax_walkthrough"].module == family, rows["fmax_walkthrough"]
assert rows["fmax_walkthrough"].function is fmax_walkthrough
assert rows["fmax_walkthrough"].kind == "pointwise"
assert "fmax_walkthrough" in [row.name for row in mt.ops.registry("pointwise")]

# forward: numpy's fmax, NaN included, as a method and as a function, broadcasting
rng = np.random.default_rng(7)
a, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
a[0, 1], b[2] = np.nan, np.nan
np.testing.assert_array_equal(mt.tensor(a).fmax_walkthrough(mt.tensor(b)).numpy(), np.fmax(a, b))
np.testing.assert_array_equal(mt.fmax_walkthrough(mt.tensor(b), mt.tensor(a)).numpy(), np.fmax(b, a))

# the rule: its node, its create-graph rule, gradients to second order in float64
x = mt.tensor(rng.standard_normal((3, 4)), requires_grad=True)
y = mt.tensor(rng.standard_normal(4), requires_grad=True)
out = x.fmax_walkthrough(y)
assert type(out.grad_fn) is Backward, type(out.grad_fn)
assert mt.fmax_walkthrough(mt.tensor(a), mt.tensor(b)).grad_fn is None, "a node without needs_graph"
assert rule_for(Backward) is not None, "no create-graph rule"
assert mt.autograd.gradcheck(lambda p, q: p.fmax_walkthrough(q), [x, y])
assert mt.autograd.gradgradcheck(lambda p, q: mt.fmax_walkthrough(p, q), [x, y])
# the one rule gives the same values recording or not (first order and create_graph)
u = mt.tensor(rng.standard_normal((3, 4)), requires_grad=True)   # so the gradient has a graph
plain = mt.autograd.grad(x.fmax_walkthrough(y), [x, y], u)
graphed = mt.autograd.grad(x.fmax_walkthrough(y), [x, y], u, create_graph=True)
for p, q in zip(plain, graphed):
    assert q.grad_fn is not None
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=0, atol=0)

# declare_saved(...) with no inputs: an input changed in place after the forward pass
# does not stop backward (mul, whose backward reads its inputs, does stop)
x2 = x * 1.0
out, product = x2.fmax_walkthrough(y), x2 * y
with mt.no_grad():
    x2.mul_(3.0)
out.sum().backward()
assert y.grad is not None
try:
    product.sum().backward()
except RuntimeError as error:
    assert "modified" in str(error), error
else:
    raise SystemExit("the version check did not fire for mul: the contrast proves nothing")

# the profiler times it, as a function and as a method
with Profiler() as prof:
    mt.fmax_walkthrough(x, y)
    x.fmax_walkthrough(y)
calls = {op: n for _, op, n, _ in prof.summary()[0]}
assert calls.get("fmax_walkthrough") == 2, calls

# mt.compile records it and replays it: the plan shows it, the numbers are eager's
step = mt.compile(lambda p, q: (p.fmax_walkthrough(q) * q).sum())
eager = (x.fmax_walkthrough(y) * y).sum().item()
for _ in range(3):
    got = step(x, y).item()
assert got == eager, (got, eager)
assert step.plan is not None and "fmax_walkthrough" in str(step.plan), step.plan
x.grad = None
step(x, y).backward()
np.testing.assert_allclose(x.grad.numpy(), np.where(x.numpy() >= y.numpy(), y.numpy(), 0.0))

# one op, one row
try:
    mt.register_op("fmax_walkthrough", fmax_walkthrough, kind="pointwise")
except ValueError:
    pass
else:
    raise SystemExit("registering fmax_walkthrough twice did not raise ValueError")
print("walkthrough ok")
'''


def test_following_the_walkthrough_makes_a_working_op(tmp_path):
    """The walkthrough's code, renamed, saved as a new family file next to ops/nan.py (in
    the microtensor this test imports, installed or built in place), and removed after."""
    code = "\n\n".join(renamed(code) for path, code in tagged_blocks() if path == EXAMPLE)
    assert 'register_op("fmax_walkthrough", fmax_walkthrough, kind="pointwise")' in code
    assert "class FmaxWalkthroughBackward(DifferentiableRule):" in code
    assert "def backward" not in code          # the rule is written once
    family = f"walkthrough_{os.getpid()}"
    path = Path(mt.ops.__file__).parent / f"{family}.py"
    path.write_text(code, encoding="utf-8")
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, family], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    finally:
        path.unlink()
        for cached in (path.parent / "__pycache__").glob(f"{family}.*"):
            cached.unlink()
    assert r.returncode == 0, f"following docs/ADDING_AN_OP.md failed:\n{r.stdout}\n{r.stderr}"
    assert "walkthrough ok" in r.stdout


def test_the_walkthrough_test_line_is_in_the_op_table():
    """The table row the doc shows is a live row of OPS (not a comment or a dead copy)."""
    from test_ops import OPS
    assert "fmax" in OPS
    fn, reference = OPS["fmax"][0], OPS["fmax"][1]
    assert reference is np.fmax
    a, b = mt.tensor([1.0, float("nan")]), mt.tensor([float("nan"), 2.0])
    assert fn(a, b).tolist() == [1.0, 2.0]


# ---- the other forms of the table: each worked example runs ---------------------------------

UNARY_CHILD = r'''
import numpy as np
import microtensor as mt
from microtensor.ops import extra

# what the doc says to write in ops/extra.py: the row, the function, the registry name
extra._UNARY["cube"] = (lambda x: x * x * x, lambda M, x, y, g: 3 * g * x * x)  # dx = 3 g x^2
extra.cube = extra._make_unary("cube")
extra.register_ops("pointwise", vars(extra), "cube")

assert mt.cube is extra.cube and mt.Tensor.__dict__["cube"] is extra.cube
assert {r.name: r for r in mt.ops.registry("pointwise")}["cube"].module == "microtensor.ops.extra"
rng = np.random.default_rng(3)
a = rng.standard_normal((3, 4))
np.testing.assert_allclose(mt.tensor(a).cube().numpy(), a ** 3, rtol=1e-15)
x = mt.tensor(a, requires_grad=True)
assert type(x.cube().grad_fn).__name__ == "PointwiseBackward"
assert mt.autograd.gradcheck(mt.cube, [x])
assert mt.autograd.gradgradcheck(mt.cube, [x])
u = mt.tensor(rng.standard_normal((3, 4)), requires_grad=True)
plain, = mt.autograd.grad(mt.cube(x), [x], u)
graphed, = mt.autograd.grad(mt.cube(x), [x], u, create_graph=True)
np.testing.assert_allclose(graphed.numpy(), plain.numpy(), rtol=1e-14)
np.testing.assert_allclose(plain.numpy(), 3 * a * a * u.numpy(), rtol=1e-14)
print("unary row ok")
'''


def test_a_unary_row_makes_a_working_op(tmp_path):
    """The table's cheapest form: a row of _UNARY, its function and its registry name (in
    a child process, so the parent's registry keeps its rows) make mt.cube, t.cube, its
    row, and gradients to second order that agree between the array and tensor runs."""
    r = subprocess.run([sys.executable, "-c", UNARY_CHILD], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the _UNARY recipe failed:\n{r.stdout}\n{r.stderr}"
    assert "unary row ok" in r.stdout


def test_the_shape_example_is_the_rule_pad_runs():
    import microtensor.nn.functional as F
    x = mt.tensor(np.random.default_rng(4).standard_normal((2, 3)), requires_grad=True)
    y = F.pad(x, (1, 2, 0, 1))
    assert type(y.grad_fn).__name__ == "ConstantPadBackward"
    assert mt.autograd.gradcheck(lambda t: F.pad(t, (1, 2, 0, 1)), [x])
    assert mt.autograd.gradgradcheck(lambda t: F.pad(t, (1, 2, 0, 1)) ** 2, [x])


def test_the_fused_example_agrees_with_its_composite():
    """SiluBackward's kernel (first order) against the derivative of its composite."""
    import microtensor.nn.functional as F
    rng = np.random.default_rng(5)
    x = mt.tensor(rng.standard_normal((3, 7)), requires_grad=True)
    u = mt.tensor(rng.standard_normal((3, 7)), requires_grad=True)
    y = F.silu(x)
    assert type(y.grad_fn).__name__ == "SiluBackward"
    kernel, = mt.autograd.grad(y, [x], u, retain_graph=True)
    composite, = mt.autograd.grad(y, [x], u, create_graph=True)   # differentiates composite()
    assert composite.grad_fn is not None
    np.testing.assert_allclose(kernel.numpy(), composite.numpy(), rtol=1e-12, atol=1e-14)


def test_the_table_names_every_form_in_the_code():
    """Every node base the package writes rules with appears in the doc's table, and every
    Python node is one of them (or a named TWO_BODIES exception)."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("## Which form, for which kind of op", 1)[1].split("\n## ", 1)[0]
    for form in ("`_UNARY`", "`DifferentiableRule`", "`FusedNode`", "cdef class",
                 "`mt.autograd.Function`", "no node: a function of differentiable ops",
                 "`TWICE_WRITTEN`", "`TWO_BODIES`"):
        assert form in table, f"the table of {DOC.name} does not name {form}"
    for kind in ("pointwise", "reduction", "shape", "fused", "custom"):
        assert f"**{kind}" in table or kind in table, kind
    from microtensor.autograd.graph_rules import DifferentiableRule, FusedNode
    from microtensor.ops.extra import PointwiseBackward
    from test_higher_order import TWO_BODIES, _python_nodes
    for name, cls in _python_nodes().items():
        if "backward" not in vars(cls) and "create_graph" not in vars(cls):
            continue
        assert issubclass(cls, (DifferentiableRule, FusedNode)) or cls is PointwiseBackward \
            or name in TWO_BODIES or name.startswith("microtensor.autograd."), name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
