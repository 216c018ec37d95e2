"""mt.save / mt.load of torch.save-style checkpoints (nested dicts, lists, numbers, optimizer
state), map_location, and the edges: temp files of killed saves, FIFOs, devices, symlink
loops, hostile nesting."""
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import safetensors.numpy

import microtensor as mt
from microtensor import nn
import microtensor.serialization as serialization


def _model():
    mt.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 11))


def _train_steps(model, opt, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = mt.tensor(rng.integers(0, 11, (4, 5)))
        loss = nn.functional.cross_entropy(model(idx).view(-1, 11), idx.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return mt.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))


def test_nanogpt_checkpoint_round_trip_and_resume(tmp_path):
    model = _model()
    opt = _optimizer(model)
    _train_steps(model, opt, 3, seed=1)
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "model_args": {"n_layer": 2, "n_head": 2, "bias": False, "dropout": 0.0, "vocab_size": None},
        "iter_num": 5,
        "best_val_loss": mt.tensor(1.25),
        "config": {"out_dir": "out", "learning_rate": 6e-4, "decay_lr": True, "betas": (0.9, 0.95)},
    }
    path = tmp_path / "ckpt.pt"
    mt.save(checkpoint, path)
    loaded = mt.load(path, map_location="cpu")

    assert set(loaded) == set(checkpoint)
    assert loaded["model_args"] == checkpoint["model_args"]
    assert loaded["config"] == checkpoint["config"]
    assert isinstance(loaded["config"]["betas"], tuple)
    assert loaded["iter_num"] == 5 and type(loaded["iter_num"]) is int
    assert isinstance(loaded["best_val_loss"], mt.Tensor) and loaded["best_val_loss"].item() == 1.25
    assert list(loaded["model"]) == list(checkpoint["model"])
    for k, v in checkpoint["model"].items():
        np.testing.assert_array_equal(loaded["model"][k].numpy(), v.numpy())
    osd = loaded["optimizer"]
    assert set(osd["state"]) == set(checkpoint["optimizer"]["state"])
    assert all(type(k) is int for k in osd["state"])
    assert osd["param_groups"][0]["betas"] == (0.9, 0.95)
    assert osd["param_groups"][1]["weight_decay"] == 0.0

    # resume: a fresh model and optimizer restored from the file continue exactly as the
    # original does
    fresh = _model()
    fresh.load_state_dict(loaded["model"])
    fresh_opt = _optimizer(fresh)
    fresh_opt.load_state_dict(loaded["optimizer"])
    _train_steps(model, opt, 2, seed=7)
    _train_steps(fresh, fresh_opt, 2, seed=7)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


def test_values_keep_their_types(tmp_path):
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    obj = {
        "list": [1, 2.5, "three", None, True, [mt.ones(2), {"deep": (1, (2, 3))}]],
        "floats": [math.inf, -math.inf, math.nan, 1e300, -0.0],
        "big_int": 2 ** 70,
        "array": arr,
        "np_scalar": np.float32(1.5),
        "np_int": np.int64(-4),
        (1, "a"): "tuple key",
        7: "int key",
        None: "none key",
        "param": nn.Parameter(mt.ones(3)),
        "grad_leaf": mt.zeros(2, requires_grad=True),
        "strided": mt.from_numpy(np.arange(12.0).reshape(3, 4)).T,
        "empty": [], "empty_dict": {},
    }
    path = tmp_path / "values.ckpt"
    mt.save(obj, path)
    got = mt.load(path)
    assert got["list"][:5] == [1, 2.5, "three", None, True]
    assert isinstance(got["list"][5][0], mt.Tensor)
    assert got["list"][5][1] == {"deep": (1, (2, 3))}
    f = got["floats"]
    assert f[0] == math.inf and f[1] == -math.inf and math.isnan(f[2]) and f[3] == 1e300
    assert math.copysign(1.0, f[4]) == -1.0
    assert got["big_int"] == 2 ** 70
    assert isinstance(got["array"], np.ndarray) and got["array"].dtype == np.int32
    np.testing.assert_array_equal(got["array"], arr)
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == 1.5
    assert type(got["np_int"]) is np.int64 and got["np_int"] == -4
    assert got[(1, "a")] == "tuple key" and got[7] == "int key" and got[None] == "none key"
    assert isinstance(got["param"], nn.Parameter) and got["param"].requires_grad
    assert got["grad_leaf"].requires_grad and got["grad_leaf"].is_leaf
    np.testing.assert_array_equal(got["strided"].numpy(), np.arange(12.0).reshape(3, 4).T)
    assert got["empty"] == [] and got["empty_dict"] == {}


