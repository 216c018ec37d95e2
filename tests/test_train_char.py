"""examples/train_char.py and examples/sample.py end to end, on 50 KB of Python's docs
with a tiny model: the loss falls, --resume (also after Ctrl-C) replays an uninterrupted
run exactly, checkpoints sample, and bad input gets a one-line error."""
import collections
import contextlib
import csv
import io
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import chardata      # noqa: E402
import microtensor as mt  # noqa: E402
import sample        # noqa: E402
import train_char    # noqa: E402

# --threads 1: small matrices gain nothing from a second thread, and on a busy machine
# threads that wait for each other make every op many times slower
TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32",
              "--batch_size", "8", "--threads", "1"]


def run_main(module, argv):
    """main(argv) in-process -> (exit code, stdout, stderr); thread settings restored."""
    threads, blas_threads = mt.get_num_threads(), chardata.get_blas_threads()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(argv)
        except SystemExit as e:
            code = e.code
        finally:
            mt.set_num_threads(threads)
            if blas_threads is not None:
                chardata.set_blas_threads(blas_threads)
    return code, out.getvalue(), err.getvalue()


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def losses(rows):
    return np.array([[float(r["iter"]), float(r["train_loss"]), float(r["val_loss"]),
                      float(r["lr"])] for r in rows])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs50k.txt"
    path.write_text(chardata.load_corpus(None)[:50_000], encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("out"))
    code, stdout, stderr = run_main(train_char, [
        "--data", corpus, "--out_dir", out_dir, *TINY_MODEL, "--n_embd", "64",
        "--batch_size", "16", "--max_iters", "300", "--eval_interval", "100",
        "--eval_iters", "8", "--lr", "3e-3", "--warmup_iters", "20", "--sample_chars", "80"])
    assert code == 0, stderr
    return out_dir, stdout


def test_loss_falls_well_below_the_unigram_baseline(corpus, trained):
    out_dir, stdout = trained
    text = open(corpus, encoding="utf-8").read()
    counts = np.array(list(collections.Counter(text).values()), dtype=np.float64)
    p = counts / counts.sum()
    unigram_entropy = -(p * np.log(p)).sum()  # the best loss without context, ~3.2 nats

    rows = read_metrics(out_dir)
    assert [int(r["iter"]) for r in rows] == [0, 100, 200, 300]
    first, last = losses(rows)[0], losses(rows)[-1]
    vocab_size = len(set(text))
    assert abs(first[1] - math.log(vocab_size)) < 0.5  # an untrained model is ~uniform
    assert last[2] < unigram_entropy - 0.5, (last, unigram_entropy)
    assert last[1] < unigram_entropy - 0.5
    assert "--- sample" in stdout and "val loss" in stdout


