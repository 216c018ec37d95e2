"""The benchmark scripts run end to end (tiny settings, nothing timed is asserted), and
the training step they time is the right computation: the same seed gives the same
loss curve, float32 follows float64, and PyTorch with the same weights and batches
gives the same curve."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import bench_train  # noqa: E402


def run_script(name, *args):
    """Run benchmarks/<name> with args; return its stdout (fails on a non-zero exit)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, name), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def last_json(stdout):
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def pydoc_text():
    from pydoc_data.topics import topics
    return "".join(topics.values())


# ---- the scripts run and print their tables ---------------------------------------------

def test_bench_ops_core_runs():
    out = run_script("bench_ops.py", "--only", "core", "--repeats", "1", "--min-time", "0",
                     "--threads", "1", "--json")
    assert "| a @ b" in out and "mt fwd+bwd" in out
    rec = last_json(out)
    names = {(r["op"], r["size"].split()[0]) for r in rec["results"]}
    assert names == {(op, size) for op in ("a + b", "a * b", "a.exp()", "a @ b", "a.sum()")
                     for size in ("small", "large")}
    for r in rec["results"]:
        assert r["seconds"]["microtensor/fwd"] > 0 and r["seconds"]["numpy/fwd"] > 0
        assert r["seconds"]["microtensor/fwd+bwd"] > 0


def test_bench_linear_prints_every_linear_and_its_ratio():
    out = run_script("bench_linear.py", "--config", "tiny", "--repeats", "1", "--min-time", "0",
                     "--allow-busy", "--threads", "1,2")
    for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head", "step total"):
        assert out.count(f"| {layer}") == 2, layer          # one row per thread count
    assert "mt / gemms" in out


def test_bench_rows_prints_every_call_at_each_thread_count():
    out = run_script("bench_rows.py", "--config", "tiny", "--repeats", "1", "--min-time", "0",
                     "--allow-busy", "--threads", "1,2")
    for call in ("attention forward (B 16, T 32, hs 16)", "attention forward + backward",
                 "layer norm forward kernel (512 x 64)", "cross-entropy forward kernel (512 x 65)",
                 "transpose recording its gradient"):
        assert out.count(f"| {call}") == 2, call            # one row per thread count
    assert "tiny, 1 thread" in out and "tiny, 2 threads" in out


def test_bench_blas_runs_every_candidate():
    out = run_script("bench_blas.py", "--configs", "tiny", "--repeats", "1", "--min-time", "0",
                     "--allow-busy", "--no-torch", "--json")
    rec = last_json(out)
    ms = rec["configs"]["tiny"]["ms_per_step"]
    assert any(k.startswith("mt/OpenBLAS") for k in ms) and "numpy" in ms, ms
    from microtensor.runtime import _blas_choice
    assert any(k.startswith("mt/oneMKL") for k in ms) == (_blas_choice.find_mkl() is not None)
    assert all(v > 0 for v in ms.values())


def test_bench_kernels_times_every_build_here():
    out = run_script("bench_kernels.py", "--repeats", "1", "--min-time", "0", "--allow-busy",
                     "--json")
    rec = last_json(out)
    from conftest import kernel_builds_here
    names = {b[0] for b in kernel_builds_here()}
    assert len(rec["ops"]) == 6
    for op, med in rec["ops"].items():
        assert set(med) == names and all(v > 0 for v in med.values()), op


def test_bench_malloc_runs_both_settings():
    from microtensor.runtime import _malloc
    if _malloc._glibc() is None:
        pytest.skip("glibc's mallopt: Linux with glibc only")
    out = run_script("bench_malloc.py", "--config", "tiny", "--steps", "2", "--rounds", "1",
                     "--allow-busy", "--json")
    rec = last_json(out)["configs"]["tiny"]
    assert set(rec) == {"glibc default", "microtensor"}
    assert all(v["ms_per_step"] > 0 for v in rec.values())


