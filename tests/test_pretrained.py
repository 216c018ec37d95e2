"""GPT.from_pretrained / save_pretrained against transformers' GPT-2 (the oracle): every
test builds its own small checkpoint with random weights, never the network."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import microtensor as mt
from models import GPT, GPTConfig, CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_model(dtype=torch.float32, seed=0, **options):
    """A small GPT2LMHeadModel with random weights; initializer_range 0.2 makes its
    logits spread, so greedy decoding does not hang on near ties."""
    config = dict(vocab_size=101, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                  initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    config.update(options)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).to(dtype).eval()
    with torch.no_grad():   # LayerNorms start at (1, 0): give them values of their own
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def saved(model, folder, **kw):
    model.save_pretrained(str(folder), **kw)
    return str(folder)


def tokens(seed=1, shape=(3, 17), vocab=101):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def hf_logits(model, idx):
    with torch.no_grad():
        return model(torch.tensor(idx)).logits.numpy()


def our_logits(model, idx):
    with mt.no_grad():
        return model(mt.from_numpy(idx))[0].numpy()


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [
    dict(),                                                           # GPT-2's own shape
    dict(tie_word_embeddings=False),
    dict(activation_function="gelu"),
    dict(activation_function="relu", n_inner=40),
    dict(activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-2, n_layer=3),
    dict(n_embd=24, n_head=3, n_positions=20, vocab_size=37),
])
def test_logits_equal_transformers(tmp_path, dtype, options):
    hf = hf_model(dtype, **options)
    model = GPT.from_pretrained(saved(hf, tmp_path))
    assert not model.training
    assert model.lm_head.weight.dtype == np.dtype(str(dtype).split(".")[1])
    assert (model.lm_head.weight is model.transformer.wte.weight) == \
        hf.config.tie_word_embeddings
    T = min(17, hf.config.n_positions)
    idx = tokens(shape=(3, T), vocab=hf.config.vocab_size)
    np.testing.assert_allclose(our_logits(model, idx), hf_logits(hf, idx), **TOLERANCE[dtype])


def test_dtype_converts_and_float64_matches_transformers_in_float64(tmp_path):
    hf = hf_model(torch.float32)
    folder = saved(hf, tmp_path)
    model = GPT.from_pretrained(folder, dtype=mt.float64)
    assert all(p.dtype == np.float64 for p in model.parameters())
    idx = tokens()
    np.testing.assert_allclose(our_logits(model, idx), hf_logits(hf.double(), idx),
                               rtol=1e-10, atol=1e-10)
    assert GPT.from_pretrained(folder, dtype="float32").lm_head.weight.dtype == np.float32
    with pytest.raises(TypeError, match="float32 or float64"):
        GPT.from_pretrained(folder, dtype=mt.int64)


def test_weights_without_the_transformer_prefix_and_one_file_beside_its_config(tmp_path):
    # GPT2Model (no head) writes h.0.attn..., wte.weight; tied, so the head is wte
    hf = hf_model()
    hf.transformer.save_pretrained(str(tmp_path / "base"))
    with open(tmp_path / "base" / "model.safetensors", "rb") as f:
        names = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert "wte.weight" in names and not any(n.startswith("transformer.") for n in names)
    idx = tokens()
    model = GPT.from_pretrained(str(tmp_path / "base" / "model.safetensors"))
    np.testing.assert_allclose(our_logits(model, idx), hf_logits(hf, idx), rtol=1e-5, atol=1e-5)


def test_the_causal_mask_buffers_of_older_checkpoints_are_skipped(tmp_path):
    import safetensors.numpy
    hf = hf_model()
    folder = saved(hf, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    arrays = safetensors.numpy.load_file(path)
    for i in range(2):
        arrays[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 48, 48), np.float32))
        arrays[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    safetensors.numpy.save_file(arrays, path, metadata={"format": "pt"})
    idx = tokens()
    np.testing.assert_allclose(our_logits(GPT.from_pretrained(folder), idx), hf_logits(hf, idx),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_checkpoints(tmp_path, tie):
    hf = hf_model(tie_word_embeddings=tie, vocab_size=300)
    folder = saved(hf, tmp_path, max_shard_size="20KB")
    shards = [n for n in os.listdir(folder) if n.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(folder)
    idx = tokens(vocab=300)
    np.testing.assert_allclose(our_logits(GPT.from_pretrained(folder), idx), hf_logits(hf, idx),
                               rtol=1e-5, atol=1e-5)
    os.remove(os.path.join(folder, sorted(shards)[-1]))
    with pytest.raises(CheckpointError, match=sorted(shards)[-1]):
        GPT.from_pretrained(folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_generation_equals_transformers_with_and_without_the_cache(tmp_path, dtype):
    hf = hf_model(dtype, n_positions=64)
    model = GPT.from_pretrained(saved(hf, tmp_path))
    prompt = tokens(seed=5, shape=(2, 7))
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompt), max_new_tokens=40, do_sample=False,
                               attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                               pad_token_id=0, eos_token_id=None).numpy()
    assert expected.shape == (2, 47) and len(np.unique(expected[:, 7:])) > 3  # not one token
    for use_cache in (True, False):
        out = model.generate(mt.from_numpy(prompt), 40, temperature=0, use_cache=use_cache)
        np.testing.assert_array_equal(out.numpy(), expected, err_msg=f"use_cache={use_cache}")


def test_sampling_with_a_seed_or_a_generator_repeats(tmp_path):
    model = GPT.from_pretrained(saved(hf_model(), tmp_path))
    prompt = mt.from_numpy(tokens(shape=(2, 3)))
    a = model.generate(prompt, 15, temperature=1.0, top_k=20, seed=7).numpy()
    b = model.generate(prompt, 15, temperature=1.0, top_k=20,
                       generator=mt.Generator().manual_seed(7)).numpy()
    c = model.generate(prompt, 15, temperature=1.0, top_k=20, seed=8).numpy()
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    with pytest.raises(ValueError, match="not both"):
        model.generate(prompt, 1, seed=1, generator=mt.Generator())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [dict(), dict(tie_word_embeddings=False),
                                     dict(activation_function="gelu", layer_norm_epsilon=1e-3,
                                          n_inner=48)])
def test_a_model_saved_here_loads_in_transformers_with_the_same_logits(tmp_path, dtype,
                                                                       options):
    hf = hf_model(dtype, **options)
    model = GPT.from_pretrained(saved(hf, tmp_path / "in"))
    with mt.no_grad():   # change every weight, so the file written is this model's own
        for p in model.parameters():
            p.copy_(p + 0.01 * mt.randn(*p.shape, dtype=p.dtype))
    model.save_pretrained(str(tmp_path / "out"))
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}
    assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [32, 96]   # Conv1D (in, out)
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"),
                                                         dtype=dtype).eval()
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert back.config.architectures == ["GPT2LMHeadModel"]
    idx = tokens()
    np.testing.assert_allclose(hf_logits(back, idx), our_logits(model, idx), **TOLERANCE[dtype])
    assert not np.allclose(hf_logits(back, idx), hf_logits(hf, idx), rtol=1e-3)  # new weights
    again = GPT.from_pretrained(str(tmp_path / "out"))
    np.testing.assert_array_equal(our_logits(again, idx), our_logits(model, idx))


def test_a_model_built_here_saves_and_one_gpt2_cannot_hold_is_refused(tmp_path):
    mt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16))
    model.save_pretrained(str(tmp_path / "plain"))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "plain")).eval()
    assert back.config.activation_function == "gelu"      # the exact GELU GPT uses
    idx = tokens(shape=(2, 9), vocab=50)
    np.testing.assert_allclose(hf_logits(back, idx), our_logits(model, idx), rtol=1e-5, atol=1e-5)
    for option, value in (("pos", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"),
                          ("prenorm", False), ("bias", False)):
        other = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16,
                              **{option: value}))
        with pytest.raises(CheckpointError, match=f"{option}="):
            other.save_pretrained(str(tmp_path / option))
        assert not os.path.exists(tmp_path / option / "model.safetensors")


@pytest.mark.parametrize("field, value", [
    ("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
    ("scale_attn_weights", False), ("add_cross_attention", True),
    ("activation_function", "quick_gelu"), ("activation_function", "swish"),
    ("model_type", "gpt_neo"), ("n_embd", 30), ("n_layer", 0), ("layer_norm_epsilon", -1),
    ("n_inner", "big"), ("tie_word_embeddings", "yes"), ("attn_pdrop", 1.5), ("n_ctx", 7),
])
def test_each_unsupported_config_field_is_an_error_naming_it(tmp_path, field, value):
    folder = saved(hf_model(), tmp_path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config[field] = value
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=field) as info:
        GPT.from_pretrained(folder)
    assert "\n" not in str(info.value)


def edit_weights(folder, edit):
    import safetensors.numpy
    path = os.path.join(folder, "model.safetensors")
    arrays = safetensors.numpy.load_file(path)
    edit(arrays)
    safetensors.numpy.save_file(arrays, path, metadata={"format": "pt"})


def test_missing_unexpected_and_wrong_shaped_keys_are_one_error_naming_each(tmp_path):
    folder = saved(hf_model(tie_word_embeddings=False), tmp_path)

    def damage(arrays):
        del arrays["transformer.h.1.mlp.c_fc.bias"]
        del arrays["lm_head.weight"]
        arrays["transformer.h.0.attn.extra"] = np.zeros(3, np.float32)
        # transposed: the shape Linear would have, not Conv1D's
        arrays["transformer.h.0.mlp.c_proj.weight"] = \
            np.ascontiguousarray(arrays["transformer.h.0.mlp.c_proj.weight"].T)
        arrays["transformer.wpe.weight"] = arrays["transformer.wpe.weight"][:10].copy()
    edit_weights(folder, damage)
    with pytest.raises(CheckpointError) as info:
        GPT.from_pretrained(folder)
    message = str(info.value)
    for name in ("missing: transformer.h.1.mlp.c_fc.bias, lm_head.weight",
                 "unexpected: transformer.h.0.attn.extra",
                 "transformer.h.0.mlp.c_proj.weight (32, 128) (config.json's shape gives "
                 "(128, 32))", "transformer.wpe.weight (10, 32)"):
        assert name in message, message


def test_a_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
    folder = saved(hf_model(), tmp_path)

    def untie(arrays):
        arrays["lm_head.weight"] = arrays["transformer.wte.weight"] + 1
    edit_weights(folder, untie)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        GPT.from_pretrained(folder)


def test_pickles_are_refused_and_nothing_is_unpickled(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_model().config.to_dict()))
    marker = tmp_path / "ran"
    # a pickle that would create `marker` if anything unpickled it
    import pickle

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*save_pretrained") as info:
        GPT.from_pretrained(str(folder))
    assert "never loads" in str(info.value) and not marker.exists()
    os.remove(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        GPT.from_pretrained(str(folder))


def test_weights_without_a_config_are_refused(tmp_path):
    folder = saved(hf_model(), tmp_path)
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(CheckpointError, match="no config.json"):
        GPT.from_pretrained(folder)


def test_a_damaged_weights_file_is_an_error_naming_it(tmp_path):
    folder = saved(hf_model(), tmp_path)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors"):
        GPT.from_pretrained(folder)


def test_a_missing_path_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        GPT.from_pretrained(str(tmp_path / "nowhere" / "x"))


# the folder this process imported microtensor and models from (a build in place, or an
# installed copy): a child gets it first on its path, and never runs from the repository's
# root, where the unbuilt source folders would hide an installed copy
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__)))


def run_python(code, **env):
    environment = {**os.environ, "PYTHONPATH": PACKAGE_ROOT, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=environment)    # cwd: the tests' scratch folder


def test_a_hub_name_without_the_hub_is_one_line_naming_the_command(tmp_path):
    # offline, with an empty cache: huggingface_hub cannot find it
    code = ("from models import GPT\n"
            "try:\n    GPT.from_pretrained('gpt2')\n"
            "except FileNotFoundError as e:\n    print('ERROR', e)\n")
    result = run_python(code, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 1 and "\n" not in lines[0], result.stdout + result.stderr
    assert "hf download gpt2 config.json model.safetensors" in lines[0]
    # and without huggingface_hub at all
    result = run_python("import sys; sys.modules['huggingface_hub'] = None\n" + code)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "huggingface_hub" in lines[0] and "hf download gpt2" in lines[0]


# ---- examples/train_char.py --init_from and sample.py --init_from ------------------------

def bpe_checkpoint(folder, text):
    """A tiny GPT-2 with a byte-level BPE trained (by the tokenizers package) on `text`:
    vocab.json + merges.txt beside config.json and model.safetensors."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=300, min_frequency=2, show_progress=False)
    folder.mkdir()
    bpe.save_model(str(folder))
    hf = hf_model(vocab_size=bpe.get_vocab_size(), n_positions=32, initializer_range=0.02)
    hf.save_pretrained(str(folder))
    return hf