def test_roots_that_are_not_dicts(tmp_path):
    path = tmp_path / "x.ckpt"
    mt.save(mt.arange(5), path)
    t = mt.load(path)
    assert isinstance(t, mt.Tensor) and t.tolist() == [0, 1, 2, 3, 4]
    mt.save([mt.ones(2), 3], path)
    got = mt.load(path)
    assert isinstance(got, list) and got[1] == 3 and got[0].tolist() == [1.0, 1.0]
    mt.save(4.5, path)
    assert mt.load(path) == 4.5


def test_nested_files_are_plain_safetensors_with_path_names(tmp_path):
    path = tmp_path / "n.ckpt"
    mt.save({"model": {"w": mt.ones(2, 3)}, "opt": {"state": {0: {"m": mt.zeros(3)}}}, "step": 3},
            path, metadata={"note": "hi"})
    plain = safetensors.numpy.load_file(str(path))
    assert sorted(plain) == ["model/w", "opt/state/0/m"]
    obj, metadata = mt.load(path, with_metadata=True)
    assert metadata == {"note": "hi"} and obj["step"] == 3


def test_flat_dicts_are_written_as_before(tmp_path):
    path = tmp_path / "flat.safetensors"
    tensors = {"a": mt.ones(2), "b": np.zeros(3, dtype=np.float64)}
    mt.save(tensors, path)
    _, metadata = mt.load(path, with_metadata=True)
    assert metadata == {}                       # no structure key: any reader sees names
    assert sorted(safetensors.numpy.load_file(str(path))) == ["a", "b"]
    loaded = mt.load(path)
    assert all(isinstance(v, mt.Tensor) for v in loaded.values())


def test_file_objects(tmp_path):
    buf = io.BytesIO()
    mt.save({"x": mt.ones(2), "n": 3}, buf)
    buf.seek(0)
    got = mt.load(buf)
    assert got["n"] == 3 and got["x"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="not a valid"):
        mt.load(io.BytesIO(b"\x00" * 3))


def test_map_location(tmp_path):
    path = tmp_path / "m.ckpt"
    mt.save({"w": mt.ones(2), "i": 1}, path)
    for where in (None, "cpu", {"cuda:0": "cpu"}, lambda storage, loc: storage):
        assert mt.load(path, map_location=where)["w"].tolist() == [1.0, 1.0]
    for where in ("cuda", "cuda:1", "mps", {"cpu": "cuda:0"}):
        with pytest.raises(RuntimeError, match="cuda|mps"):
            mt.load(path, map_location=where)
    assert mt.load(path, weights_only=True)["i"] == 1
    # microtensor's device object, as nanoGPT passes map_location=device
    assert mt.load(path, map_location=mt.device("cpu"))["i"] == 1


def test_objects_a_checkpoint_cannot_hold(tmp_path):
    path = tmp_path / "bad.ckpt"
    with pytest.raises(TypeError, match=r"obj\['cfg'\]\['fn'\]"):
        mt.save({"cfg": {"fn": print}}, path)
    loop = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="cycle"):
        mt.save({"loop": loop}, path)
    deep = []
    for _ in range(500):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        mt.save(deep, path)
    with pytest.raises(ValueError, match="reserved"):
        mt.save({"a": 1}, path, metadata={"microtensor.structure": "{}"})
    assert os.listdir(tmp_path) == []


def _write_nested(path, structure):
    data = safetensors.numpy.save({"t": np.ones(2, dtype=np.float32)},
                                  metadata={"microtensor.structure": structure})
    path.write_bytes(data)


@pytest.mark.parametrize("structure", [
    '{"format": "microtensor.checkpoint/1", "root": {"tensor": "missing"}}',
    '{"format": "microtensor.checkpoint/9", "root": 1}',
    '{"format": "microtensor.checkpoint/1"}',
    '{"format": "microtensor.checkpoint/1", "root": {"dict": [[[1], 2]]}}',
    '{"format": "microtensor.checkpoint/1", "root": {"what": 1}}',
    '{"format": "microtensor.checkpoint/1", "root": ' + "[" * 300 + "]" * 300 + "}",
    '{"format": "microtensor.checkpoint/1", "root": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "not json",
])
def test_damaged_structure_is_a_value_error_naming_the_file(tmp_path, structure):
    path = tmp_path / "damaged.ckpt"
    _write_nested(path, structure)
    with pytest.raises(ValueError) as info:
        mt.load(path)
    assert str(path) in str(info.value)