def test_bench_ops_fused_runs_and_agrees_with_torch():
    out = run_script("bench_ops.py", "--only", "fused", "--models", "char", "--repeats", "1",
                     "--min-time", "0", "--threads", "1", "--json")
    rec = last_json(out)
    assert {r["op"] for r in rec["results"]} == {
        "softmax(-1)", "layer_norm", "cross_entropy", "gelu", "causal attention"}
    for r in rec["results"]:
        assert r["seconds"]["microtensor/fwd+bwd"] > 0, r
        if r["max_rel_diff_vs_torch"] is not None:  # torch installed
            assert r["max_rel_diff_vs_torch"] < 1e-4, r


def test_bench_matmul_runs():
    out = run_script("bench_matmul.py", "--configs", "tiny", "--square", "64", "--repeats", "1",
                     "--min-time", "0", "--threads", "1", "--json")
    assert "all products of one step" in out
    rec = last_json(out)
    tiny = rec["configs"]["tiny"]
    # the listed products add up to the closed-form FLOP count of bench_train's docstring
    cfg = bench_train.C.CONFIGS["tiny"]
    B, T, C, L, V = (cfg["batch_size"], cfg["block_size"], cfg["n_embd"], cfg["n_layer"],
                     rec["vocab_size"])
    M = B * T
    assert tiny["step_gflop"] * 1e9 == pytest.approx(
        3 * (L * (24 * M * C * C + 4 * B * T * T * C) + 2 * M * C * V))
    assert tiny["ceiling"]["numpy"]["gflops"] > 0


def test_bench_train_runs():
    out = run_script("bench_train.py", "--allow-busy", "--config", "tiny", "--steps", "2", "--warmup", "0",
                     "--rounds", "1", "--threads", "1", "--engines", "mt,torch", "--json")
    assert "ms/step (median)" in out
    rec = last_json(out)
    (res,) = rec["results"]
    mt_res = res["engines"]["microtensor"]
    assert mt_res["ms_median"] > 0 and mt_res["tokens_per_s"] > 0
    assert np.isfinite(mt_res["last_loss"])
    if "torch" in res["engines"]:
        # same weights, same batches: the first loss is the same number
        assert mt_res["first_losses"][0] == pytest.approx(
            res["engines"]["torch"]["first_losses"][0], rel=1e-5)


def test_bench_train_compiled_engine():
    # mt.compile of the whole step: its row, and the same losses as eager mode, bitwise
    # (torch.compile left out: its compilation takes tens of seconds)
    out = run_script("bench_train.py", "--allow-busy", "--config", "tiny", "--steps", "2", "--warmup", "0",
                     "--rounds", "1", "--threads", "1", "--engines", "mt,mt-compiled,torch",
                     "--json")
    assert "microtensor-compiled" in out
    assert "mt compiled == eager: True" in out
    rec = last_json(out)
    (res,) = rec["results"]
    assert res["warmup"] >= bench_train.MIN_COMPILED_WARMUP   # record, record, replay
    assert res["mt_compiled_equals_eager"] is True
    assert res["mt_compiled_calls"]["eager"] == 0 and res["mt_compiled_calls"]["replayed"] >= 3
    c = res["engines"]["microtensor-compiled"]
    assert c["ms_median"] > 0
    assert c["first_losses"] == res["engines"]["microtensor"]["first_losses"]
    if "torch" in res["engines"]:
        assert "ratio_mt_compiled_over_torch" in res and "ratio_mt_over_torch" in res
    assert "torch-compiled" not in res["engines"] and "torch_compile" not in res


def test_bench_train_header_names_cpu_build_blas_and_load(monkeypatch, capsys):
    import microtensor as mt
    monkeypatch.setattr(os, "getloadavg", lambda: (0.05, 0.1, 0.2))   # a quiet machine
    rec = bench_train.main(["--config", "tiny", "--steps", "1", "--warmup", "0", "--rounds", "1",
                            "--threads", "1", "--no-torch", "--engines", "mt"])
    out = capsys.readouterr().out
    c = mt.config()
    assert c["cpu"] in out and "kernel build" in out and "fused kernels" in out
    assert f"{c['build']['fused_kernels']};" in out
    for lib in c["blas"]:
        assert f"{lib['corename']} kernel" in out
    assert "# load average after: (0.05, 0.1, 0.2)" in out
    assert rec["load_before"] == 0.05 and rec["load_after"] == (0.05, 0.1, 0.2)
    assert rec["dry_run"] is False and "DRY RUN" not in out
    assert rec["machine"]["kernel_build"]["fused_kernels"] == c["build"]["fused_kernels"]


