"""Layers point one way: engine -> nn -> models -> examples.

Every import in microtensor/, models/ and examples/ is read (the Python files with
`ast`, the Cython files line by line, function-level imports included) and each arrow
must point to the same layer or one below:

    0 engine    microtensor's core (core/: _core and its include files, dtypes, dialect,
                the generator), the ops (ops/), the Cython kernels (kernels/), the
                runtime (runtime/), autograd, serialization, threads, profiler, optim,
                capture, amp, cuda, backends, linalg, distributed, inspect (instruments
                built on the engine's hooks)
    1 nn        microtensor.nn, and the package facade `microtensor` (its __init__ may
                import nn; so importing the facade counts as importing nn), coverage,
                runtime.buildinfo (show_config reads which build of the fused kernels
                nn loaded)
    2 models    models/ (public APIs only: nothing named with a leading underscore)
    3 examples  examples/ (and its helpers _cli, chardata)
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE, NN, MODELS, EXAMPLES = 0, 1, 2, 3
LAYER_NAMES = {ENGINE: "engine", NN: "nn", MODELS: "models", EXAMPLES: "examples"}

# microtensor.<component> -> layer, by the longest dotted prefix listed; everything under
# microtensor must be listed
MICROTENSOR = {
    "core": ENGINE, "ops": ENGINE, "kernels": ENGINE, "runtime": ENGINE,
    "amp": ENGINE, "autograd": ENGINE, "backends": ENGINE, "cuda": ENGINE,
    "distributed": ENGINE, "inspect": ENGINE, "linalg": ENGINE, "optim": ENGINE,
    "profiler": ENGINE, "serialization": ENGINE, "threads": ENGINE, "capture": ENGINE,
    "compiler": ENGINE, "nn": NN, "coverage": NN, "runtime.buildinfo": NN,
}
# the files `include`d into an extension belong to it: the core's include files (core/,
# ops/) and its kernels belong to core._core; the fused kernels' shared code to _fused
INCLUDED_IN = {"core": "microtensor.core._core", "ops": "microtensor.core._core",
               "kernels/core_kernels": "microtensor.core._core",
               "kernels": "microtensor.kernels._fused"}

# Arrows that still point up, each to be removed when its import is turned around (the
# test fails when one of them is gone, so the list only ever shrinks).
KNOWN_UPWARD = set()

SOURCE_SUFFIXES = (".py", ".pyx", ".pxi", ".pxd")


def module_name(path):
    rel = os.path.relpath(path, ROOT)
    parts = rel.rsplit(".", 1)[0].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if path.endswith(".pxi"):
        inside = "/".join(parts[1:])
        return INCLUDED_IN.get(inside, INCLUDED_IN[parts[1]])
    if parts[0] == "examples" and len(parts) == 2:
        return "examples." + parts[1]
    return ".".join(parts)


def source_files():
    for top in ("microtensor", "models", "examples"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    yield os.path.join(dirpath, name)


def known_modules():
    """Every importable name of the three trees (packages and modules)."""
    names = set()
    for path in source_files():
        name = module_name(path)
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    names.update({"_cli", "chardata"})
    return names


def imports_of(path):
    """[(imported dotted name, line)] of one file, every import statement in it."""
    text = open(path, encoding="utf-8").read()
    found = []
    if path.endswith(".py"):
        package = module_name(path)
        if not path.endswith("__init__.py"):
            package = package.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    else:
        pattern = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+\(?([\w, ]+)|c?import\s+([\w.]+))")
        for lineno, line in enumerate(text.splitlines(), 1):
            m = pattern.match(line)
            if m is None:
                continue
            if m.group(3):
                found.append((m.group(3), lineno))
            else:
                found += [(f"{m.group(1)}.{n.strip()}", lineno)
                          for n in m.group(2).split(",") if n.strip()]
    return found


def resolve(name, known):
    """The longest prefix of `name` that is one of ours (`from a import b` may import
    module a.b or a name of a), or None for third-party modules."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in known:
            return candidate
    return None


def layer(module):
    parts = module.split(".")
    if parts[0] == "microtensor":
        if len(parts) == 1:
            return NN                        # the facade imports nn
        for i in range(len(parts), 1, -1):
            if ".".join(parts[1:i]) in MICROTENSOR:
                return MICROTENSOR[".".join(parts[1:i])]
        raise AssertionError(f"{module}: not placed in a layer; add it to MICROTENSOR "
                             "in tests/test_layering.py")
    if parts[0] == "models":
        return MODELS
    if parts[0] in ("examples", "_cli", "chardata"):
        return EXAMPLES
    raise AssertionError(f"{module}: no layer")