def run_example(script, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [PACKAGE_ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep))})


def test_init_from_fine_tunes_and_writes_a_folder_transformers_loads(tmp_path):
    import models
    if not hasattr(models, "BPETokenizer"):
        pytest.skip("models.BPETokenizer (models/tokenizer.py) is not in this checkout")
    text = "".join(f"The {w} sat on the {v} mat, and the {v} {w} ran.\n"
                   for w in ("cat", "dog", "bird", "fox") for v in ("red", "big", "old")) * 40
    data = tmp_path / "data.txt"
    data.write_text(text)
    original = bpe_checkpoint(tmp_path / "tiny", text)
    out = tmp_path / "out"
    common = ["--init_from", str(tmp_path / "tiny"), "--data", str(data), "--out_dir", str(out),
              "--threads", "1", "--eval_interval", "3", "--eval_iters", "2", "--batch_size", "4",
              "--block_size", "16", "--sample_chars", "5"]
    result = run_example("train_char.py", *common, "--max_iters", "6", "--lr", "3e-3")
    assert result.returncode == 0, result.stderr
    evals = [ln for ln in result.stdout.splitlines() if ln.startswith("iter ")]
    assert len(evals) == 3 and all("elapsed" in ln for ln in evals), result.stdout
    assert "ETA" in evals[1] and "ETA" not in evals[-1]
    losses = [float(ln.split("val loss ")[1].split(",")[0]) for ln in evals]
    assert losses[-1] < losses[0], evals                  # it learns the text
    hf_dir = out / "hf"
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= set(os.listdir(hf_dir))

    # the folder loads in transformers and here, with the same logits, and is not the original
    tuned = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    mine = GPT.from_pretrained(str(hf_dir))
    idx = tokens(vocab=tuned.config.vocab_size, shape=(2, 16))
    np.testing.assert_allclose(our_logits(mine, idx), hf_logits(tuned, idx), rtol=1e-5, atol=1e-5)
    assert not np.allclose(hf_logits(tuned, idx), hf_logits(original, idx), atol=1e-3)
    # and it is the best checkpoint's model: ckpt_best holds the same weights
    import safetensors.numpy
    best = safetensors.numpy.load_file(str(out / "ckpt_best.safetensors"))
    np.testing.assert_array_equal(mine.transformer.h[0].attn.c_attn.weight.numpy(),
                                  best["transformer.h.0.attn.c_attn.weight"])