@pytest.mark.parametrize("load", [0.31, 4.0])
def test_bench_train_on_a_busy_machine_warns_and_times_a_dry_run(monkeypatch, capsys, load):
    """As the README prints it, the benchmark runs on a busy machine: a warning, and its
    table marked DRY RUN (not for the docs); --strict-quiet (what the docs' sweep passes)
    refuses to time; --allow-busy runs without the warning."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 1.0, 1.0))
    argv = ["--config", "tiny", "--steps", "1", "--warmup", "0", "--rounds", "1",
            "--threads", "1", "--no-torch", "--engines", "mt"]
    rec = bench_train.main(argv)
    captured = capsys.readouterr()
    assert rec["dry_run"] is True and rec["results"]
    assert f"warning: the 1-minute load average is {load:.2f}, above 0.3" in captured.err
    assert "--strict-quiet" in captured.err
    table = captured.out[captured.out.index("## training step"):]
    assert "DRY RUN" in table.splitlines()[0]                  # the table's own heading
    assert "DRY RUN" in table.split("microtensor", 1)[1]       # and again below it
    with pytest.raises(SystemExit) as e:
        bench_train.main(argv + ["--strict-quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"load average is {load:.2f}, above 0.3" in err and "--allow-busy" in err
    rec = bench_train.main(argv + ["--allow-busy"])
    captured = capsys.readouterr()
    assert rec["dry_run"] is True and "DRY RUN" in captured.out and "warning" not in captured.err
    # at the bound itself the machine counts as quiet, strict or not
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 1.0, 1.0))
    rec = bench_train.main(argv + ["--strict-quiet"])
    assert rec["dry_run"] is False and "DRY RUN" not in capsys.readouterr().out


def test_the_docs_sweep_passes_strict_quiet():
    """The script that takes the docs' thread sweep keeps the refusal."""
    script = open(os.path.join(BENCH, "run_16core.sh")).read()
    line = next(l for l in script.splitlines() if l.startswith("BENCH=("))
    assert "bench_train.py --strict-quiet" in line


def test_bench_train_engines_argument():
    assert bench_train.parse_engines("mt,mt-compiled,torch,torch-compiled") == [
        "microtensor", "microtensor-compiled", "torch", "torch-compiled"]
    assert bench_train.parse_engines("torch-compiled,mt") == ["microtensor", "torch-compiled"]
    assert bench_train.parse_engines("mt,mt-compiled,torch,torch-compiled", no_torch=True) == [
        "microtensor", "microtensor-compiled"]
    for bad in ("jax", "torch", ""):
        with pytest.raises(ValueError):
            bench_train.parse_engines(bad, no_torch=(bad == "torch"))


@pytest.fixture
def restore_threads():
    """Put back the thread counts a benchmark run in this process changes."""
    import microtensor as mt
    from microtensor.threads import get_blas_threads, set_blas_threads
    torch = bench_train.C.try_import_torch()
    before = (mt.get_num_threads(), get_blas_threads(),
              torch.get_num_threads() if torch is not None else None)
    yield
    mt.set_num_threads(before[0])
    if before[1] is not None:
        set_blas_threads(before[1])
    if torch is not None:
        torch.set_num_threads(before[2])


