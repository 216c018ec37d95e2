"""Guards for the op registry (microtensor/core/registry.pxi): one row per op makes its `mt.`
function, its Tensor method and names its operator; nothing else may make them."""
import inspect
import operator
import re
from pathlib import Path

import os

import numpy as np
import pytest

import microtensor as mt
from test_ops import OPS

ROOT = Path(__file__).resolve().parent.parent
ROWS = mt.registered_ops()


def test_the_registry_has_the_core_and_the_example():
    names = {row.label for row in ROWS}
    assert len(names) == len(ROWS), "two rows share a name"
    for name in ("add", "exp", "sum", "reshape", "matmul", "softmax", "fmax"):
        assert name in names, f"no registry row for {name}"


@pytest.mark.parametrize("row", [r for r in ROWS if r.export], ids=lambda r: r.name)
def test_an_exported_row_is_its_mt_function(row):
    assert getattr(mt, row.name, None) is row.function, f"mt.{row.name} is not {row.function!r}"


def test_tensor_has_no_getattr_fallback():
    """Methods are found by the ordinary lookup, so a missing one is an AttributeError
    and not a call routed somewhere at run time."""
    for cls in type.mro(mt.Tensor):
        assert "__getattr__" not in cls.__dict__, f"{cls.__name__} defines __getattr__"
    with pytest.raises(AttributeError):
        mt.tensor([1.0]).no_such_method_anywhere


@pytest.mark.parametrize("row", [r for r in ROWS if r.method is not None], ids=lambda r: r.name)
def test_a_method_row_is_in_the_class_itself(row):
    installed = mt.Tensor.__dict__.get(row.name)
    assert installed is not None, f"Tensor.{row.name} is not in the class dictionary"
    if hasattr(row.method, "__get__"):
        assert installed is row.method, f"Tensor.{row.name} is not the row's method"
    else:
        assert callable(installed)   # a builtin is installed inside a one-line wrapper
    assert inspect.getattr_static(mt.tensor([1.0]), row.name) is installed


# `def NAME(self, ...): return NAME(self, ...)`, on one line or under a docstring
FORWARD = r'def (\w+)\(self[^)]*\):\s*(?:"""[^"]*"""\s*)?return \1\(self'


def test_tensor_pxi_has_no_hand_written_forward_for_a_registered_op():
    """`def exp(self): return exp(self)` in core/tensor.pxi would be a second place the method
    is made; the registry row is the one place."""
    source = (ROOT / "microtensor" / "core/tensor.pxi").read_text(encoding="utf-8")
    forwards = re.findall(FORWARD, source)
    registered = {row.name for row in ROWS}
    hand_written = sorted(set(forwards) & registered)
    assert not hand_written, f"core/tensor.pxi forwards registered ops by hand: {hand_written}"


def test_the_forward_pattern_catches_a_hand_written_forward():
    samples = ('    def exp(self): return exp(self)\n',
               '    def sum(self, dim=None):\n        """sum"""\n        return sum(self, dim)\n',
               '    def __add__(self, other): return add(self, other)\n')
    assert [re.findall(FORWARD, s) for s in samples] == [["exp"], ["sum"], []]


# ---- operators: each slot in core/tensor.pxi calls the module-level function its row names ----

BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
          "**": operator.pow, "//": operator.floordiv, "%": operator.mod, "@": operator.matmul,
          "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
          "==": operator.eq, "!=": operator.ne, "&": operator.and_, "|": operator.or_}
OPERATOR_ROWS = [r for r in ROWS if r.operator in BINARY]


def operands(symbol):
    rng = np.random.default_rng(3)
    if symbol in ("&", "|"):
        return mt.tensor([True, False, True, False]), mt.tensor([True, True, False, False])
    if symbol == "@":
        return mt.tensor(rng.standard_normal((3, 4))), mt.tensor(rng.standard_normal((4, 2)))
    a = mt.tensor(rng.uniform(0.5, 2.0, (3, 4)))
    b = mt.tensor(np.round(rng.uniform(0.5, 2.0, 4), 1))
    return a, b


def test_every_binary_operator_has_a_row():
    assert {r.operator for r in OPERATOR_ROWS} == set(BINARY)


@pytest.mark.parametrize("row", OPERATOR_ROWS, ids=lambda r: r.name)
def test_an_operator_calls_its_rows_function(row, monkeypatch):
    import microtensor.core._core as core
    name = row.function.__name__
    original = getattr(core, name)
    assert original is row.function, f"mt.core._core.{name} is not the {row.name} row's function"
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(core, name, spy)
    a, b = operands(row.operator)
    out = BINARY[row.operator](a, b)
    assert calls, f"`a {row.operator} b` did not call mt.core._core.{name}"
    expected = row.function(a, b)
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out.numpy(), expected.numpy())


