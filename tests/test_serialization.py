"""mt.save / mt.load: safetensors round trips, atomic writes, damaged files."""
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
import safetensors.numpy

import microtensor as mt
from microtensor import nn
import microtensor.serialization as serialization


def _sample():
    rng = np.random.default_rng(0)
    return {
        "f32": mt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
        "f64": mt.from_numpy(rng.standard_normal(5)),
        "i64": mt.arange(-3, 9).reshape(3, 4),
        "bool": mt.from_numpy(rng.random((2, 2)) > 0.5),
        "scalar": mt.tensor(2.5),
        "empty": mt.zeros(0, 3),
        "np_i32": rng.integers(-5, 5, (4,)).astype(np.int32),
        "np_f16": rng.standard_normal(3).astype(np.float16),
    }


def _check_equal(loaded, original):
    assert set(loaded) == set(original)
    for key, value in original.items():
        expected = value.numpy() if isinstance(value, mt.Tensor) else value
        got = loaded[key]
        assert isinstance(got, mt.Tensor), key
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        np.testing.assert_array_equal(got.numpy(), expected)


def test_round_trip_dtypes_and_metadata(tmp_path):
    tensors = _sample()
    path = tmp_path / "a.safetensors"
    mt.save(tensors, path, metadata={"step": "12", "config": json.dumps({"n_layer": 2})})
    _check_equal(mt.load(path), tensors)
    loaded, metadata = mt.load(str(path), with_metadata=True)
    _check_equal(loaded, tensors)
    assert metadata == {"step": "12", "config": '{"n_layer": 2}'}
    mt.save({"x": mt.ones(2)}, path)
    assert mt.load(path, with_metadata=True)[1] == {}
    # loaded tensors are ordinary, writable tensors
    t = mt.load(path)["x"]
    t.add_(1.0)
    np.testing.assert_array_equal(t.numpy(), [2.0, 2.0])


def test_files_read_with_the_safetensors_package(tmp_path):
    tensors = _sample()
    path = tmp_path / "b.safetensors"
    mt.save(tensors, path)
    plain = safetensors.numpy.load_file(str(path))
    for key, value in tensors.items():
        np.testing.assert_array_equal(plain[key], value.numpy() if isinstance(value, mt.Tensor) else value)


def test_non_contiguous_tensors_saved_by_value(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"t": mt.from_numpy(base).T, "step": base[:, ::2], "neg": base[::-1],
               "big_endian": base.astype(">f4")}
    path = tmp_path / "c.safetensors"
    mt.save(tensors, path)
    loaded = mt.load(path)
    np.testing.assert_array_equal(loaded["t"].numpy(), base.T)
    np.testing.assert_array_equal(loaded["step"].numpy(), base[:, ::2])
    np.testing.assert_array_equal(loaded["neg"].numpy(), base[::-1])
    np.testing.assert_array_equal(loaded["big_endian"].numpy(), base)
    assert loaded["big_endian"].dtype == mt.float32
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(path))["t"], base.T)


def test_bad_arguments(tmp_path):
    path = tmp_path / "d.safetensors"
    with pytest.raises(TypeError, match="'step'"):
        mt.save({"x": mt.ones(1)}, path, metadata={"step": 3})
    # nested dicts and lists are checkpoints too (torch.save style); what they may hold
    # is limited to tensors, arrays, numbers, strings, bools and None
    with pytest.raises(TypeError, match="'w'"):
        mt.save({"w": [1.0, object()]}, path)
    with pytest.raises(TypeError, match="key"):
        mt.save({frozenset(): mt.ones(1)}, path)
    with pytest.raises(TypeError, match="complex"):
        mt.save({"c": np.ones(2, dtype=np.complex64)}, path)
    with pytest.raises(TypeError):
        mt.save([mt.ones(1), {1, 2}], path)
    assert not path.exists() and os.listdir(tmp_path) == []