def test_outputs_checkpoint_plot_and_metadata(trained):
    out_dir, _ = trained
    with open(os.path.join(out_dir, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    header = open(os.path.join(out_dir, "metrics.csv")).readline().strip()
    assert header == "iter,train_loss,val_loss,lr,tokens_per_sec"
    assert all(float(r["tokens_per_sec"]) > 0 for r in read_metrics(out_dir)[1:])

    # a plain safetensors file: the model's weights under nanoGPT's names
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(out_dir, "ckpt_last.safetensors"))
    assert tensors["transformer.wte.weight"].shape[1] == 64
    assert "transformer.h.0.attn.c_attn.weight" in tensors
    model_state, optimizer_state, info = chardata.load_checkpoint(
        os.path.join(out_dir, "ckpt_last.safetensors"))
    assert info["iter"] == 300
    assert info["config"]["n_embd"] == 64 and len(info["vocab"]) == info["config"]["vocab_size"]
    assert info["best_val_loss"] == pytest.approx(min(float(r["val_loss"])
                                                      for r in read_metrics(out_dir)))
    # weight decay on the 2-D weights only
    decays = [g["weight_decay"] for g in optimizer_state["param_groups"]]
    assert decays == [0.1, 0.0]
    model = chardata.build_model(info["config"], model_state)
    n_matrices = sum(1 for p in model.parameters() if p.ndim >= 2)
    assert len(optimizer_state["param_groups"][0]["params"]) == n_matrices
    n_others = len(list(model.parameters())) - n_matrices
    assert len(optimizer_state["param_groups"][1]["params"]) == n_others


def test_get_lr_warms_up_then_decays_to_min_lr():
    run = dict(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [train_char.get_lr(it, run) for it in range(130)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[9] == pytest.approx(10 / 11)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)               # halfway down the cosine
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert lrs[110] == lrs[129] == pytest.approx(0.1)


def test_resume_replays_an_uninterrupted_run(corpus, tmp_path):
    # dropout > 0 makes the run depend on microtensor's RNG state as well as the sampler's
    common = ["--data", corpus, *TINY_MODEL, "--dropout", "0.1", "--eval_interval", "10",
              "--eval_iters", "2", "--warmup_iters", "5", "--lr_decay_iters", "40",
              "--sample_chars", "0"]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    assert run_main(train_char, [*common, "--out_dir", whole, "--max_iters", "40"])[0] == 0
    assert run_main(train_char, [*common, "--out_dir", halves, "--max_iters", "20"])[0] == 0
    # (--threads is a property of the machine, not of the run: it is not resumed, and
    # the weights agree bit for bit only with the same thread count)
    code, stdout, stderr = run_main(train_char, ["--resume", "--out_dir", halves,
                                                 "--max_iters", "40", "--threads", "1"])
    assert code == 0, stderr
    assert "resuming at iteration 20" in stdout

    expected, got = losses(read_metrics(whole)), losses(read_metrics(halves))
    assert got[:, 0].tolist() == [0, 10, 20, 30, 40]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    a = chardata.load_checkpoint(os.path.join(whole, "ckpt_last.safetensors"))[0]
    b = chardata.load_checkpoint(os.path.join(halves, "ckpt_last.safetensors"))[0]
    for key in a:
        np.testing.assert_array_equal(b[key].numpy(), a[key].numpy(), err_msg=key)


def _optimizer_tensors(state):
    """{name: array} of every tensor in an optimizer state dict (the AdamW moments)."""
    out = {}
    for pid, entry in state["state"].items():
        for k, v in entry.items():
            if isinstance(v, mt.Tensor) and v.ndim > 0:
                out[f"{pid}/{k}"] = v.numpy()
    return out


@pytest.mark.parametrize("compiled", [True, False])
def test_grad_accum_on_b_rows_equals_one_batch_of_2b_rows(corpus, tmp_path, compiled):
    """Two micro-batches of B rows give the gradient of one batch of the same 2B rows
    (each micro-batch loss divided by the count): the AdamW moments after one step (the
    first moment is (1 - beta1) times the gradient) and the weights agree."""
    common = ["--data", corpus, *TINY_MODEL, "--dropout", "0", "--max_iters", "1",
              "--eval_interval", "1", "--eval_iters", "1", "--sample_chars", "0",
              "--warmup_iters", "0", "--grad_clip", "0",       # clipping would hide a scale
              *([] if compiled else ["--no-compile"])]
    halves, whole = str(tmp_path / "halves"), str(tmp_path / "whole")
    assert run_main(train_char, [*common, "--batch_size", "4", "--grad_accum", "2",
                                 "--out_dir", halves])[0] == 0
    assert run_main(train_char, [*common, "--batch_size", "8", "--out_dir", whole])[0] == 0
    a_model, a_opt, _ = chardata.load_checkpoint(os.path.join(halves, "ckpt_last.safetensors"))
    b_model, b_opt, _ = chardata.load_checkpoint(os.path.join(whole, "ckpt_last.safetensors"))
    a_moments, b_moments = _optimizer_tensors(a_opt), _optimizer_tensors(b_opt)
    assert a_moments and a_moments.keys() == b_moments.keys()
    for key in a_moments:
        np.testing.assert_allclose(a_moments[key], b_moments[key], rtol=2e-4, atol=1e-9,
                                   err_msg=key)
    # the weights after one AdamW step (lr 5e-3): an update of about lr * sign(g) per
    # element, so a gradient that is rounding noise (the key bias's, 0 in exact
    # arithmetic) may move its weight differently by a fraction of lr
    for key in a_model:
        np.testing.assert_allclose(a_model[key].numpy(), b_model[key].numpy(), rtol=1e-5,
                                   atol=1e-5, err_msg=key)


def test_the_compiled_step_gives_the_eager_run(corpus, tmp_path):
    """The step runs through mt.compile by default; --no-compile gives the same losses
    and weights bit for bit (with dropout and gradient accumulation, whose micro-batch
    index is part of the plan's key)."""
    common = ["--data", corpus, *TINY_MODEL, "--dropout", "0.1", "--eval_interval", "6",
              "--eval_iters", "2", "--warmup_iters", "3", "--max_iters", "12",
              "--grad_accum", "2", "--sample_chars", "0"]
    compiled, eager = str(tmp_path / "compiled"), str(tmp_path / "eager")
    code, stdout, stderr = run_main(train_char, [*common, "--out_dir", compiled])
    assert code == 0, stderr
    assert "mt.compile" in stdout and "running eagerly" not in stderr
    assert run_main(train_char, [*common, "--out_dir", eager, "--no-compile"])[0] == 0
    np.testing.assert_array_equal(losses(read_metrics(compiled)), losses(read_metrics(eager)))
    a = chardata.load_checkpoint(os.path.join(eager, "ckpt_last.safetensors"))[0]
    b = chardata.load_checkpoint(os.path.join(compiled, "ckpt_last.safetensors"))[0]
    for key in a:
        np.testing.assert_array_equal(b[key].numpy(), a[key].numpy(), err_msg=key)


def test_grad_stats_records_each_blocks_input_gradient_and_leaves_training_alone(corpus,
                                                                                   tmp_path):
    common = ["--data", corpus, *TINY_MODEL, "--n_layer", "2", "--eval_interval", "5",
              "--eval_iters", "1", "--max_iters", "10", "--sample_chars", "0"]
    with_stats, without = str(tmp_path / "stats"), str(tmp_path / "plain")
    code, _, stderr = run_main(train_char, [*common, "--out_dir", with_stats, "--grad_stats"])
    assert code == 0, stderr
    assert run_main(train_char, [*common, "--out_dir", without])[0] == 0
    # the extra backward changes nothing: same losses, same weights bit for bit
    np.testing.assert_array_equal(losses(read_metrics(with_stats)), losses(read_metrics(without)))
    a = chardata.load_checkpoint(os.path.join(with_stats, "ckpt_last.safetensors"))[0]
    b = chardata.load_checkpoint(os.path.join(without, "ckpt_last.safetensors"))[0]
    for key in a:
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy(), err_msg=key)
    assert not os.path.exists(os.path.join(without, "grad_stats.csv"))
    with open(os.path.join(with_stats, "grad_stats.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["iter"] for r in rows] == ["0", "5", "10"]
    assert all(float(r[k]) > 0 and math.isfinite(float(r[k]))
               for r in rows for k in ("block0", "block1"))
    # the heatmap sits beside the loss: a wider picture than the loss alone
    from PIL import Image
    with Image.open(os.path.join(with_stats, "loss.png")) as im_stats, \
            Image.open(os.path.join(without, "loss.png")) as im_plain:
        assert im_stats.size[0] > 1.5 * im_plain.size[0]

    # the first row against retained gradients at the blocks' inputs, recomputed from
    # the initial weights (a run of 0 steps) on the same batch
    start = str(tmp_path / "start")
    assert run_main(train_char, [*common, "--out_dir", start, "--max_iters", "0",
                                 "--grad_stats"])[0] == 0
    model_state, _, info = chardata.load_checkpoint(os.path.join(start, "ckpt_last.safetensors"))
    model = chardata.build_model(info["config"], model_state)
    model.eval()
    text = open(corpus, encoding="utf-8").read()
    ids = chardata.CharTokenizer(info["vocab"]).encode(text)
    train_data, _ = chardata.train_val_split(ids, 32, corpus)
    x, y = chardata.get_batch(train_data, 32, 8, np.random.default_rng([1337, 2]))
    inputs = []

    def keep(module, args):
        args[0].retain_grad()
        inputs.append(args[0])
    handles = [block.register_forward_pre_hook(keep) for block in model.transformer.h]
    _, loss = model(x, y)
    loss.backward()
    for h in handles:
        h.remove()
    with open(os.path.join(start, "grad_stats.csv")) as f:
        first = next(csv.DictReader(f))
    for i, t in enumerate(inputs):
        assert float(first[f"block{i}"]) == pytest.approx(np.linalg.norm(t.grad.numpy()),
                                                          rel=1e-5)


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(corpus, tmp_path):
    out_dir = str(tmp_path / "interrupted")
    common = ["--data", corpus, *TINY_MODEL, "--eval_interval", "10", "--eval_iters", "2",
              "--warmup_iters", "5", "--lr_decay_iters", "200", "--sample_chars", "0"]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(EXAMPLES, "train_char.py"), *common,
         "--out_dir", out_dir, "--max_iters", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        metrics = os.path.join(out_dir, "metrics.csv")
        while time.time() < deadline:   # wait until it has trained past an evaluation
            if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted at iteration" in stdout and "--resume" in stdout
    stopped_at = chardata.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))[2]["iter"]
    assert stopped_at >= 10

    end = str(stopped_at + 10)
    code, _, stderr = run_main(train_char, ["--resume", "--out_dir", out_dir,
                                            "--max_iters", end, "--threads", "1"])
    assert code == 0, stderr
    reference = str(tmp_path / "reference")
    assert run_main(train_char, [*common, "--out_dir", reference, "--max_iters", end])[0] == 0
    expected, got = losses(read_metrics(reference)), losses(read_metrics(out_dir))
    assert got[:, 0].tolist() == expected[:, 0].tolist()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


def test_sample_continues_the_prompt(trained):
    out_dir, _ = trained
    ckpt = os.path.join(out_dir, "ckpt_best.safetensors")
    argv = ["--ckpt", ckpt, "--threads", "1", "--prompt", "The ", "--max_new_tokens", "60",
            "--seed", "3"]
    code, stdout, stderr = run_main(sample, argv)
    assert code == 0, stderr
    assert stdout.startswith("The ") and len(stdout) == len("The ") + 60 + 1
    assert run_main(sample, argv)[1] == stdout               # the seed fixes the text
    assert run_main(sample, argv[:-1] + ["4"])[1] != stdout

    # the newest checkpoint in --out_dir; several samples; top_p; a prompt longer than block_size
    long_prompt = "return " * 10
    code, stdout, stderr = run_main(sample, [
        "--out_dir", out_dir, "--threads", "1", "--prompt", long_prompt, "--max_new_tokens", "20",
        "--num_samples", "2", "--top_p", "0.9", "--temperature", "1.2"])
    assert code == 0, stderr
    first, second = stdout.split("-" * 40 + "\n")
    assert first.startswith(long_prompt) and second.startswith(long_prompt)
    assert len(first) == len(second) == len(long_prompt) + 20 + 1


def expect_error(module, argv, *fragments):
    code, stdout, stderr = run_main(module, argv)
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{module.__name__}.py: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_missing_empty_undecodable_or_short_data(tmp_path):
    out = ["--out_dir", str(tmp_path / "out")]
    missing = str(tmp_path / "missing.txt")
    expect_error(train_char, ["--data", missing, *out], "not found", missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    expect_error(train_char, ["--data", str(empty), *out], "empty", str(empty))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    expect_error(train_char, ["--data", str(latin1), *out], "not UTF-8", "0xe9")
    short = tmp_path / "short.txt"
    short.write_text("x" * 300)
    expect_error(train_char, ["--data", str(short), "--block_size", "64", *out],
                 "300 characters", "block_size + 1 = 65", "--block_size")
    expect_error(train_char, ["--data", str(tmp_path), *out], "directory")


def test_unwritable_out_dir(corpus, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    bad = str(a_file / "out")
    expect_error(train_char, ["--data", corpus, "--out_dir", bad], "cannot write to --out_dir", bad)


def test_resume_with_another_shape_names_the_mismatch(trained, tmp_path):
    out_dir, _ = trained
    expect_error(train_char, ["--resume", "--out_dir", out_dir, "--n_embd", "48"],
                 "--n_embd 48", "n_embd=64")
    expect_error(train_char, ["--resume", "--out_dir", out_dir, "--pos", "rope"],
                 "--pos rope", "pos=learned")
    expect_error(train_char, ["--resume", "--out_dir", str(tmp_path)],
                 "no checkpoint", "ckpt_last.safetensors")
    # the vocabulary is the checkpoint's: new text must not bring new characters
    snowy = tmp_path / "snowy.txt"
    snowy.write_text("let it snow ☃ " * 500, encoding="utf-8")
    expect_error(train_char, ["--resume", "--out_dir", out_dir, "--data", str(snowy)],
                 "not in the vocabulary", "'☃' (U+2603)")
    expect_error(train_char, ["--n_embd", "30", "--n_head", "4", "--out_dir", str(tmp_path)],
                 "n_embd=30", "n_head=4")


def test_sample_errors(trained, tmp_path):
    out_dir, _ = trained
    ckpt = os.path.join(out_dir, "ckpt_last.safetensors")
    # the 50 KB of docs have no 'é' and no snowman; both are named
    expect_error(sample, ["--ckpt", ckpt, "--prompt", "Café ☃"], "prompt",
                 "'é' (U+00E9)", "'☃' (U+2603)")
    expect_error(sample, ["--out_dir", str(tmp_path)], "no checkpoint", str(tmp_path))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(open(ckpt, "rb").read()[:1000])
    expect_error(sample, ["--ckpt", str(damaged)], "cannot read checkpoint", str(damaged))
    expect_error(sample, ["--ckpt", str(tmp_path / "nope.safetensors")], "not found")
    expect_error(sample, ["--ckpt", ckpt, "--temperature", "-1"], "--temperature")
    expect_error(sample, ["--ckpt", ckpt, "--temperature", "nan"], "--temperature")


def test_sample_temperature_zero_is_greedy(trained):
    """generate documents temperature=0 as argmax: the text no longer depends on the seed."""
    out_dir, _ = trained
    argv = ["--out_dir", out_dir, "--threads", "1", "--prompt", "The ", "--max_new_tokens",
            "30", "--temperature", "0"]
    runs = [run_main(sample, argv + ["--seed", seed]) for seed in ("1", "2")]
    assert [code for code, _, _ in runs] == [0, 0], runs
    assert runs[0][1] == runs[1][1] and runs[0][1].startswith("The ")
    # sampling at temperature 1 with these two seeds differs (so the seed did matter there)
    sampled = [run_main(sample, argv[:-1] + ["1", "--seed", seed])[1] for seed in ("1", "2")]
    assert sampled[0] != sampled[1]


def test_help_explains_every_option():
    code, stdout, _ = run_main(train_char, ["--help"])
    assert code == 0
    for name in ["n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters", "lr",
                 "min_lr", "warmup_iters", "weight_decay", "grad_clip", "dropout",
                 "eval_interval", "eval_iters", "seed", "out_dir", "resume", "threads", "norm",
                 "pos", "mlp", "prenorm", "bias", "tie_weights", "data", "grad_accum", "d_ff"]:
        assert f"--{name}" in stdout, name
    assert stdout.count("(default:") >= 28
    code, stdout, _ = run_main(sample, ["--help"])
    assert code == 0 and "--top_p" in stdout and "--num_samples" in stdout


# ---- two independent checkpoints: damage to one never touches the other ---------------------

def small_run(corpus, out_dir, *extra):
    code, stdout, stderr = run_main(train_char, [
        "--data", corpus, "--out_dir", out_dir, *TINY_MODEL, "--max_iters", "6",
        "--eval_interval", "3", "--eval_iters", "2", "--sample_chars", "0", *extra])
    assert code == 0, stderr
    return stdout, stderr


DAMAGE = {
    "truncated to 1000 bytes": lambda data: data[:1000],
    "truncated to half": lambda data: data[:len(data) // 2],
    "emptied": lambda data: b"",
    "header overwritten": lambda data: b"\xff" * 16 + data[16:],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("which", ["last", "best"])
def test_damage_to_one_checkpoint_leaves_the_other_and_says_what_to_do(corpus, tmp_path,
                                                                        which, damage):
    out_dir = str(tmp_path / "out")
    small_run(corpus, out_dir)
    last = os.path.join(out_dir, "ckpt_last.safetensors")
    best = os.path.join(out_dir, "ckpt_best.safetensors")
    # two files of their own: no hard link, no second name for one file
    for path in (last, best):
        assert os.stat(path).st_nlink == 1 and not os.path.islink(path)
    assert not os.path.samefile(last, best)
    bad, good = (last, best) if which == "last" else (best, last)
    expected_iter = chardata.load_checkpoint(good)[2]["iter"]
    with open(bad, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(DAMAGE[damage](data))

    # the other one loads, and sample.py without --ckpt uses it
    assert chardata.load_checkpoint(good)[2]["iter"] == expected_iter
    code, stdout, stderr = run_main(sample, ["--out_dir", out_dir, "--threads", "1",
                                             "--max_new_tokens", "5"])
    assert code == 0, stderr
    if os.path.getmtime(bad) >= os.path.getmtime(good):     # the newest was the damaged one
        assert f"sampling from {good}" in stderr
    # --ckpt naming the damaged file: one line that names the other file
    expect_error(sample, ["--ckpt", bad], "cannot read checkpoint", bad, f"--ckpt {good}")

    if which == "last":
        # --resume: the line names the remedy, the other checkpoint's path and --force
        expect_error(train_char, ["--data", corpus, "--out_dir", out_dir, *TINY_MODEL,
                                  "--resume", "--max_iters", "9"],
                     "cannot read checkpoint", f"cp {best} {last}", "--resume", "--force")
        shutil.copy(best, last)                         # doing what it says works
    code, stdout, stderr = run_main(train_char, ["--data", corpus, "--out_dir", out_dir,
                                                 *TINY_MODEL, "--resume", "--max_iters", "9",
                                                 "--eval_iters", "2", "--sample_chars", "0"])
    assert code == 0, stderr
    assert f"resuming at iteration {expected_iter}" in stdout
    assert chardata.load_checkpoint(last)[2]["iter"] == 9


def test_both_checkpoints_damaged_says_start_again(corpus, tmp_path):
    out_dir = str(tmp_path / "out")
    small_run(corpus, out_dir)
    for name in ("ckpt_last.safetensors", "ckpt_best.safetensors"):
        with open(os.path.join(out_dir, name), "r+b") as f:
            f.truncate(100)
    expect_error(train_char, ["--data", corpus, "--out_dir", out_dir, *TINY_MODEL, "--resume"],
                 "cannot read checkpoint", "start again with --force")
    expect_error(sample, ["--out_dir", out_dir], "no other checkpoint", "--force")
    small_run(corpus, out_dir, "--force")                # and --force does start again



def test_evaluation_lines_carry_elapsed_time_and_an_eta(trained):
    _, stdout = trained
    evals = [ln for ln in stdout.splitlines() if ln.startswith("iter ")]
    assert len(evals) == 4, stdout
    assert all(re.search(r", \d+(h\d\dm|m\d\ds|s) elapsed", ln) for ln in evals), evals
    # an estimate once an iteration has been timed, none at the end
    assert ["ETA" in ln for ln in evals] == [False, True, True, False], evals


def test_resume_without_a_checkpoint_says_to_run_without_resume(tmp_path):
    expect_error(train_char, ["--resume", "--out_dir", str(tmp_path)],
                 f"no checkpoint in {tmp_path}", "run without --resume")
    code, _, stderr = run_main(train_char, ["--resume", "--out_dir", str(tmp_path)])
    assert "--force" not in stderr


def test_sample_says_which_checkpoint_it_read_and_how_fast(trained):
    out_dir, _ = trained
    code, stdout, stderr = run_main(sample, ["--out_dir", out_dir, "--threads", "1",
                                             "--max_new_tokens", "10"])
    assert code == 0, stderr
    newest = chardata.newest_checkpoint(out_dir)
    assert f"read {newest} (iteration 300)" in stderr
    assert re.search(r"10 tokens in [\d.]+ s, [\d,.]+ tokens/s", stderr), stderr
    assert "read " not in stdout and "tokens/s" not in stdout
    expect_error(sample, ["--init_from", os.path.join(out_dir, "nowhere")], "--init_from",
                 "no checkpoint at")