# ---- register_op refuses what would make a second row ---------------------------------

def test_register_op_refuses_a_name_that_is_not_an_identifier():
    with pytest.raises(ValueError, match="identifier"):
        mt.register_op("not a name", lambda t: t, kind="pointwise")


def test_register_op_refuses_a_function_that_is_not_callable():
    with pytest.raises(TypeError, match="callable"):
        mt.register_op("registry_test_not_callable", 3, kind="pointwise")


def test_register_op_refuses_a_name_registered_already():
    with pytest.raises(ValueError, match="registered already"):
        mt.register_op("add", lambda a, b: a, kind="pointwise")


def test_register_op_refuses_a_name_tensor_has_already():
    with pytest.raises(ValueError, match="already has an attribute"):
        mt.register_op("shape", lambda t: t, kind="pointwise")
    assert isinstance(mt.tensor([1.0, 2.0]).shape, tuple)


def _clash_with_an_mt_name(monkeypatch):
    monkeypatch.setattr(mt, "registry_test_taken", object(), raising=False)
    return "registry_test_taken", (lambda t: t), {}


REFUSALS = {
    "not an identifier": lambda mp: ("not a name", (lambda t: t), {}),
    "function not callable": lambda mp: ("registry_test_refused", 3, {}),
    "method not callable": lambda mp: ("registry_test_refused", (lambda t: t), {"method": 3}),
    "registered already": lambda mp: ("add", (lambda a, b: a), {}),
    "a Tensor attribute": lambda mp: ("shape", (lambda t: t), {}),
    "an mt name taken": _clash_with_an_mt_name,
    "no kind": lambda mp: ("registry_test_refused", (lambda t: t), {"kind": None}),
    "a kind not in KINDS": lambda mp: ("registry_test_refused", (lambda t: t), {"kind": "elementwise"}),
    "an aliasing not in ALIASINGS": lambda mp: ("registry_test_refused", (lambda t: t),
                                                {"aliasing": "alias"}),
}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_a_refused_row_leaves_no_trace(reason, monkeypatch):
    """Every refusal is decided before anything is installed: no method, no mt.
    function and no row are left behind, and a row it clashed with is untouched."""
    name, function, kwargs = REFUSALS[reason](monkeypatch)
    before_rows = [(r.name, r.function, r.method) for r in mt.registered_ops()]
    before_method = mt.Tensor.__dict__.get(name)
    before_mt = getattr(mt, name, None)
    with pytest.raises((ValueError, TypeError)):
        mt.register_op(name, function, **{"kind": "pointwise", **kwargs})
    assert [(r.name, r.function, r.method) for r in mt.registered_ops()] == before_rows
    assert mt.Tensor.__dict__.get(name) is before_method
    assert getattr(mt, name, None) is before_mt


def test_register_op_needs_a_kind():
    with pytest.raises(TypeError, match="kind"):
        mt.register_op("registry_test_no_kind", lambda t: t)
    assert "registry_test_no_kind" not in [r.name for r in mt.ops.registry()]


# ---- the op classes: every row has one, and mt.ops.registry(kind) lists them -------------

EXPECTED_KIND = {"add": "pointwise", "exp": "pointwise", "sum": "reduction", "cumsum": "reduction",
                 "reshape": "shape", "cat": "shape", "gather": "index", "getitem": "index",
                 "matmul": "matmul", "mm": "matmul", "softmax": "fused", "eye": "creation",
                 "new_zeros": "creation", "bernoulli": "random", "masked_fill_": "inplace",
                 "fmax": "pointwise"}


def test_every_row_has_a_kind_and_the_kinds_partition_the_registry():
    rows = mt.ops.registry()
    assert all(row.kind in mt.ops.KINDS for row in rows)
    by_kind = [row.name for kind in mt.ops.KINDS for row in mt.ops.registry(kind)]
    assert sorted(by_kind) == sorted(row.name for row in rows)
    kinds = {row.name: row.kind for row in rows}
    for name, kind in EXPECTED_KIND.items():
        assert kinds[name] == kind, (name, kinds[name])
    with pytest.raises(ValueError, match="kind must be one of"):
        mt.ops.registry("elementwise")


