"""Every example at its edges, run as a user runs it (a subprocess): a bad flag gets one
line `prog: error: ...` and exit status 2, never a traceback; a NaN loss stops training
with status 1 and keeps the last good checkpoint; one run at a time owns an --out_dir;
Ctrl-C exits quietly with status 130; outputs go outside docs/; an unbuilt source tree
says how to build it."""
import concurrent.futures
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import _cli       # noqa: E402
import chardata   # noqa: E402

# a tiny model: every run below is a second or two
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "8",
        "--batch_size", "4", "--eval_iters", "1", "--sample_chars", "0", "--threads", "1"]


def run(script, *argv, cwd=None, env=None, timeout=120):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *argv],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def start(script, *argv, cwd=None, env=None):
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, os.path.join(EXAMPLES, script), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env)


def assert_one_line_error(result, script, *fragments, status=2):
    stderr = result.stderr
    assert result.returncode == status, (result.returncode, result.stdout, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs20k.txt"
    path.write_text(chardata.load_corpus(None)[:20_000], encoding="utf-8")
    return str(path)


# ---- the table of bad flags ----------------------------------------------------------------

# (script, the bad flags, what the error line must name). Each runs after a prefix of
# good flags (below) that keeps the run tiny should a bad flag ever get through.
BAD_FLAGS = [
    ("sharpness.py", ["--mlp_lrs", "-0.1"], "--mlp_lrs"),
    ("sharpness.py", ["--mlp_steps", "0"], "--mlp_steps"),
    ("sharpness.py", ["--power_iters", "0"], "--power_iters"),
    ("sharpness.py", ["--skip", "cnn"], "--skip"),
    ("sharpness.py", ["--seed", "-1"], "--seed"),
    ("double_backprop.py", ["--penalty", "-1"], "--penalty"),
    ("double_backprop.py", ["--steps", "0"], "--steps"),
    ("double_backprop.py", ["--lr", "nan"], "--lr"),
    ("double_backprop.py", ["--hidden", "0"], "--hidden"),
    ("train_char.py", ["--lr", "-1"], "--lr"),
    ("train_char.py", ["--lr", "0"], "--lr"),
    ("train_char.py", ["--lr", "nan"], "--lr"),
    ("train_char.py", ["--lr", "inf"], "--lr"),
    ("train_char.py", ["--lr", "abc"], "--lr"),
    ("train_char.py", ["--min_lr", "1"], "--min_lr"),
    ("train_char.py", ["--min_lr", "-1"], "--min_lr"),
    ("train_char.py", ["--beta1", "2"], "--beta1"),
    ("train_char.py", ["--beta2", "-0.1"], "--beta2"),
    ("train_char.py", ["--seed", "-1"], "--seed"),
    ("train_char.py", ["--d_ff", "0"], "--d_ff"),
    ("train_char.py", ["--n_head", "3"], "n_head=3"),
    ("train_char.py", ["--n_embd", "0"], "--n_embd"),
    ("train_char.py", ["--n_layer", "0"], "--n_layer"),
    ("train_char.py", ["--block_size", "0"], "--block_size"),
    ("train_char.py", ["--batch_size", "0"], "--batch_size"),
    ("train_char.py", ["--grad_accum", "0"], "--grad_accum"),
    ("train_char.py", ["--max_iters", "-1"], "--max_iters"),
    ("train_char.py", ["--warmup_iters", "-1"], "--warmup_iters"),
    ("train_char.py", ["--lr_decay_iters", "-5"], "--lr_decay_iters"),
    ("train_char.py", ["--eval_interval", "0"], "--eval_interval"),
    ("train_char.py", ["--eval_iters", "0"], "--eval_iters"),
    ("train_char.py", ["--sample_chars", "-1"], "--sample_chars"),
    ("train_char.py", ["--dropout", "1"], "--dropout"),
    ("train_char.py", ["--weight_decay", "-0.1"], "--weight_decay"),
    ("train_char.py", ["--grad_clip", "-1"], "--grad_clip"),
    ("train_char.py", ["--threads", "-1"], "--threads"),
    ("train_char.py", ["--norm", "batchnorm"], "--norm"),
    ("train_char.py", ["--resume", "--force"], "--force"),
    ("train_char.py", ["--grad_stats", "--ddp"], "--grad_stats"),
    ("train_char.py", ["--no_such_flag"], "--no_such_flag"),
    ("sample.py", ["--temperature", "-1"], "--temperature"),
    ("sample.py", ["--temperature", "nan"], "--temperature"),
    ("sample.py", ["--top_k", "-1"], "--top_k"),
    ("sample.py", ["--top_p", "0"], "--top_p"),
    ("sample.py", ["--top_p", "1.5"], "--top_p"),
    ("sample.py", ["--num_samples", "0"], "--num_samples"),
    ("sample.py", ["--max_new_tokens", "-1"], "--max_new_tokens"),
    ("sample.py", ["--seed", "-1"], "--seed"),
    ("sample.py", ["--threads", "-1"], "--threads"),
    ("train_seq2seq.py", ["--steps", "0"], "--steps"),
    ("train_seq2seq.py", ["--eval_interval", "0"], "--eval_interval"),
    ("train_seq2seq.py", ["--n_val", "0"], "--n_val"),
    ("train_seq2seq.py", ["--n_test", "0"], "--n_test"),
    ("train_seq2seq.py", ["--min_len", "5", "--max_len", "3"], "--min_len 5"),
    ("train_seq2seq.py", ["--min_len", "0"], "--min_len"),
    ("train_seq2seq.py", ["--n_head", "3"], "n_head=3"),
    ("train_seq2seq.py", ["--d_model", "0"], "--d_model"),
    ("train_seq2seq.py", ["--batch_size", "0"], "--batch_size"),
    ("train_seq2seq.py", ["--lr", "-1"], "--lr"),
    ("train_seq2seq.py", ["--dropout", "1"], "--dropout"),
    ("train_seq2seq.py", ["--target_acc", "0"], "--target_acc"),
    ("train_seq2seq.py", ["--n_val", "40", "--n_test", "20", "--max_len", "2"], "held-out"),
    ("residual_flow.py", ["--depths", "0"], "--depths"),
    ("residual_flow.py", ["--depths", "4", "1"], "--depths"),
    ("residual_flow.py", ["--train_iters", "0"], "--train_iters"),
    ("residual_flow.py", ["--lr", "-1"], "--lr"),
    ("residual_flow.py", ["--seed", "-1"], "--seed"),
    ("graph.py", ["--engine", "graphviz"], "--engine"),
    ("graph.py", ["--animate", "--deep", "1"], "--deep"),
    ("backprop_by_hand.py", ["--seed", "-1"], "--seed"),
    ("backprop_by_hand.py", ["--mine", "x.py", "--solution"], "not allowed"),
    ("backprop_by_hand.py", ["--mine", "no_such_file.py"], "no such file"),
    ("gradcheck_layers.py", ["--threads", "-1"], "--threads"),
    ("gradcheck_layers.py", ["-k", "no such layer"], "no such layer"),
]

SAFE_PREFIX = {
    "train_char.py": TINY + ["--max_iters", "2"],
    "sample.py": ["--max_new_tokens", "1"],
    "train_seq2seq.py": ["--steps", "2", "--eval_interval", "1", "--n_val", "5", "--n_test", "5",
                         "--max_len", "4", "--d_model", "16", "--n_head", "2", "--d_ff", "16"],
    "residual_flow.py": ["--quick", "--skip", "depth", "training"],
    "graph.py": [],
    "backprop_by_hand.py": [],
    "gradcheck_layers.py": ["-k", "sinusoidal"],
    "sharpness.py": ["--quick"],
    "double_backprop.py": ["--steps", "1"],
}


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    """Every case of the table, run two at a time (most of a case is starting Python and
    importing numpy): index -> (result, its working directory)."""
    def one(index):
        script, flags, _ = BAD_FLAGS[index]
        folder = tmp_path_factory.mktemp(f"case{index}")
        argv = SAFE_PREFIX[script] + flags
        if script in ("train_char.py", "sample.py"):
            argv += ["--out_dir", str(folder / "out")]
        if script in ("residual_flow.py", "graph.py", "sharpness.py"):
            argv += ["--out", str(folder / "out")]
        return run(script, *argv, cwd=str(folder)), folder
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(enumerate(pool.map(one, range(len(BAD_FLAGS)))))


@pytest.mark.parametrize("index", range(len(BAD_FLAGS)),
                         ids=[f"{s}:{' '.join(f)}" for s, f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_error(index, bad_flag_runs):
    script, _, fragment = BAD_FLAGS[index]
    result, folder = bad_flag_runs[index]
    assert_one_line_error(result, script, fragment)
    # nothing half-made is left behind (train_char once left a header-only metrics.csv)
    assert not os.path.exists(folder / "out" / "metrics.csv")


def test_bad_paths_are_one_line_errors(tmp_path, corpus):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    no_env_path = dict(os.environ, PATH="")   # no Graphviz, whatever this machine has
    cases = [
        ("train_char.py", [*TINY, "--data", str(tmp_path / "missing.txt")], "not found"),
        ("train_char.py", [*TINY, "--data", corpus, "--out_dir", str(a_file)], str(a_file)),
        ("sample.py", ["--out_dir", str(tmp_path)], "no checkpoint"),
        ("residual_flow.py", ["--skip", "depth", "training", "--out", str(a_file)], "a file"),
        ("graph.py", ["--out", str(a_file / "x")], "cannot write"),
    ]
    for script, argv, fragment in cases:
        assert_one_line_error(run(script, *argv, cwd=str(tmp_path)), script, fragment)
    result = run("graph.py", "--engine", "dot", "--out", str(tmp_path / "g"),
                 env=no_env_path, cwd=str(tmp_path))
    assert_one_line_error(result, "graph.py", "--engine dot", "Graphviz")


EXAMPLE_SCRIPTS = ["train_char.py", "sample.py", "train_seq2seq.py", "residual_flow.py",
                   "graph.py", "gradcheck_layers.py", "sharpness.py", "double_backprop.py",
                   "backprop_by_hand.py"]


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS)
def test_help_explains_every_option_and_the_run_time(script):
    result = run(script, "--help")
    assert result.returncode == 0 and not result.stderr, result.stderr
    text = result.stdout
    usage, _, body = text.partition("\n\n")
    options = sorted({word.strip("[]").split("=")[0] for word in usage.split()
                      if word.strip("[]").startswith("-")} - {"-h", "--help", "|"})
    assert options, usage
    lines = body.splitlines()
    for option in options:
        # the option's entry: its own line, then the help text (same line or indented below)
        at = next(i for i, line in enumerate(lines)
                  if line.lstrip().startswith(option + " ") or line.strip() == option
                  or line.lstrip().startswith(option + ",") or f", {option}" in line)
        entry = lines[at].split(option, 1)[1].split() + (lines[at + 1].split()
                                                         if at + 1 < len(lines) else [])
        words = [w for w in entry if re.fullmatch(r"\W*[A-Za-z]{2,}\W*", w) and not w.isupper()]
        assert len(words) >= 3, (option, lines[at:at + 2])
    assert "second" in text or "minute" in text, "--help states no run time"


# ---- a non-finite loss ----------------------------------------------------------------------

def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir, "--lr", "1e6",
                 "--warmup_iters", "0", "--max_iters", "200", "--eval_interval", "100")
    assert_one_line_error(result, "train_char.py", "at iteration", "last good checkpoint",
                          "iteration 0", status=1)
    assert "nan" in result.stderr.lower() or "inf" in result.stderr.lower()
    assert "--lr 1e+06 is far above" in result.stderr            # the note came first
    model_state, _, info = chardata.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))
    assert info["iter"] == 0
    for name, tensor in model_state.items():
        assert np.isfinite(tensor.numpy()).all(), name
    rows = open(os.path.join(out_dir, "metrics.csv")).read().splitlines()
    assert len(rows) == 2 and "nan" not in rows[1].lower()         # header, iteration 0
    assert not os.path.exists(os.path.join(out_dir, _cli.LOCK_NAME))