def test_deeply_nested_header_is_a_value_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    raw = ("[" * 100_000 + "]" * 100_000).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(ValueError, match="nested too deeply") as info:
        mt.load(path)
    assert str(path) in str(info.value)


def test_fifo_and_devices_are_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = {}

    def attempt():
        try:
            mt.load(fifo)
        except Exception as e:          # noqa: BLE001 - the class is checked below
            result["error"] = e

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():               # unblock the reader so the test run can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("mt.load of a FIFO blocked")
    assert isinstance(result["error"], ValueError) and "FIFO" in str(result["error"])
    with pytest.raises(ValueError, match="character device"):
        mt.load("/dev/zero")


def test_symlink_loop_is_named(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    os.symlink(b, a)
    os.symlink(a, b)
    with pytest.raises(OSError, match="symbolic links|symlink") as info:
        mt.load(a)
    assert info.value.errno == 40 or "loop" in str(info.value)
    assert not isinstance(info.value, FileNotFoundError)


def test_killed_save_leaves_a_temp_file_that_the_next_save_removes(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    mt.save({"v": mt.ones(3)}, path)
    # a child process dies by SIGKILL in the middle of writing (no cleanup can run)
    child = f"""
import os, signal, sys
import numpy as np
import microtensor as mt, microtensor.serialization as s
def dying(arrays, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"x" * 100000)
    os.kill(os.getpid(), signal.SIGKILL)
s.safetensors.numpy.save_file = dying
mt.save({{"v": mt.zeros(3)}}, sys.argv[1])
"""
    proc = subprocess.run([sys.executable, "-c", child, str(path)], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.safetensors.")
    # a temp file of a live process (this one) is never touched
    live = tmp_path / f".ckpt.safetensors.{serialization._host_tag()}.{os.getpid()}.abcd.tmp"
    live.write_bytes(b"in progress")
    mt.save({"v": mt.full((3,), 2.0)}, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.safetensors", live.name])
    np.testing.assert_array_equal(mt.load(path)["v"].numpy(), 2.0)


def test_temp_names_are_per_process(tmp_path, monkeypatch):
    seen = []
    real = serialization.safetensors.numpy.save_file

    def spy(arrays, filename, metadata=None):
        seen.append(os.path.basename(filename))
        return real(arrays, filename, metadata=metadata)

    monkeypatch.setattr(serialization.safetensors.numpy, "save_file", spy)
    mt.save({"v": mt.ones(1)}, tmp_path / "c.st")
    mt.save({"v": mt.ones(1)}, tmp_path / "c.st")
    assert len(set(seen)) == 2
    assert all(f".{os.getpid()}." in name for name in seen)


def test_same_structure_as_torch_load(tmp_path):
    torch = pytest.importorskip("torch")
    sd = {"w": np.ones((2, 2), dtype=np.float32)}
    ours = {"model": {k: mt.tensor(v) for k, v in sd.items()}, "iter_num": 3,
            "args": {"bias": False, "dims": [1, 2], "pair": (0.9, 0.95), "none": None}}
    theirs = {"model": {k: torch.tensor(v) for k, v in sd.items()}, "iter_num": 3,
              "args": {"bias": False, "dims": [1, 2], "pair": (0.9, 0.95), "none": None}}
    mt.save(ours, tmp_path / "a")
    torch.save(theirs, tmp_path / "b")
    a, b = mt.load(tmp_path / "a"), torch.load(tmp_path / "b", map_location="cpu")

    def shape_of(x):
        if isinstance(x, dict):
            return {k: shape_of(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x).__name__, [shape_of(v) for v in x]
        if isinstance(x, (mt.Tensor, torch.Tensor)):
            return ("tensor", tuple(x.shape), x.numpy().tolist())
        return type(x).__name__, x

    assert shape_of(a) == shape_of(b)
    assert json.dumps(str(shape_of(a)))
