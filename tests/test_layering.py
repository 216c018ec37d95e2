"""Layers point one way: each folder of microtensor/ is a layer, and every import points to
its own layer or one below. No exceptions are listed: an import that runs back up fails.

Every import in microtensor/, models/ and examples/ is read (the Python files with `ast`,
the Cython files line by line, function-level imports included). LAYERS, bottom first, is
also the map docs/ARCHITECTURE.md draws (docs/regenerate.py reads it from here).
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (layer, what it holds), bottom first: a layer may import its own and those above it here
LAYERS = [
    ("runtime", "the machine: CPU features, which BLAS serves matmul, OpenMP's and malloc's "
                "settings, the build's configuration"),
    ("kernels", "Cython kernels: gemm, the fused row kernels (layer norm, softmax, "
                "cross-entropy, attention), foreach, and the choice of their build"),
    ("core", "the Tensor, the graph and the backward engine (Cython), dtypes, the random "
             "generator, the op registry"),
    ("autograd", "what rules share (DifferentiableRule, FusedNode), create_graph, "
                 "autograd.grad, Function, gradcheck"),
    ("ops", "every op, one file per family: its forward, its backward rule and its "
            "registry row (Tensor methods, mt.*, F.*)"),
    ("capture", "mt.compile: record a step's ops once, replay them as a plan"),
    ("inspect", "mt.inspect: watch the graph and the backward pass, node by node"),
    ("distributed", "mt.distributed: MPI collectives (all_reduce, broadcast) between "
                    "processes"),
    ("nn", "modules only: Module, containers, the layers, init, utils, "
           "DistributedDataParallel; nn.functional hands on the ops"),
    ("optim", "SGD, Adam/AdamW (a fused kernel), learning-rate schedules"),
    ("face", "import microtensor: the package's __init__ and top-level modules (threads, "
             "linalg, serialization, profiler, amp, ...), the names users import"),
    ("models", "GPT and its blocks, nanoGPT-style, on the public API only"),
    ("examples", "flat training scripts (train_char.py, ...) and their helpers"),
]
LAYER_NAMES = [name for name, _ in LAYERS]
LAYER = {name: i for i, name in enumerate(LAYER_NAMES)}
FOLDERS = {"runtime", "kernels", "core", "autograd", "ops", "capture", "inspect",
           "distributed", "nn", "optim"}
# the files `include`d into an extension belong to it: the core's include files (core/,
# ops/) and its kernels belong to core._core; the fused kernels' shared code to _fused
INCLUDED_IN = {"core": "microtensor.core._core", "ops": "microtensor.core._core",
               "kernels/core_kernels": "microtensor.core._core",
               "kernels": "microtensor.kernels._fused"}

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
    """The layer of a module: its folder of microtensor/ (the face for the package and its
    top-level modules), models or examples. A module's layer is its file's, so an import
    of `microtensor.ops.extra` from a .pxi compiled into the core counts as the core's."""
    parts = module.split(".")
    if parts[0] == "microtensor":
        if len(parts) > 1 and parts[1] in FOLDERS:
            return LAYER[parts[1]]
        return LAYER["face"]
    if parts[0] == "models":
        return LAYER["models"]
    if parts[0] in ("examples", "_cli", "chardata"):
        return LAYER["examples"]
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


def test_every_folder_is_a_layer():
    """A new folder of microtensor/ must be placed in LAYERS (else it would count as the face)."""
    folders = {d for d in os.listdir(os.path.join(ROOT, "microtensor"))
               if os.path.isdir(os.path.join(ROOT, "microtensor", d)) and not d.startswith(("_", "."))}
    assert folders == FOLDERS, f"folders not in LAYERS: {folders - FOLDERS}; gone: {FOLDERS - folders}"
    assert set(LAYER_NAMES) == FOLDERS | {"face", "models", "examples"}


def test_no_arrow_points_up(all_arrows):
    upward = [(s, t, where) for s, t, _, where in all_arrows if layer(t) > layer(s)]
    message = "\n".join(f"{where}: {s} ({LAYER_NAMES[layer(s)]}) imports {t} "
                        f"({LAYER_NAMES[layer(t)]})" for s, t, where in upward)
    assert not upward, "imports pointing up a layer:\n" + message


def test_an_upward_import_fails(tmp_path, monkeypatch):
    """The test can fail: a planted function-level import from the core up to ops."""
    core = tmp_path / "microtensor" / "core"
    core.mkdir(parents=True)
    (core / "planted.py").write_text("def f():\n    from microtensor.ops import extra\n")
    names = [n for n, _ in imports_of(str(core / "planted.py"))]
    assert names == ["microtensor.ops.extra"]
    assert layer("microtensor.ops.extra") > layer("microtensor.core.planted")


def test_optim_imports_no_nn(all_arrows):
    bad = [(s, t, where) for s, t, _, where in all_arrows
           if s.startswith("microtensor.optim") and layer(t) >= LAYER["nn"]
           and not t.startswith("microtensor.optim")]
    assert not bad, bad


def test_models_and_examples_use_public_names_only(all_arrows):
    private = [(s, name, where) for s, t, name, where in all_arrows
               if layer(s) >= LAYER["models"] and t.split(".")[0] == "microtensor"
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
    assert layer("microtensor") == LAYER["face"] and layer("microtensor.optim.sgd") == LAYER["optim"]
    assert layer("microtensor.threads") == LAYER["face"] and layer("models.gpt") == LAYER["models"]


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


def test_the_map_in_architecture_md_is_the_codes():
    """docs/ARCHITECTURE.md's picture of the layers, their table and the docs index are
    what docs/regenerate.py makes from LAYERS, the imports and docs/ now."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_regenerate", os.path.join(ROOT, "docs", "regenerate.py"))
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)
    part = regenerate.LayerMap()
    blocks = part.render(part.measure(None, False), {})
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert set(blocks) == {"layer_map", "layer_table", "docs_index", "readme_docs_index"}
    for name, body in blocks.items():
        doc, where = (("README.md", readme) if name == "readme_docs_index"
                      else ("docs/ARCHITECTURE.md", text))
        assert f"<!-- generated:{name} -->\n{body}\n<!-- /generated -->" in where, (
            f"{doc}'s {name} is stale: run python docs/regenerate.py --only layers")
    # the README shows the house too: the same picture and table
    for name in ("layer_map", "layer_table"):
        assert f"<!-- generated:{name} -->\n{blocks[name]}\n<!-- /generated -->" in readme, name
    # and its index's links resolve from the repository's root
    for line in blocks["readme_docs_index"].splitlines():
        target = line.split("](", 1)[1].split(")", 1)[0]
        assert os.path.exists(os.path.join(ROOT, target)), target
    for name, _ in LAYERS:                       # one line per layer in the picture
        assert sum(f" {name} " in line for line in blocks["layer_map"].splitlines()) == 1, name