def test_a_good_run_is_not_stopped(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "20", "--eval_interval", "10", "--sample_chars", "20")
    assert result.returncode == 0, result.stderr
    assert "done: 20 iterations" in result.stdout and "sample" in result.stdout
    assert sorted(os.listdir(out_dir)) == sorted(
        ["ckpt_last.safetensors", "ckpt_best.safetensors", "metrics.csv", "loss.png"])



# ---- what a run says at its start and end ---------------------------------------------------

@pytest.mark.parametrize("extra, outputs", [
    ([], ["ckpt_last.safetensors", "ckpt_best.safetensors", "metrics.csv", "loss.png"]),
    (["--grad_stats"], ["ckpt_last.safetensors", "ckpt_best.safetensors", "metrics.csv",
                        "loss.png", "grad_stats.csv"]),
])
def test_the_end_of_a_run_names_what_it_wrote_and_how_to_sample(tmp_path, corpus, extra,
                                                                 outputs):
    out_dir = str(tmp_path / "run")
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "6", "--eval_interval", "3", *extra)
    assert result.returncode == 0, result.stderr
    done = [ln for ln in result.stdout.splitlines() if ln.startswith("done: ")]
    assert len(done) == 1 and f"{out_dir}/" in done[0]
    for name in outputs:
        assert name in done[0] and os.path.exists(os.path.join(out_dir, name)), done[0]
    assert sorted(os.listdir(out_dir)) == sorted(outputs)
    command = [ln for ln in result.stdout.splitlines() if ln.startswith("sample from it: ")]
    assert len(command) == 1 and "sample.py --out_dir" in command[0]
    # the command printed runs as printed
    argv = shlex.split(command[0][len("sample from it: "):])
    sampled = subprocess.run(argv + ["--max_new_tokens", "5", "--threads", "1"],
                             capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr


def test_no_tokens_per_second_before_it_is_measured(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "6", "--eval_interval", "3")
    assert result.returncode == 0, result.stderr
    evals = [ln for ln in result.stdout.splitlines() if ln.startswith("iter ")]
    assert len(evals) == 3
    assert "tok/s" not in evals[0] and not re.search(r"\b0 tok/s", result.stdout)
    assert all(re.search(r"[1-9][0-9,]* tok/s", ln) for ln in evals[1:]), evals
    # a resumed run has measured nothing yet either
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "9", "--eval_interval", "3", "--resume")
    evals = [ln for ln in result.stdout.splitlines() if ln.startswith("iter ")]
    assert evals and not re.search(r"\b0 tok/s", result.stdout)