def test_bench_train_thread_sweep(tmp_path, capsys, restore_threads):
    # in this process (no second import of torch): a sweep over 1 and 2 threads, and a
    # count above the CPUs, which is skipped
    plot, record = tmp_path / "scaling.png", tmp_path / "sweep.jsonl"
    too_many = len(os.sched_getaffinity(0)) + 1
    bench_train.main(["--config", "tiny", "--engines", "mt,torch", "--allow-busy",
                      "--threads", f"1,2,{too_many}", "--steps", "1",
                      "--warmup", "0", "--rounds", "1", "--ceiling-repeats", "1",
                      "--ceiling-min-time", "0", "--json", str(record), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "thread sweep" in out and "mt/torch" in out
    rec = json.loads(record.read_text().splitlines()[-1])
    sweep = rec["sweep"]
    kept = [n for n in (1, 2) if n <= len(os.sched_getaffinity(0))]
    assert sweep["threads"] == kept and sweep["skipped_threads"] == [too_many]
    assert f"skipped threads {too_many}" in out
    (res,) = sweep["results"]
    assert res["config"] == "tiny" and [t["threads"] for t in res["by_threads"]] == kept
    for t in res["by_threads"]:
        mt_res = t["engines"]["microtensor"]
        assert mt_res["ms_median"] > 0 and mt_res["gflops"] > 0 and mt_res["n"] == 1
        assert t["matmul_ceiling"]["numpy"]["gflops"] > 0
        if "torch" in t["engines"]:
            assert t["ratio_mt_over_torch"] == pytest.approx(
                mt_res["ms_median"] / t["engines"]["torch"]["ms_median"])
    if "torch" in res["first_losses"]:
        assert res["first_losses"]["microtensor"][0] == pytest.approx(
            res["first_losses"]["torch"][0], rel=1e-5)
    assert sweep["plot"] == str(plot) and plot.stat().st_size > 1000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the table and the picture again, from the JSON alone
    again = tmp_path / "again.png"
    bench_train.main(["--plot-from", str(record), "--plot", str(again)])
    assert "| tiny" in capsys.readouterr().out and again.stat().st_size > 1000


def test_bench_train_threads_argument():
    assert bench_train.parse_threads("1,2,4,2") == [1, 2, 4]
    assert bench_train.parse_threads("3") == [3]
    for bad in ("0", "1,x", "", "-2"):
        with pytest.raises(ValueError):
            bench_train.parse_threads(bad)
    assert bench_train.usable_thread_counts([1, 2, 4, 8, 16], cpus=4) == ([1, 2, 4], [8, 16])
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_train.py"), "--threads",
                           "1,2", "--profile"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "one thread count" in proc.stderr


def test_bench_train_profile_runs():
    out = run_script("bench_train.py", "--allow-busy", "--config", "tiny", "--profile", "--profile-steps", "1",
                     "--threads", "1", "--no-torch", "--json")
    rec = last_json(out)
    (prof,) = rec["profile"]
    ops = {(o["region"], o["op"]) for o in prof["ops"]}
    # forward ops and backward nodes of the model both show up
    assert ("forward", "F.linear") in ops and ("backward", "LinearBackward") in ops
    assert ("forward", "F.layer_norm") in ops and ("backward", "LayerNormBackward") in ops
    assert set(prof["regions"]) >= {"forward", "backward", "optimizer"}
    fwd = prof["regions"]["forward"]
    assert 0 < fwd["ops_ms"] <= fwd["wall_ms"]


def test_bench_train_memory_runs():
    out = run_script("bench_train.py", "--allow-busy", "--config", "tiny", "--memory", "--steps", "1",
                     "--threads", "1", "--engines", "mt,mt-compiled,torch", "--json")
    rec = last_json(out)
    for e in ("microtensor", "microtensor-compiled"):
        m = rec["memory"]["tiny"][e]
        assert m["peak_rss"] >= m["rss_before_model"] > 10 * 2**20


# ---- the profiler ---------------------------------------------------------------------------

def test_profiler_counts_ops_and_restores():
    import microtensor as mt
    from microtensor.core import _core
    from microtensor.profiler import Profiler
    original_add = _core.add
    a = mt.randn(4, 3, requires_grad=True)
    b = mt.randn(3, 2, requires_grad=True)
    with Profiler() as prof:
        with prof.region("forward"):
            y = ((a @ b).exp() + 1.0).sum()
        with prof.region("backward"):
            y.backward()
    ops, regions = prof.summary()
    calls = {(r, op): c for r, op, c, _ in ops}
    assert calls[("forward", "matmul")] == 1 and calls[("forward", "exp")] == 1
    assert calls[("forward", "add")] == 1 and calls[("forward", "sum")] == 1
    assert calls[("backward", "MatmulBackward")] == 1
    assert regions["forward"]["ops_ms"] <= regions["forward"]["wall_ms"]
    # everything is put back
    assert _core.add is original_add and mt.add is original_add
    x = mt.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0])