def arrows():
    known = known_modules()
    out = []
    for path in source_files():
        source = module_name(path)
        for name, lineno in imports_of(path):
            target = resolve(name, known)
            if target is not None and target != source:
                out.append((source, target, name, f"{os.path.relpath(path, ROOT)}:{lineno}"))
    return out


@pytest.fixture(scope="module")
def all_arrows():
    return arrows()


def test_every_module_has_a_layer(all_arrows):
    for path in source_files():
        layer(module_name(path))


def test_no_arrow_points_up(all_arrows):
    upward = [(s, t, where) for s, t, _, where in all_arrows
              if layer(t) > layer(s) and (s, t) not in KNOWN_UPWARD]
    message = "\n".join(f"{where}: {s} ({LAYER_NAMES[layer(s)]}) imports {t} "
                        f"({LAYER_NAMES[layer(t)]})" for s, t, where in upward)
    assert not upward, "imports pointing up a layer:\n" + message


def test_the_known_upward_arrows_are_still_there(all_arrows):
    # when one is turned around, take it off KNOWN_UPWARD
    present = {(s, t) for s, t, _, _ in all_arrows}
    assert KNOWN_UPWARD <= present, f"gone, remove from KNOWN_UPWARD: {KNOWN_UPWARD - present}"


def test_optim_imports_only_the_engine(all_arrows):
    bad = [(s, t, where) for s, t, _, where in all_arrows
           if s.startswith("microtensor.optim") and layer(t) != ENGINE]
    assert not bad, bad


def test_models_and_examples_use_public_names_only(all_arrows):
    private = [(s, name, where) for s, t, name, where in all_arrows
               if layer(s) >= MODELS and t.split(".")[0] == "microtensor"
               and any(part.startswith("_") for part in name.split(".")[1:])]
    assert not private, "private microtensor names used above nn:\n" + "\n".join(
        f"{where}: {s} imports {name}" for s, name, where in private)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    # the reader itself: relative, function-level, `from a import b` of a module, Cython
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from microtensor.nn import functional\n"
                   "import models.gpt as g\n")
    assert sorted(n for n, _ in imports_of(str(mod))) == ["microtensor.nn.functional", "models.gpt"]
    pyx = tmp_path / "k.pyx"
    pyx.write_text("from scipy.linalg.cython_blas cimport sgemm, dgemm\n"
                   "from microtensor.kernels._blas import pin\ncimport numpy\n")
    names = [n for n, _ in imports_of(str(pyx))]
    assert names == ["scipy.linalg.cython_blas.sgemm", "scipy.linalg.cython_blas.dgemm",
                     "microtensor.kernels._blas.pin", "numpy"]
    known = known_modules()
    assert resolve("microtensor.nn.functional.softmax", known) == "microtensor.nn.functional"
    assert resolve("microtensor.Tensor", known) == "microtensor"
    assert layer("microtensor") == NN and layer("microtensor.optim.sgd") == ENGINE


# ---- import circles ------------------------------------------------------------------------
# The circles still there (every import counted, function-level ones included), each to
# be taken apart: a new one fails, and one taken apart must leave this list.
KNOWN_CIRCLES = []


def import_circles(arrows):
    """The strongly connected groups (two modules or more) of microtensor's import graph."""
    edges = {}
    for s, t, _, _ in arrows:
        if s.split(".")[0] == t.split(".")[0] == "microtensor" and s != t:
            edges.setdefault(s, set()).add(t)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):                              # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)
    for v in list(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_new_import_circle(all_arrows):
    circles = import_circles(all_arrows)
    new = [sorted(c) for c in circles if not any(c <= known for known in KNOWN_CIRCLES)]
    assert not new, f"new import circles: {new}"
    gone = [sorted(k) for k in KNOWN_CIRCLES if not any(c == k for c in circles)]
    assert not gone, f"circles taken apart (or changed): update KNOWN_CIRCLES: {gone}"


def test_the_circle_finder_finds_a_circle():
    arrows = [("microtensor.a", "microtensor.b", "", ""), ("microtensor.b", "microtensor.c", "", ""),
              ("microtensor.c", "microtensor.a", "", ""), ("microtensor.c", "microtensor.d", "", "")]
    assert import_circles(arrows) == [{"microtensor.a", "microtensor.b", "microtensor.c"}]