@pytest.mark.parametrize("max_iters", ["0", "4"])
def test_resuming_a_finished_run_says_how_to_train_further(tmp_path, corpus, max_iters):
    out_dir = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--out_dir", out_dir, "--eval_interval", "2"]
    assert run("train_char.py", *common, "--max_iters", max_iters).returncode == 0
    result = run("train_char.py", *common, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"already reached --max_iters {max_iters}" in result.stdout
    suggested = re.search(r"--resume --max_iters (\d+)", result.stdout)
    assert suggested and int(suggested.group(1)) > int(max_iters)
    # a run that still has steps to go says nothing of the kind
    result = run("train_char.py", *common, "--resume", "--max_iters", suggested.group(1))
    assert result.returncode == 0 and "already reached" not in result.stdout
    assert f"done: {suggested.group(1)} iterations" in result.stdout


# mpi4py made unimportable, the script run as `python train_char.py ...` would run it
NO_MPI4PY = ("import os, runpy, sys; sys.modules['mpi4py'] = None; sys.argv = sys.argv[1:]; "
             "sys.path.insert(0, os.path.dirname(sys.argv[0])); "
             "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("mpi4py", ["installed", "missing"])
def test_ddp_outside_a_launcher_says_it_runs_one_process(tmp_path, corpus, mpi4py):
    if mpi4py == "installed":
        pytest.importorskip("mpi4py")
    out_dir = str(tmp_path / "run")
    argv = [*TINY, "--data", corpus, "--out_dir", out_dir, "--max_iters", "2", "--ddp"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_", "HYDRA_"))}
    script = os.path.join(EXAMPLES, "train_char.py")
    command = [sys.executable, script, *argv] if mpi4py == "installed" else \
        [sys.executable, "-c", NO_MPI4PY, script, *argv]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    notes = [ln for ln in result.stderr.splitlines() if "--ddp" in ln]
    assert len(notes) == 1, result.stderr
    assert "runs one process" in notes[0] and "mpiexec -n 2" in notes[0]
    assert "train_char.py --ddp" in notes[0]
    if mpi4py == "missing":
        assert "mpi4py is not installed" in notes[0] and "microtensor[mpi]" in notes[0]
    # without --ddp: no such note
    result = subprocess.run(command[:-1] + ["--force"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0 and "--ddp" not in result.stderr

# ---- who owns --out_dir -----------------------------------------------------------------------

def test_out_dir_with_an_earlier_run_needs_resume_or_force(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--out_dir", out_dir, "--eval_interval", "5"]
    assert run("train_char.py", *common, "--max_iters", "5").returncode == 0
    first = open(os.path.join(out_dir, "metrics.csv")).read()

    result = run("train_char.py", *common, "--max_iters", "10")
    assert_one_line_error(result, "train_char.py", "already holds", "--resume", "--force")
    assert open(os.path.join(out_dir, "metrics.csv")).read() == first   # untouched

    result = run("train_char.py", *common, "--max_iters", "10", "--resume")
    assert result.returncode == 0, result.stderr
    result = run("train_char.py", *common, "--max_iters", "5", "--seed", "7", "--force")
    assert result.returncode == 0, result.stderr
    rows = open(os.path.join(out_dir, "metrics.csv")).read().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "5"]        # a fresh run, not 0..10
    assert chardata.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))[2]["iter"] == 5

    # a directory holding the user's own files is refused too
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    result = run("train_char.py", *TINY, "--data", corpus, "--out_dir", str(other))
    assert_one_line_error(result, "train_char.py", "todo.txt")


def lock_line(pid):
    return f"{pid} {socket.gethostname()} {_cli._start_time(pid)}\n"


def test_a_live_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(tmp_path, corpus):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    lock = out_dir / _cli.LOCK_NAME
    common = [*TINY, "--data", corpus, "--out_dir", str(out_dir), "--max_iters", "3"]

    lock.write_text(lock_line(os.getpid()))          # held by a live process: this one
    result = run("train_char.py", *common)
    assert_one_line_error(result, "train_char.py", f"in use by process {os.getpid()}")
    assert lock.read_text() == lock_line(os.getpid())   # not taken, not removed

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{dead.pid} {socket.gethostname()} 12345\n")   # its process is gone
    result = run("train_char.py", *common)
    assert result.returncode == 0, result.stderr
    assert not lock.exists()                          # released at the end
    leftovers = [n for n in os.listdir(out_dir) if n.startswith(".")]
    assert leftovers == [], leftovers                 # no temporary files either


def test_a_second_run_into_a_busy_out_dir_is_refused(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    argv = [*TINY, "--data", corpus, "--out_dir", out_dir, "--eval_interval", "100"]
    first = start("train_char.py", *argv, "--max_iters", "100000")   # runs until stopped
    lock = os.path.join(out_dir, _cli.LOCK_NAME)
    wait_for(first, lambda: os.path.exists(lock), "the first run to take the lock")
    second = run("train_char.py", *argv, "--max_iters", "10")
    stdout, stderr = interrupt(first)
    assert_one_line_error(second, "train_char.py", f"in use by process {first.pid}")
    assert first.returncode == 130, stderr                      # the first run went on
    assert not os.path.exists(lock)


def test_temporary_names_are_per_process(tmp_path):
    path = str(tmp_path / "loss.png")
    tmp = _cli.temp_path(path)
    assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".png")
    assert str(os.getpid()) in os.path.basename(tmp) and tmp != path
    _cli.replace_with(path, lambda t: open(t, "w").write("x"))
    assert open(path).read() == "x" and not os.path.exists(tmp)
    with pytest.raises(ZeroDivisionError):             # a failed write leaves nothing behind
        _cli.replace_with(path, lambda t: (open(t, "w").write("y"), 1 / 0))
    assert open(path).read() == "x" and not os.path.exists(tmp)


# ---- Ctrl-C -----------------------------------------------------------------------------------

def wait_for(proc, condition, what, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def interrupt(proc):
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)
    finally:
        proc.kill()


def test_ctrl_c_while_training_saves_a_valid_checkpoint(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    proc = start("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "100000", "--eval_interval", "20")
    metrics = os.path.join(out_dir, "metrics.csv")
    wait_for(proc, lambda: os.path.exists(metrics) and
             len(open(metrics).read().splitlines()) >= 3, "two evaluations")
    stdout, stderr = interrupt(proc)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "interrupted at iteration" in stdout and "--resume" in stdout
    info = chardata.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))[2]
    assert info["iter"] >= 20
    assert not os.path.exists(os.path.join(out_dir, _cli.LOCK_NAME))


def test_ctrl_c_during_the_final_sample_is_quiet(tmp_path, corpus):
    out_dir = str(tmp_path / "run")
    proc = start("train_char.py", *TINY, "--data", corpus, "--out_dir", out_dir,
                 "--max_iters", "0", "--sample_chars", "1000000")
    seen = []

    def sampling():      # "done: ..." is printed right before the sample starts
        seen.append(proc.stdout.readline())
        return seen[-1].startswith("done:")
    wait_for(proc, sampling, "the final sample")
    time.sleep(0.3)
    stdout, stderr = interrupt(proc)
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "train_char.py: interrupted", stderr
    chardata.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))   # still valid


def test_ctrl_c_in_seq2seq_is_quiet(tmp_path):
    proc = start("train_seq2seq.py", "--steps", "100000", "--n_val", "5", "--n_test", "5",
                 "--eval_interval", "100000")
    first_line = []
    wait_for(proc, lambda: first_line.append(proc.stdout.readline()) or
             first_line[-1].startswith("EncoderDecoder"), "training to start")
    time.sleep(0.5)
    stdout, stderr = interrupt(proc)
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "train_seq2seq.py: interrupted", stderr


def test_ctrl_c_while_importing_is_quiet(tmp_path):
    """residual_flow.py imports numpy and microtensor before main() runs: a Ctrl-C there
    is quiet too. The signal goes out once numpy is loaded (the interpreter is up and
    importing); if the imports finish first, main() takes it, with the same result."""
    proc = start("residual_flow.py", "--skip", "depth", "training", "--out", str(tmp_path / "r"))

    def importing():
        try:
            return "numpy" in open(f"/proc/{proc.pid}/maps").read()
        except OSError:
            return False
    if not os.path.exists("/proc/self/maps"):
        time.sleep(0.5)
    else:
        wait_for(proc, importing, "numpy to load")
    stdout, stderr = interrupt(proc)
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.strip() == "residual_flow.py: interrupted", stderr


# ---- outputs outside docs/ ---------------------------------------------------------------------

def test_default_outputs_go_to_the_working_directory_not_docs(tmp_path):
    docs_img = os.path.join(ROOT, "docs", "img")
    before = {n: os.path.getmtime(os.path.join(docs_img, n)) for n in os.listdir(docs_img)}
    result = run("residual_flow.py", "--quick", "--skip", "depth", "training", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path / "out-residual_flow") == ["scalar_stack.png"]
    result = run("graph.py", "--engine", "matplotlib", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "graph_block.png" in os.listdir(tmp_path / "out-graph")
    after = {n: os.path.getmtime(os.path.join(docs_img, n)) for n in os.listdir(docs_img)}
    assert after == before


# ---- importing from a source tree that was never built -----------------------------------------

def test_import_from_an_unbuilt_source_tree_says_what_to_do(tmp_path):
    source = os.path.join(ROOT, "microtensor")
    for folder, _, files in os.walk(source):
        target = tmp_path / "microtensor" / os.path.relpath(folder, source)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".py"):            # the sources, none of the compiled modules
                shutil.copy(os.path.join(folder, name), target / name)
    # -S: no site-packages, so no installed (or editable) microtensor can step in for the
    # missing compiled modules; the folder in the working directory is all Python sees
    result = subprocess.run([sys.executable, "-S", "-c", "import microtensor"],
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    text = result.stderr
    assert "\nImportError: microtensor is being imported from its source folder" in text, text
    assert "partially initialized" not in text
    assert "pip install ." in text and "another directory" in text
    assert "python setup.py build_ext --inplace" in text and 'pip install -e ".[test]"' in text


# ---- the README's commands, as typed, from the repository root ----------------------------------

def readme_commands():
    """The commands of the README's "What you can run" table."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("## What you can run"):]
    table = table[:table.index("\n\n", table.index("| command"))]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_every_readme_command_uses_the_venv_the_first_command_made():
    commands = readme_commands()
    assert len(commands) >= 10
    for command in commands:
        words = shlex.split(command)
        # the first command creates .venv and never activates it
        assert words[0].startswith(".venv/bin/"), command
        if words[0] == ".venv/bin/mpiexec":
            assert words[3] == ".venv/bin/python", command
        scripts = [w for w in words if w.endswith(".py") and "/" in w]
        for script in scripts:
            assert os.path.exists(os.path.join(ROOT, script)), command


@pytest.mark.parametrize("command", [c for c in readme_commands() if ".py" in c
                                     and "mpiexec" not in c and "bench_" not in c])
def test_each_readme_script_answers_help_from_the_root(command):
    words = shlex.split(command)
    script = next(w for w in words if w.endswith(".py") and "/" in w)
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


def test_the_readme_module_command_runs_from_a_fresh_clones_root(tmp_path):
    """A fresh clone after `pip install .`: the root holds microtensor/ without compiled
    modules, the package is installed in .venv. The table's `-m` command must import the
    installed one; plain `python -m` meets the unbuilt folder and says so."""
    import microtensor as mt
    import site
    command = next(c for c in readme_commands() if "microtensor.coverage" in c)
    source = os.path.join(ROOT, "microtensor")
    for folder, _, files in os.walk(source):
        target = tmp_path / "microtensor" / os.path.relpath(folder, source)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".py"):
                shutil.copy(os.path.join(folder, name), target / name)
    # .venv: a virtual environment that sees the microtensor this test imported (built)
    # and the packages of this interpreter, through a .pth file
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")],
                   check=True, timeout=120)
    venv_site = next((tmp_path / ".venv" / "lib").glob("python*/site-packages"))
    installed = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))
    paths = [installed] + [p for p in site.getsitepackages() if os.path.isdir(p)]
    (venv_site / "deps.pth").write_text("\n".join(paths) + "\n")
    words = shlex.split(command)
    assert words[0] == ".venv/bin/python"
    result = subprocess.run([str(tmp_path / ".venv/bin/python"), *words[1:]], cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Tensor" in result.stdout
    plain = [w for w in words[1:] if w != "-I"]
    result = subprocess.run([str(tmp_path / ".venv/bin/python"), *plain], cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "source folder" in result.stderr
