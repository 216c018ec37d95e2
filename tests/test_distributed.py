"""mt.distributed and DistributedDataParallel, run for real under `mpiexec -n 2`.

Each multi-rank check launches tests/mpi_ddp_worker.py with mpiexec and compares what
the ranks wrote with a single process computed here: the averaged gradients of two
ranks must equal the gradient of the concatenated batch, and two ranks with batch B
must follow the loss curve of one process with batch 2B. Skipped when mpi4py or
mpiexec is missing (pip install "microtensor[mpi]").
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import microtensor as mt

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mpi_ddp_worker.py")
sys.path.insert(0, HERE)
import mpi_ddp_worker as W  # noqa: E402  (the model and batches both sides use)

WORLD = 2


def find_mpiexec():
    """mpiexec beside this Python first (the mpich wheel puts it in the venv's bin),
    then on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(
    not (HAVE_MPI4PY and MPIEXEC),
    reason="needs mpi4py and mpiexec: pip install 'microtensor[mpi]' "
           f"(mpi4py {'found' if HAVE_MPI4PY else 'missing'}, "
           f"mpiexec {'found' if MPIEXEC else 'missing'})")


def child_env(timeout):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MICROTENSOR_DIST_TIMEOUT=str(timeout))
    # a test run inside an MPI job must not hand its launcher's variables to the child
    for var in ("PMI_SIZE", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    return env


def launch(scenario, out_dir, timeout, limit=120, extra=()):
    cmd = [MPIEXEC, "-n", str(WORLD), sys.executable, WORKER, scenario, str(out_dir), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(timeout),
                          timeout=limit, cwd=os.path.dirname(HERE))
    return proc, time.perf_counter() - start


def run_correctness(out, extra=()):
    """One launch of the correctness scenario; returns [(report, arrays)] per rank."""
    proc, _ = launch("correctness", out, timeout=60, extra=extra)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout}\n{proc.stderr}"
    result = []
    for r in range(WORLD):
        with open(out / f"rank{r}.json") as f:
            report = json.load(f)
        result.append((report, dict(np.load(out / f"rank{r}.npz"))))
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_correctness(tmp_path_factory.mktemp("ddp"))


def single_process_grads(batches):
    """The gradient one process gets on the full batches (accumulated over them)."""
    model = W.small_gpt(W.SEED)
    for x, y in batches:
        _, loss = model(mt.from_numpy(x), mt.from_numpy(y))
        loss.backward()
    return W.grads(model)


def assert_float32_close(actual, expected, what):
    """Equal up to float32 rounding: the two sides add the same terms in another order."""
    scale = max(np.abs(v).max() for v in expected.values())
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4,
                                   atol=1e-5 * scale, err_msg=f"{what}: {name}")


def section(arrays, prefix):
    return {k[len(prefix) + 1:]: v for k, v in arrays.items() if k.startswith(prefix + "/")}


# ---- primitives ---------------------------------------------------------------------

@needs_mpi
def test_collectives(ranks):
    for rank, (report, _) in enumerate(ranks):
        assert report["rank"] == rank and report["world"] == WORLD
        assert report["mpi4py_loaded"]
        assert report["all_reduce_returns_same"]
        assert report["all_reduce_sum"] == [[3.0] * 3] * 2          # 1 + 2
        assert report["all_reduce_mean"] == [1.5] * 4
        assert report["all_reduce_int"] == [[0, 3, 6], [9, 12, 15]]  # int64 stays exact
        # a transposed view is reduced and written back into its base
        assert report["all_reduce_view_base"] == (np.arange(6).reshape(2, 3) * 3).tolist()
        assert report["broadcast_src1"] == [10.0] * 3                # rank 1's values
        assert "op='max' is not supported" in report["bad_op"]
        assert report["gathered"] == [0, 1, 0, 100]


# ---- DistributedDataParallel --------------------------------------------------------

@needs_mpi
def test_broadcast_makes_initial_params_equal(ranks):
    own0, own1 = section(ranks[0][1], "own_init"), section(ranks[1][1], "own_init")
    # the ranks really started apart (seeds differ), so the broadcast had work to do
    assert any(not np.array_equal(own0[n], own1[n]) for n in own0)
    reference = W.params(W.small_gpt(W.SEED))                      # rank 0's seed
    for r in range(WORLD):
        init = section(ranks[r][1], "init")
        for n in reference:
            np.testing.assert_array_equal(init[n], reference[n], err_msg=n)


