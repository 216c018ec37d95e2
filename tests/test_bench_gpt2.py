"""The GPT-2 benchmarks run end to end at a small size (nothing timed is asserted):
bench_generate.py's two engines produce the same tokens from the same weights, and
bench_gpt2_step.py prints its table, writes llm.c's inputs in llm.c's formats, and reads
llm.c's step times from its output."""
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import bench_gpt2_step  # noqa: E402


def run_script(name, *args):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, name), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_generate_small_same_tokens_as_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = run_script("bench_generate.py", "--small", "--rounds", "1", "--threads", "1,2",
                     "--new-tokens", "24", "--allow-busy")
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2, out
    assert all(row.rstrip(" |").endswith("yes") for row in rows), out


def test_bench_generate_copies_the_conv1d_weights_transposed():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import bench_generate
    hf, model = bench_generate.build_models(bench_generate.SMALL, seed=3)
    ids = np.random.default_rng(0).integers(0, bench_generate.SMALL["vocab_size"], (2, 9))
    import microtensor as mt
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    got, _ = model(mt.from_numpy(ids))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_bench_gpt2_step_small_runs_without_llmc():
    pytest.importorskip("torch")
    out = run_script("bench_gpt2_step.py", "--small", "--threads", "1", "--steps", "1",
                     "--warmup", "0", "--repeats", "1", "--allow-busy")
    assert "llm.c: not run: no --llmc folder given" in out
    assert "| 1       | microtensor |" in out and "|       torch |" in out
    assert "step / products" in out


def test_llmc_inputs_are_in_llmcs_formats(tmp_path):
    shape = bench_gpt2_step.SMALL
    bench_gpt2_step.write_llmc_inputs(str(tmp_path), shape, seed=0)
    blob = np.fromfile(tmp_path / "gpt2_124M.bin", dtype=np.int32)
    V, maxT, L, C = shape["vocab_size"], shape["block_size"], shape["n_layer"], shape["n_embd"]
    Vp = (V + 127) // 128 * 128
    assert blob[:8].tolist() == [20240326, 3, maxT, V, L, shape["n_head"], C, Vp]
    # train_gpt2.c's fill_in_parameter_sizes, summed
    n_params = Vp * C + maxT * C + L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C
                                        + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C
    assert blob.size == 256 + n_params
    tokens = tmp_path / "dev" / "data" / "tinyshakespeare" / "tiny_shakespeare_train.bin"
    header = np.fromfile(tokens, dtype=np.int32, count=256)
    assert header[:2].tolist() == [20240520, 1]
    ids = np.fromfile(tokens, dtype=np.uint16, offset=1024)
    assert ids.size == header[2] and ids.max() < V


def test_llmc_step_times_are_read_from_its_output(tmp_path):
    """A stand-in for train_gpt2 prints llm.c's lines; the times after the warmup steps
    are read, and the program is stopped once enough are in."""
    fake = tmp_path / "train_gpt2"
    fake.write_text("#!/bin/sh\necho 'val loss 10.9'\n"
                    "for i in 0 1 2 3 4 5 6 7 8 9; do\n"
                    "  echo \"step $i: train loss 10.5 (took 1$i.5 ms)\"\ndone\nsleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    peak, times = bench_gpt2_step.run_llmc(str(fake), str(tmp_path), 1, warmup=2, steps=3)
    assert times == pytest.approx([0.0125, 0.0135, 0.0145])
    assert peak > 0