def test_resume_continues_a_fine_tune_and_sample_reads_it(tmp_path):
    import models
    if not hasattr(models, "BPETokenizer"):
        pytest.skip("models.BPETokenizer (models/tokenizer.py) is not in this checkout")
    text = "one two three four five six seven eight nine ten.\n" * 200
    data = tmp_path / "data.txt"
    data.write_text(text)
    bpe_checkpoint(tmp_path / "tiny", text)
    out = str(tmp_path / "out")
    common = ["--data", str(data), "--out_dir", out, "--threads", "1", "--eval_interval", "2",
              "--eval_iters", "1", "--batch_size", "2", "--block_size", "8", "--sample_chars", "0",
              "--lr_decay_iters", "4"]
    straight = str(tmp_path / "straight")
    a = run_example("train_char.py", "--init_from", str(tmp_path / "tiny"), *common,
                    "--max_iters", "4", "--out_dir", straight)
    b1 = run_example("train_char.py", "--init_from", str(tmp_path / "tiny"), *common,
                     "--max_iters", "2")
    b2 = run_example("train_char.py", *common, "--max_iters", "4", "--resume")
    for r in (a, b1, b2):
        assert r.returncode == 0, r.stderr
    import csv
    rows = [list(csv.DictReader(open(os.path.join(d, "metrics.csv")))) for d in (straight, out)]
    assert [r["val_loss"] for r in rows[0]] == [r["val_loss"] for r in rows[1]]
    # resuming compares a shape option with the pretrained model's own
    bad = run_example("train_char.py", *common, "--max_iters", "6", "--resume",
                      "--n_embd", "64")
    assert bad.returncode == 2 and "n_embd=32" in bad.stderr, bad.stderr
    # the model's shape is the checkpoint's: a shape option is refused
    bad = run_example("train_char.py", "--init_from", str(tmp_path / "tiny"), *common,
                      "--out_dir", str(tmp_path / "x"), "--n_layer", "3")
    assert bad.returncode == 2 and "--n_layer" in bad.stderr and "config.json" in bad.stderr
    # sample.py reads the fine-tuned checkpoint and the hf/ folder, and says which it read
    for args in (["--out_dir", out], ["--init_from", os.path.join(out, "hf")]):
        s = run_example("sample.py", *args, "--prompt", "one two", "--max_new_tokens", "6",
                        "--threads", "1", "--temperature", "0")
        assert s.returncode == 0, s.stderr
        assert s.stdout.startswith("one two")
        assert "read " in s.stderr and "tokens/s" in s.stderr, s.stderr
