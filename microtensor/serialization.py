"""Checkpoints: mt.save / mt.load in the safetensors format (no pickle, nothing executable).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the raw bytes of every tensor. Files are written by the `safetensors` package
(so anything that reads safetensors reads them) and replaced atomically: a crash
mid-save leaves the previous checkpoint intact. Before a file is handed to the
reader, its header is checked here, so a damaged or foreign file gives a ValueError
that says what is wrong.
"""
import json
import math
import os
import secrets
from collections.abc import Mapping

import numpy as np
import safetensors.numpy

from microtensor._core import Tensor, from_numpy

__all__ = ["save", "load"]

# safetensors' dtype names and the numpy dtypes microtensor can hold
_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
}
_SAVABLE = set(_DTYPES.values())
_MAX_HEADER = 100_000_000     # the safetensors reader's own limit


def _as_array(key, value):
    if isinstance(value, Tensor):
        array = value._data
    elif isinstance(value, np.ndarray):
        array = value
    else:
        raise TypeError(f"mt.save: tensors['{key}'] is a {type(value).__name__}; expected a "
                        "Tensor or a numpy array")
    if array.dtype.newbyteorder("=") not in _SAVABLE:
        raise TypeError(f"mt.save: tensors['{key}'] has dtype {array.dtype}, which safetensors "
                        "cannot store (use bool, integer or float16/32/64 dtypes)")
    # NOTE: the writer copies raw memory from the data pointer, so a strided view
    # (a transpose, a slice with a step) must be made contiguous first
    if not array.flags.c_contiguous or not array.dtype.isnative:
        array = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
    return array


def save(tensors, path, metadata=None):
    """Write `tensors` (name -> Tensor or numpy array) to `path` as safetensors, with
    optional `metadata` (str -> str). The file is written to a temporary name in the
    same directory, flushed to disk, then renamed over `path`."""
    path = os.fspath(path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"mt.save expects a dict of name -> tensor, got {type(tensors).__name__}")
    arrays = {}
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"mt.save: tensor names must be str, got {key!r}")
        if key == "__metadata__":
            raise ValueError("mt.save: '__metadata__' is reserved by the format; pass "
                             "metadata= instead")
        arrays[key] = _as_array(key, value)
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"mt.save: metadata must be a dict of str -> str, got "
                            f"{type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str):
                raise TypeError(f"mt.save: metadata keys must be str, got {key!r}")
            if not isinstance(value, str):
                raise TypeError(f"mt.save: metadata['{key}'] is a {type(value).__name__}; "
                                "metadata values must be str (json.dumps other values)")
        metadata = dict(metadata)

    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # created with O_EXCL and mode 0o666, so the umask applies as for any new file;
    # NOTE: the writer recreates the file as 0o600, so that mode is put back after it
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = os.stat(tmp).st_mode & 0o777
        safetensors.numpy.save_file(arrays, tmp, metadata=metadata)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:                              # make the rename itself durable (best effort)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _damaged(path, what):
    return ValueError(f"{path} is not a valid safetensors checkpoint: {what}")


def _guess_kind(prefix):
    """What a file that is not safetensors probably is, from its first bytes."""
    if prefix.startswith(b"PK\x03\x04"):
        return "it is a zip archive, such as a torch.save checkpoint; microtensor never unpickles"
    if prefix[:1] == b"\x80":
        return "it looks like a pickle, which microtensor never loads"
    if all(32 <= c < 127 or c in (9, 10, 13) for c in prefix):
        return "it looks like a text file"
    return "truncated, or not a safetensors file"


def _read_header(path):
    """Check the header of `path` and return (entries, metadata), entries in file order."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _damaged(path, f"the file is {size} bytes long, too short to hold the 8-byte "
                                 "header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise _damaged(path, f"the header claims {header_len} bytes but only {size - 8} "
                                 f"bytes follow ({_guess_kind(prefix)})")
        if header_len > _MAX_HEADER:
            raise _damaged(path, f"the header length {header_len} is over the format's limit")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(path, f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(path, f"the header is a JSON {type(header).__name__}, not an object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _damaged(path, "__metadata__ must map strings to strings")

    data_len = size - 8 - header_len
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _damaged(path, f"the entry for '{name}' is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise _damaged(path, f"tensor '{name}' has dtype {dtype!r}, which microtensor "
                                 f"cannot hold (supported: {', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise _damaged(path, f"tensor '{name}' has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise _damaged(path, f"tensor '{name}' has bad data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise _damaged(path, f"tensor '{name}' of dtype {dtype} and shape {tuple(shape)} "
                                 f"needs {nbytes} bytes, but its data_offsets are {offsets}")
        if end > data_len:
            raise _damaged(path, f"tensor '{name}' ends at byte {end} of the data, but the file "
                                 f"holds only {data_len} bytes of data (truncated?)")
        entries.append((begin, name))
    entries.sort()
    return [name for _, name in entries], metadata


def load(path, with_metadata=False):
    """Read a safetensors file: name -> Tensor, or (tensors, metadata) with
    `with_metadata=True`. A missing file raises FileNotFoundError; a damaged or foreign
    file raises ValueError naming the file and the problem."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory (expected a .safetensors file)", path)
    names, metadata = _read_header(path)
    try:
        arrays = safetensors.numpy.load_file(path)
    except Exception as e:   # the reader's SafetensorError and friends
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    tensors = {}
    for name in names:
        array = arrays[name]
        if not array.flags.writeable:
            array = array.copy()
        tensors[name] = from_numpy(array)
    if with_metadata:
        return tensors, dict(metadata)
    return tensors