@needs_mpi
def test_gradients_equal_single_process_on_concatenated_batch(ranks):
    x, y = W.global_batch(0, WORLD)
    expected = single_process_grads([(x, y)])
    for r in range(WORLD):
        assert_float32_close(section(ranks[r][1], "grad"), expected, f"rank {r}")
    # the comparison can fail: one rank's own half-batch gradient is far from it
    half = single_process_grads([(W.rows(x, 0), W.rows(y, 0))])
    with pytest.raises(AssertionError):
        assert_float32_close(half, expected, "half batch")


@needs_mpi
def test_buckets_start_during_backward(ranks):
    report = ranks[0][0]
    assert report["buckets"] > 3
    if hasattr(mt.Tensor, "register_post_accumulate_grad_hook"):
        assert report["hook_mode"] == "post_accumulate"
        # buckets were on the wire before backward delivered its last gradient, and
        # before it even reached the token embeddings' node
        assert report["started_early"] >= 1
        assert report["buckets_before_last_node"] >= 1
    else:
        assert report["hook_mode"] == "leaf_hook"


@needs_mpi
def test_no_sync_accumulates_then_averages(ranks):
    xa, ya = W.global_batch(1, WORLD)
    xb, yb = W.global_batch(2, WORLD)
    # inside no_sync each rank keeps the gradient of its own rows
    for r in range(WORLD):
        local = section(ranks[r][1], "local")
        own = single_process_grads([(W.rows(xa, r), W.rows(ya, r))])
        assert_float32_close(local, own, f"rank {r} inside no_sync")
    # the synchronised backward averages the sum of both micro-batches
    expected = single_process_grads([(xa, ya), (xb, yb)])
    for r in range(WORLD):
        assert_float32_close(section(ranks[r][1], "accum"), expected, f"rank {r} after no_sync")


@needs_mpi
def test_two_ranks_follow_the_loss_curve_of_twice_the_batch(ranks):
    model = W.small_gpt(W.SEED)
    optimizer = W.make_optimizer(model)
    curve = []
    for step in range(W.STEPS):
        x, y = W.global_batch(100 + step, WORLD)
        curve.append(W.train_step(model, optimizer, x, y).item())
    assert curve[-1] != curve[0]                                   # it trained
    for r in range(WORLD):
        np.testing.assert_allclose(ranks[r][0]["curve"], curve, rtol=2e-5)
        final = section(ranks[r][1], "final")
        for n, p in W.params(model).items():
            np.testing.assert_allclose(final[n], p, rtol=1e-4, atol=1e-5, err_msg=n)
    # the replicas stay identical, bit for bit
    f0, f1 = section(ranks[0][1], "final"), section(ranks[1][1], "final")
    for n in f0:
        np.testing.assert_array_equal(f0[n], f1[n], err_msg=n)


@needs_mpi
def test_stand_in_leaf_hooks_give_the_same_results(tmp_path):
    """DDP on a core without post-accumulate hooks: gradient hooks on the leaves stand
    in for them, with the same results."""
    ranks = run_correctness(tmp_path, extra=["--leaf-hooks"])
    assert ranks[0][0]["hook_mode"] == "leaf_hook"
    test_gradients_equal_single_process_on_concatenated_batch(ranks)
    test_no_sync_accumulates_then_averages(ranks)
    test_two_ranks_follow_the_loss_curve_of_twice_the_batch(ranks)


@needs_mpi
def test_unused_parameter_is_named(ranks):
    for report, _ in ranks:
        assert "gave no gradient to 1 parameter(s) (unused)" in report["unused"]


# ---- failures end the job -----------------------------------------------------------

@needs_mpi
def test_stuck_rank_times_out_with_a_clear_error(tmp_path):
    proc, seconds = launch("stuck", tmp_path, timeout=2, limit=60)
    assert proc.returncode != 0
    assert "rank 0 was not stopped" not in proc.stdout
    assert "DistributedError" in proc.stderr and "timed out" in proc.stderr, proc.stderr
    assert "MICROTENSOR_DIST_TIMEOUT" in proc.stderr
    assert seconds < 30, f"the job took {seconds:.1f} s to end"


@needs_mpi
def test_dead_rank_ends_the_job(tmp_path):
    proc, seconds = launch("die", tmp_path, timeout=5, limit=60)
    assert proc.returncode != 0
    assert "trained on alone" not in proc.stdout
    assert seconds < 30, f"the job took {seconds:.1f} s to end"


@needs_mpi
def test_exception_on_one_rank_ends_the_job_at_once(tmp_path):
    proc, seconds = launch("raises", tmp_path, timeout=60, limit=60)
    assert proc.returncode != 0
    assert "rank 0 was not stopped" not in proc.stdout
    assert "ValueError: rank 1 gives up" in proc.stderr
    assert seconds < 30, f"the job took {seconds:.1f} s to end (the timeout is 60 s)"


