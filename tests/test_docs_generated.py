"""The numbers and pictures the docs quote come from docs/regenerate.py: its cheap parts
are recomputed here and compared with the record (docs/generated.json), and every marked
block of the docs must say what the record says. A doc edited by hand, or code whose
numbers moved, fails until `python docs/regenerate.py` is run."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "docs", "regenerate.py")


@pytest.fixture(scope="module")
def regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_check_passes():
    result = subprocess.run([sys.executable, SCRIPT, "--check", "--quick"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the docs match the code" in result.stdout


def test_every_block_has_a_record_and_every_part_a_block(regenerate):
    record = regenerate.load_record()
    blocks = regenerate.rendered_blocks(record)
    found = set()
    for doc in regenerate.DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            found.update(name for name, _ in regenerate.BLOCK.findall(f.read()))
    assert found == set(blocks), (found ^ set(blocks))
    for part in regenerate.PARTS:
        if part.keeps_record:
            assert part.name in record, part.name


def test_a_hand_edited_number_is_caught(regenerate, tmp_path, monkeypatch):
    record = regenerate.load_record()
    assert regenerate.check_docs(record) == []
    # the record moves (as after a rerun whose numbers changed): the docs no longer match
    changed = json.loads(json.dumps(record))
    changed["seq2seq"]["test_acc"] = 0.5
    problems = regenerate.check_docs(changed)
    assert any("MODELS.md" in p and "models_seq2seq" in p for p in problems), problems
    assert any("README.md" in p for p in problems), problems
    # a constant of an example that disagrees with the record
    changed = json.loads(json.dumps(record))
    changed["train_char"]["wall_seconds"] += 100
    problems = regenerate.check_docs(changed)
    assert any("DEFAULT_RUN_SECONDS" in p for p in problems), problems


def test_differences_compare_numbers_with_a_tolerance(regenerate):
    d = regenerate.differences
    assert d({"a": 1.0, "b": [2, 3]}, {"a": 1.0005, "b": [2, 3]}, 1e-3) == []
    assert d({"a": 1.0}, {"a": 1.01}, 1e-3) == ["/a: 1.0 now, 1.01 in the record"]
    assert d({"n": 14}, {"n": 15}, 1e-3) != []
    assert d("loss 0.2501 at 3", "loss 0.2502 at 3", 1e-3) == []
    assert d("loss 0.2501 at 3", "lost 0.2501 at 3", 1e-3) == [": the text differs"]
    assert d({"x": None}, {"x": 3}, 1e-3) != []
    # numbers at float32's floor are compared loosely, the rest as tightly as before
    noisy = {"ratio_no_residual": 4.2e-10, "ratio_residual": 1.45}
    assert d(noisy, {"ratio_no_residual": 5.0e-10, "ratio_residual": 1.45}, 1e-3,
             loose=("no_residual",)) == []
    assert d(noisy, {"ratio_no_residual": 4.2e-10, "ratio_residual": 1.5}, 1e-3,
             loose=("no_residual",)) != []
    assert d(noisy, {"ratio_no_residual": 4.2e-9, "ratio_residual": 1.45}, 1e-3,
             loose=("no_residual",)) != []