def test_threads_helper_sets_blas_threads():
    from microtensor.threads import blas_info, get_blas_threads, set_blas_threads
    libs = blas_info()
    if not libs:
        pytest.skip("numpy does not use OpenBLAS here")
    before = get_blas_threads()
    try:
        assert set_blas_threads(1) >= 1
        assert get_blas_threads() == 1
        assert libs[0]["corename"]
    finally:
        set_blas_threads(before)
    with pytest.raises(ValueError):
        set_blas_threads(0)


def _fake_topology(root, cores):
    """cpu<i>/topology/{physical_package_id,core_id} under root, one entry per CPU."""
    for cpu, (package, core) in enumerate(cores):
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_physical_cores_counts_smt_siblings_once(tmp_path, monkeypatch):
    from microtensor import threads
    # two packages, two cores each, two hardware threads per core; core ids repeat
    # across packages, so (package, core) is what identifies a core
    _fake_topology(tmp_path, [(p, c) for p in (0, 1) for c in (0, 1) for _ in (0, 1)])
    monkeypatch.setattr(threads, "_SYS_CPU", str(tmp_path))
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: list(range(8)))
    assert threads.physical_cores() == 4
    # an affinity mask of both siblings of one core, and one thread of another core
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: [0, 1, 2])
    assert threads.physical_cores() == 2
    # no topology: every allowed CPU counts (psutil, when installed, may only lower it)
    monkeypatch.setattr(threads, "_SYS_CPU", str(tmp_path / "missing"))
    assert 1 <= threads.physical_cores() <= 3


def test_default_num_threads_policy(tmp_path, monkeypatch):
    from microtensor import threads
    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: list(range(8)))
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "_CGROUP_QUOTA", ((str(quota), None),))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.default_num_threads() == 8          # no quota file
    quota.write_text("max 100000\n")
    assert threads.default_num_threads() == 8          # no quota
    quota.write_text("250000 100000\n")
    assert threads.default_num_threads() == 3          # 2.5 CPUs of quota
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.default_num_threads() == 5          # the environment wins
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert threads.default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "300")       # above the CPUs: lowered, warned
    with pytest.warns(RuntimeWarning, match="OMP_NUM_THREADS=300 is more than the 8 CPUs"):
        assert threads.default_num_threads() == 8


def test_set_threads_defaults_to_physical_cores():
    import microtensor as mt
    from microtensor.threads import default_num_threads, physical_cores, set_threads
    before = mt.get_num_threads()
    try:
        assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
        assert set_threads() == default_num_threads() == mt.get_num_threads()
        assert set_threads(1) == 1 and mt.get_num_threads() == 1
    finally:
        set_threads(before)


# ---- the timed step computes the right thing -------------------------------------------------

TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=4)


def test_same_seed_same_loss_curve():
    text = pydoc_text()
    a = bench_train.loss_curve(TINY, 5, seed=3, text=text)
    b = bench_train.loss_curve(TINY, 5, seed=3, text=text)
    assert a == b
    c = bench_train.loss_curve(TINY, 5, seed=4, text=text)
    assert a != c
    assert a[-1] < a[0]  # it learns


def test_float32_curve_follows_float64():
    text = pydoc_text()
    f32 = np.array(bench_train.loss_curve(TINY, 5, seed=1, text=text))
    f64 = np.array(bench_train.loss_curve(TINY, 5, seed=1, text=text, dtype="float64"))
    np.testing.assert_allclose(f32, f64, rtol=2e-5)


def test_loss_curve_equals_torch():
    torch = pytest.importorskip("torch")
    text = pydoc_text()
    for dtype, rtol in (("float64", 1e-10), ("float32", 2e-5)):
        mine = bench_train.loss_curve(TINY, 5, seed=2, text=text, dtype=dtype)
        theirs = bench_train.loss_curve(TINY, 5, seed=2, text=text, dtype=dtype,
                                        engine="torch", torch=torch)
        np.testing.assert_allclose(mine, theirs, rtol=rtol, err_msg=dtype)