# ---- one process, no MPI ---------------------------------------------------------------

SINGLE = r"""
import sys
import microtensor as mt
assert "mpi4py" not in sys.modules, "import microtensor imported mpi4py"
import microtensor.distributed as dist
from models import GPT, GPTConfig
assert dist.init() == (0, 1) and dist.is_initialized()
assert dist.get_rank() == 0 and dist.get_world_size() == 1
t = mt.ones(3)
assert dist.all_reduce(t, op="mean") is t and t.numpy().tolist() == [1.0] * 3
dist.broadcast(t, src=0); dist.barrier()
out = [None]; dist.all_gather_object(out, "x"); assert out == ["x"]
mt.manual_seed(0)
model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=8))
ddp = mt.nn.parallel.DistributedDataParallel(model)
assert ddp.module is model and ddp.hook_mode is None
idx = mt.randint(0, 5, (2, 4))
with ddp.no_sync():
    _, loss = ddp(idx, idx)
    loss.backward()
_, again = model(idx, idx)
assert loss.item() == again.item()
assert all(p.grad is not None for p in model.parameters())
assert "mpi4py" not in sys.modules, "a single process imported mpi4py"
print("ok")
"""


def run_python(code, env_extra=None):
    env = child_env(10)
    env.update(env_extra or {})
    # cwd: this tests folder, never the repository root, where an unbuilt source tree
    # would hide the installed package from `import microtensor`
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, cwd=HERE)


def test_single_process_without_mpi():
    proc = run_python(SINGLE)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_launched_without_mpi4py_says_how_to_install():
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import microtensor.distributed as dist\n"
            "try:\n    dist.init()\nexcept RuntimeError as e:\n    print(e)\n")
    proc = run_python(code, {"PMI_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "mpi4py cannot be imported" in proc.stdout and "microtensor[mpi]" in proc.stdout


def test_bad_arguments_raise():
    import microtensor.distributed as dist
    with pytest.raises(ValueError, match="not supported"):
        dist.all_reduce(mt.ones(2), op="prod")
    with pytest.raises(TypeError, match="expects a Tensor"):
        dist.all_reduce(np.ones(2))
    with pytest.raises(ValueError, match="positive"):
        mt.nn.parallel.DistributedDataParallel(mt.nn.Linear(2, 2), bucket_cap_mb=0)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        mt.nn.parallel.DistributedDataParallel(lambda x: x)


# ---- examples/train_char.py --ddp -----------------------------------------------------

ROOT = os.path.dirname(HERE)
TRAIN_CHAR = os.path.join(ROOT, "examples", "train_char.py")
TINY_RUN = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "16",
            "--batch_size", "4", "--threads", "1", "--eval_iters", "2", "--sample_chars", "0",
            "--warmup_iters", "2", "--lr_decay_iters", "6", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    rng = np.random.default_rng(0)
    words = ["the", "rank", "sends", "its", "gradient", "to", "every", "other", "and", "waits"]
    path.write_text(" ".join(rng.choice(words, size=6000)) + "\n", encoding="utf-8")
    return str(path)


def train_char(out_dir, text_file, *options, ranks=WORLD):
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, TRAIN_CHAR, "--ddp", "--data", text_file,
           "--out_dir", str(out_dir), *TINY_RUN, *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(60), timeout=120,
                          cwd=ROOT)


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return [line.split(",") for line in f.read().splitlines()[1:]]


@needs_mpi
def test_train_char_ddp_rank_0_alone_writes(tmp_path, text_file):
    proc = train_char(tmp_path, text_file, "--max_iters", "2", "--eval_interval", "2")
    assert proc.returncode == 0, proc.stderr
    # one log (rank 0's), counting the tokens of both ranks: 2 ranks x 4 x 16
    assert proc.stdout.count("iter 2:") == 1, proc.stdout
    assert "128 tokens per step" in proc.stdout
    assert [row[0] for row in metrics(tmp_path)] == ["0", "2"]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "ckpt_best.safetensors", "ckpt_last.safetensors", "loss.png", "metrics.csv"]


@pytest.mark.slow
@needs_mpi
def test_train_char_ddp_resume_replays_an_uninterrupted_run(tmp_path, text_file):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert train_char(whole, text_file, "--max_iters", "6", "--eval_interval", "3").returncode == 0
    assert train_char(halves, text_file, "--max_iters", "3", "--eval_interval", "3").returncode == 0
    proc = train_char(halves, text_file, "--max_iters", "6", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert metrics(halves)[-1][:4] == metrics(whole)[-1][:4]   # iter, losses, lr