def test_the_registry_is_the_only_list_of_ops():
    """No hand list of Tensor methods is left in the package: every method the registry
    installed has its row, and every Python-written mt.<op> is a row's function."""
    root = os.path.dirname(os.path.abspath(mt.__file__))
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith((".py", ".pyx", ".pxi")):
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                assert "TENSOR_METHODS" not in text, os.path.join(folder, name)
    rows = {row.label: row for row in mt.ops.registry()}
    for name in mt.core._core.registered_tensor_methods():
        assert rows[name].method is mt.Tensor.__dict__[name]
    for module in (mt.ops.extra, mt.ops.compare, mt.ops.index, mt.ops.linalg):
        for name, obj in vars(module).items():
            if callable(obj) and getattr(obj, "__module__", None) == module.__name__ \
                    and getattr(mt, name, None) is obj and not isinstance(obj, type):
                assert name in rows, f"mt.{name} has no registry row"


def test_every_op_of_f_and_of_linalg_is_a_row():
    """F's ops and mt.linalg's are registry rows too (scope "F" / "linalg"): what the
    profiler times and mt.compile records comes from the rows, so an op without one
    would be missed by both."""
    import microtensor.nn.functional as F
    helpers = {"attach", "declare_saved", "needs_graph", "wrap"}
    functions = {id(row.function): row for row in mt.ops.registry()}
    for scope, module in (("F", F), ("linalg", mt.linalg)):
        names = [n for n in dir(module) if not n.startswith("_") and n not in helpers
                 and callable(getattr(module, n)) and not isinstance(getattr(module, n), type)]
        assert len(names) >= (40 if scope == "F" else 3)
        for name in names:
            row = functions.get(id(getattr(module, name)))
            assert row is not None, f"{scope}.{name} has no registry row"
            assert row.scope in (scope, ""), row
    rows = {row.label: row for row in mt.ops.registry()}
    assert rows["F.gelu"].kind == "pointwise" and rows["F.layer_norm"].kind == "fused"
    assert rows["F.gelu"].function is F.gelu and rows["linalg.norm"].function is mt.linalg.norm
    assert not hasattr(mt, "layer_norm") and "layer_norm" not in mt.Tensor.__dict__


def test_a_scoped_row_has_no_method_and_no_mt_function():
    with pytest.raises(ValueError, match="scope must be one of"):
        mt.register_op("registry_test_scoped", lambda t: t, kind="pointwise", scope="nn")
    with pytest.raises(ValueError, match="no method and no operator"):
        mt.register_op("registry_test_scoped", lambda t: t, kind="pointwise", scope="F",
                       operator="@@")
    assert "F.registry_test_scoped" not in [r.label for r in mt.ops.registry()]


# ---- every core op with a gradient has a line in the op table of test_ops.py ----------

# Core rows with no gradient to check: bool or integer results, or no new graph node.
NO_GRADIENT = {
    "lt", "le", "gt", "ge", "eq", "ne",                  # comparisons: bool tensors
    "logical_not", "logical_and", "logical_or",          # bool in, bool out
    "isnan", "isfinite",                                 # bool out
    "argmax", "argmin",                                  # int64 indices
    "floor_divide",                                      # piecewise constant: no grad_fn
    "is_contiguous",                                     # a bool, not a tensor
}
# Core rows whose table line has another name.
COVERED_AS = {
    "getitem": "index_slice",                            # the index_* rows
    "clip": "clamp",                                     # the same function as clamp
}


def in_table(name):
    return name in OPS or any(key.startswith(name + "_") for key in OPS)


def core_rows():
    return [r for r in ROWS if r.module == "microtensor.core._core"]


def test_every_core_op_with_a_gradient_has_a_table_line():
    missing = [r.name for r in core_rows()
               if r.name not in NO_GRADIENT | set(COVERED_AS)
               and not in_table(r.name)]
    assert not missing, f"core ops with a gradient but no line in tests/test_ops.py OPS: {missing}"
    for name, key in COVERED_AS.items():
        assert key in OPS, f"{name} is said to be covered by {key!r}, which is not in OPS"


def test_the_exclusions_name_real_rows():
    names = {r.name for r in core_rows()}
    stale = sorted((NO_GRADIENT | set(COVERED_AS)) - names)
    assert not stale, f"excluded names that are no core row: {stale}"


@pytest.mark.parametrize("name", sorted(NO_GRADIENT - {"is_contiguous"}))
def test_the_no_gradient_rows_really_have_none(name):
    row = next(r for r in ROWS if r.name == name)
    a = mt.tensor([[1.5, -2.5], [0.5, 3.0]], dtype=mt.float64, requires_grad=True)
    b = mt.tensor([[1.0, 2.0], [-0.5, 3.0]], dtype=mt.float64, requires_grad=True)
    if name.startswith("logical_"):
        a, b = a > 0, b > 0
    args = (a,) if name in ("logical_not", "isnan", "isfinite", "argmax", "argmin") else (a, b)
    out = row.function(*args)
    assert not out.requires_grad and out.grad_fn is None, f"{name} records a gradient"
