"""A nanoGPT-shaped port (tests/nanogpt_port.py, written with `import microtensor as torch`)
trains, checkpoints, resumes exactly and samples; the same file with its three import
lines switched to torch reaches the same losses from the same weights and batches."""
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import microtensor as mt

PORT = Path(__file__).with_name("nanogpt_port.py")
SWAP = {
    "import microtensor as torch": "import torch",
    "import microtensor.nn as nn": "import torch.nn as nn",
    "from microtensor.nn import functional as F": "from torch.nn import functional as F",
}


def load_port(framework):
    """The port as a fresh module; for torch, only the import lines differ."""
    source = PORT.read_text(encoding="utf-8")
    if framework == "torch":
        for ours, theirs in SWAP.items():
            assert source.count(ours) == 1, ours
            source = source.replace(ours, theirs)
    module = types.ModuleType(f"nanogpt_port_{framework}")
    module.__file__ = str(PORT)
    sys.modules[module.__name__] = module          # dataclasses look their module up
    exec(compile(source, str(PORT), "exec"), module.__dict__)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")   # tiny shapes (tests/conftest.py)


@pytest.fixture(scope="module")
def data():
    """Characters of Python's own help text (shipped with every Python), 90/10 split."""
    from pydoc_data.topics import topics
    text = "".join(topics[k] for k in sorted(topics))[:200_000]
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    return {"train": ids[:n], "val": ids[n:], "vocab_size": len(chars), "stoi": stoi}


def _missing_core_dialect():
    """What the port needs from the core beyond this file's own modules, as readable names."""
    missing = []
    checks = [
        ("mt.arange(..., device='cpu')", lambda: mt.arange(0, 3, dtype=mt.long, device="cpu")),
        ("mt.tensor(..., device='cpu')", lambda: mt.tensor([1], dtype=mt.long, device="cpu")),
        ("Tensor.to('cpu')", lambda: mt.zeros(1).to("cpu")),
        ("Module.to('cpu')", lambda: mt.nn.Linear(1, 1).to("cpu")),
        ("mt.float16 and mt.bfloat16 (nanoGPT's ptdtype table)", lambda: (mt.float16, mt.bfloat16)),
        ("f-string formatting of a 0-d tensor", lambda: f"{mt.tensor(1.5):.4f}"),
    ]
    for what, check in checks:
        try:
            check()
        except Exception as e:          # noqa: BLE001 - reported by name below
            missing.append(f"{what}: {type(e).__name__}: {e}")
    return missing


def test_core_dialect_the_port_needs():
    missing = _missing_core_dialect()
    assert not missing, "the core lacks:\n  " + "\n  ".join(missing)


@pytest.fixture(scope="module")
def port():
    missing = _missing_core_dialect()
    if missing:
        pytest.fail("the port cannot run; the core lacks:\n  " + "\n  ".join(missing))
    return load_port("microtensor")


def _params(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_trains_checkpoints_resumes_exactly_and_samples(port, data, tmp_path):
    log = []
    cfg = port.default_config(out_dir=str(tmp_path / "full"), max_iters=30)
    full, history = port.train(data, cfg, log=log.append)
    first, last = history["eval"][0], history["eval"][-1]
    assert first[0] == 0 and last[0] == 30
    # from ln(vocab) ~ 4.6 down by a clear margin in 30 steps
    assert first[2] > 4.0 and last[1] < first[1] - 0.8 and last[2] < first[2] - 0.8, history["eval"]
    assert any(line.startswith("step 30: train loss") for line in log)

    # stop at 20, then resume from the checkpoint to 30: identical to the straight run
    part_cfg = port.default_config(out_dir=str(tmp_path / "part"), max_iters=20)
    port.train(data, part_cfg)
    ckpt = mt.load(tmp_path / "part" / "ckpt.pt", map_location="cpu")
    assert ckpt["iter_num"] == 20 and isinstance(ckpt["config"], dict)
    assert ckpt["model_args"]["vocab_size"] == data["vocab_size"]
    assert isinstance(ckpt["best_val_loss"], mt.Tensor)
    assert len(ckpt["optimizer"]["param_groups"]) == 2
    resume_cfg = port.default_config(out_dir=str(tmp_path / "part"), max_iters=30,
                                     init_from="resume")
    resumed, _ = port.train(data, resume_cfg)
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # sample.py: load the checkpoint and generate with top_k
    start = [data["stoi"][c] for c in "def "]
    tokens, model_args = port.sample(resume_cfg, start, max_new_tokens=12, top_k=5)
    assert tokens[:4] == start and len(tokens) == 16
    assert all(0 <= t < data["vocab_size"] for t in tokens)
    assert model_args["vocab_size"] == data["vocab_size"]


def test_weight_decay_groups_and_attention_paths(port, data):
    mt.manual_seed(0)
    model = port.GPT(port.GPTConfig(vocab_size=data["vocab_size"], flash=True))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    # the tied embedding is counted once
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    # the masked_fill path gives the same logits as scaled_dot_product_attention
    slow = port.GPT(port.GPTConfig(vocab_size=data["vocab_size"], flash=False))
    slow.load_state_dict(model.state_dict(), strict=False)
    idx = mt.from_numpy(data["train"][:64].astype(np.int64).reshape(2, 32))
    np.testing.assert_allclose(slow(idx, idx)[0].detach().numpy(), model(idx, idx)[0].detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    model.crop_block_size(16)
    logits, _ = model(idx[:, :16])
    assert logits.shape == (2, 1, data["vocab_size"])


def test_same_losses_as_torch(port, data, tmp_path):
    torch = pytest.importorskip("torch")
    theirs = load_port("torch")
    cfg = port.default_config(out_dir=str(tmp_path / "mt"), max_iters=20, eval_interval=10)
    mt.manual_seed(0)
    init = _params(port.GPT(port.GPTConfig(vocab_size=data["vocab_size"], block_size=32,
                                           n_layer=2, n_head=2, n_embd=32)))
    _, ours = port.train(data, cfg, model_state=init)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tcfg = dict(cfg, out_dir=str(tmp_path / "torch"))
        _, reference = theirs.train(data, tcfg, model_state=init)
    finally:
        torch.set_num_threads(threads)
    # same weights, same batches, float32 both: the curves agree to rounding
    np.testing.assert_allclose(ours["train_loss"], reference["train_loss"], rtol=2e-4)
    for (step_a, tr_a, va_a), (step_b, tr_b, va_b) in zip(ours["eval"], reference["eval"]):
        assert step_a == step_b
        np.testing.assert_allclose([tr_a, va_a], [tr_b, va_b], rtol=2e-4)
    # and a checkpoint written by the torch run's structure loads the same way in both
    assert (tmp_path / "mt" / "ckpt.pt").exists() and (tmp_path / "torch" / "ckpt.pt").exists()