def test_atomic_replace_and_no_leftovers(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    mt.save({"v": mt.ones(3)}, path)
    mt.save({"v": mt.full((3,), 2.0)}, path)          # overwrite
    np.testing.assert_array_equal(mt.load(path)["v"].numpy(), 2.0)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask

    # a writer that dies halfway leaves the old checkpoint untouched and no temp file
    def dying_writer(arrays, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(serialization.safetensors.numpy, "save_file", dying_writer)
    with pytest.raises(KeyboardInterrupt):
        mt.save({"v": mt.full((3,), 3.0)}, path)
    monkeypatch.undo()
    np.testing.assert_array_equal(mt.load(path)["v"].numpy(), 2.0)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        mt.load(tmp_path / "nope.safetensors")


def _valid_bytes():
    return safetensors.numpy.save({"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 2))},
                                  metadata={"k": "v"})


def _header(entries, data=b""):
    raw = json.dumps(entries).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _zip_bytes(tmp_path):
    zpath = tmp_path / "archive.zip"
    with zipfile.ZipFile(zpath, "w") as z:
        z.writestr("data.pkl", b"not really a pickle")
    return zpath.read_bytes()


DAMAGED = {
    "empty": lambda tmp: b"",
    "tiny": lambda tmp: b"\x01\x02\x03",
    "text": lambda tmp: b"This is a plain text file, not a checkpoint.\n" * 3,
    "zip": _zip_bytes,
    "random": lambda tmp: np.random.default_rng(0).bytes(4096),
    "huge_header_length": lambda tmp: (10 ** 12).to_bytes(8, "little") + b"{}",
    "truncated_data": lambda tmp: _valid_bytes()[:-7],
    "truncated_header": lambda tmp: _valid_bytes()[:20],
    "not_json": lambda tmp: (8).to_bytes(8, "little") + b"{not js}",
    "json_list": lambda tmp: _header([1, 2, 3]),
    "bad_dtype": lambda tmp: _header({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    "bad_shape": lambda tmp: _header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "wrong_size": lambda tmp: _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "past_end": lambda tmp: _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "overlapping": lambda tmp: _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                                       b"\0" * 12),
    "bad_metadata": lambda tmp: _header({"__metadata__": {"k": 3}}),
    "pickle": lambda tmp: pickle.dumps({"weight": [1.0] * 16}),
}


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_damaged_files_raise_value_error(kind, tmp_path):
    path = tmp_path / f"{kind}.safetensors"
    path.write_bytes(DAMAGED[kind](tmp_path))
    with pytest.raises(ValueError) as info:
        mt.load(path)
    assert str(path) in str(info.value)
    if kind in ("zip", "pickle", "text"):
        assert kind in str(info.value)


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 31, 40, 41, 100])
def test_a_truncated_file_names_the_true_byte_counts(cut, tmp_path):
    """Cut anywhere (in the data, at its start, into the header): the message's numbers
    are the file's, computed here from the intact file's layout."""
    whole = _valid_bytes()
    header_len = int.from_bytes(whole[:8], "little")
    header = json.loads(whole[8:8 + header_len])
    data_len = len(whole) - 8 - header_len
    path = tmp_path / "cut.safetensors"
    path.write_bytes(whole[:-cut])
    with pytest.raises(ValueError) as info:
        mt.load(path)
    message = str(info.value)
    if cut <= data_len:
        past = [v["data_offsets"][1] for k, v in header.items()
                if k != "__metadata__" and v["data_offsets"][1] > data_len - cut]
        assert any(f"ends at byte {end} of the data" in message for end in past), message
        assert f"holds only {data_len - cut} bytes of data" in message, message
    else:
        assert f"claims {header_len} bytes but only {len(whole) - cut - 8} bytes follow" in message, message


def test_model_checkpoint_round_trip(tmp_path):
    model = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 7, bias=False))
    model[2].weight = model[0].weight                      # tied, saved under both names
    path = tmp_path / "model.safetensors"
    mt.save(model.state_dict(), path)
    fresh = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 7, bias=False))
    fresh[2].weight = fresh[0].weight
    fresh.load_state_dict(mt.load(path))
    idx = mt.tensor([[1, 2, 6]])
    np.testing.assert_array_equal(fresh(idx).numpy(), model(idx).numpy())


def test_loads_into_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load_file

    layer = nn.Linear(3, 2)
    path = tmp_path / "linear.safetensors"
    mt.save(layer.state_dict(), path)
    theirs = torch.nn.Linear(3, 2)
    theirs.load_state_dict(torch_load_file(str(path)))
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(theirs(torch.from_numpy(x)).detach().numpy(),
                               layer(mt.from_numpy(x)).numpy(), rtol=1e-6)
