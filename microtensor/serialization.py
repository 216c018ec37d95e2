"""Checkpoints: mt.save / mt.load in the safetensors format (no pickle, nothing executable).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the raw bytes of every tensor. Files are written by the `safetensors` package
(so anything that reads safetensors reads them) and replaced atomically: a crash
mid-save leaves the previous checkpoint intact. Before a file is handed to the
reader, its header is checked here, so a damaged or foreign file gives a ValueError
that says what is wrong.

Two layouts share the format:
- a flat dict of name -> Tensor or numpy array is written as it is (any safetensors
  reader sees the same names);
- anything else torch.save takes that is made of dicts, lists, tuples, tensors, numpy
  arrays, numbers, strings, bools and None (nanoGPT's {'model': sd, 'optimizer': osd,
  'iter_num': 5, ...}) is written with its tensors flattened under path-like names
  ("model/transformer.wte.weight", "optimizer/state/0/exp_avg") and the structure as
  JSON in the metadata under "microtensor.structure" (see `_encode` for its nodes).

Temporary files are named `.{name}.{host}.{pid}.{random}.tmp` beside the target. A
save that fails removes its own; a process killed mid-save (SIGKILL, power loss)
cannot, so the next save to the same path removes the ones whose process is gone.
"""
import contextlib
import errno
import hashlib
import json
import math
import os
import secrets
import socket
import stat
from collections.abc import Mapping

import numpy as np
import safetensors.numpy

from microtensor.core._core import Tensor, Parameter, from_numpy

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
_STRUCTURE_KEY = "microtensor.structure"
_FORMAT = "microtensor.checkpoint/1"
_MAX_DEPTH = 100              # nesting of dicts/lists a checkpoint may have


# ---- turning an object into arrays + a JSON structure --------------------------------

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


def _is_flat(obj):
    """A dict of str -> Tensor/ndarray: the layout every safetensors reader understands."""
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, (Tensor, np.ndarray)) for k, v in obj.items())


def _where(path):
    return "obj" + "".join(f"[{p!r}]" for p in path)


class _Encoder:
    """obj -> JSON node, collecting arrays. Nodes: JSON null/bool/int/str as themselves,
    a finite float as itself, a list as a JSON array, and one-key objects for the rest:
    {"dict": [[key, value], ...]} (keys keep their type), {"tuple": [...]},
    {"float": "nan"|"inf"|"-inf"}, {"tensor": name} (+ "requires_grad", "parameter"),
    {"ndarray": name}, {"numpy_scalar": name}."""

    def __init__(self):
        self.arrays = {}
        self._open = set()       # ids of the containers on the current path (cycles)

    def _name(self, path):
        name = "/".join(str(p) for p in path) or "root"
        base, n = name, 1
        while name in self.arrays or name == "__metadata__":
            name = f"{base}#{n}"
            n += 1
        return name

    def _array(self, path, value):
        name = self._name(path)
        self.arrays[name] = _as_array(_where(path), value)
        return name

    def encode(self, obj, path=(), key=False):
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, tuple):
            return {"tuple": self._items(obj, path, key)}
        if key:
            raise TypeError(f"mt.save: a dict key in {_where(path)} is a {type(obj).__name__}; "
                            "keys must be str, int, float, bool, None or tuples of them")
        if isinstance(obj, Tensor):
            node = {"tensor": self._array(path, obj)}
            if obj.requires_grad:
                node["requires_grad"] = True
            if isinstance(obj, Parameter):
                node["parameter"] = True
            return node
        if isinstance(obj, np.ndarray):
            return {"ndarray": self._array(path, obj)}
        if isinstance(obj, np.generic) and not isinstance(obj, np.void):
            return {"numpy_scalar": self._array(path, np.asarray(obj))}
        if isinstance(obj, Mapping):
            with self._entered(obj, path):
                return {"dict": [[self.encode(k, path, key=True), self.encode(v, path + (k,))]
                                 for k, v in obj.items()]}
        if isinstance(obj, list):
            return self._items(obj, path, key)
        raise TypeError(f"mt.save: {_where(path)} is a {type(obj).__name__}; checkpoints hold "
                        "tensors, numpy arrays, numbers, strings, bools, None and dicts, "
                        "lists and tuples of them")

    def _items(self, seq, path, key):
        with self._entered(seq, path):
            return [self.encode(v, path + (i,), key) for i, v in enumerate(seq)]

    @contextlib.contextmanager
    def _entered(self, container, path):
        if id(container) in self._open:
            raise ValueError(f"mt.save: {_where(path)} contains itself (a cycle)")
        if len(path) >= _MAX_DEPTH:
            raise ValueError(f"mt.save: the object is nested more than {_MAX_DEPTH} levels "
                             f"deep at {_where(path[:4])}...")
        self._open.add(id(container))
        try:
            yield
        finally:
            self._open.discard(id(container))


def _decode(node, arrays, label, map_tensor):
    """JSON node -> object (the inverse of _Encoder.encode). Depth-limited, so a hostile
    structure cannot exhaust the stack; every problem is a ValueError naming the file."""

    def bad(what):
        return _damaged(label, f"the checkpoint structure is damaged: {what}")

    def array(name):
        if not isinstance(name, str) or name not in arrays:
            raise bad(f"it names a tensor {name!r} that the file does not hold")
        return arrays[name]

    def walk(node, depth, hashable=False):
        if depth > _MAX_DEPTH + 2:
            raise bad(f"it is nested more than {_MAX_DEPTH} levels deep")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            if hashable:
                raise bad("a list is used as a dict key")
            return [walk(v, depth + 1) for v in node]
        if not isinstance(node, dict) or len(node) == 0:
            raise bad(f"unexpected node {str(node)[:60]}")
        kind = next(iter(node))
        value = node[kind]
        if kind == "tuple" and isinstance(value, list):
            return tuple(walk(v, depth + 1, hashable) for v in value)
        if kind == "float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if hashable:
            raise bad(f"a {kind!r} node is used as a dict key")
        if kind == "dict" and isinstance(value, list):
            out = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2):
                    raise bad("a dict entry is not a [key, value] pair")
                out[walk(item[0], depth + 1, True)] = walk(item[1], depth + 1)
            return out
        if kind == "tensor":
            t = from_numpy(array(value))
            if node.get("parameter") is True:
                t = Parameter(t, requires_grad=bool(node.get("requires_grad")))
            elif node.get("requires_grad") is True:
                t.requires_grad_(True)
            return map_tensor(t)
        if kind == "ndarray":
            return array(value)
        if kind == "numpy_scalar":
            return array(value)[()]
        raise bad(f"unknown node {kind!r}")

    return walk(node, 0)


# ---- writing -------------------------------------------------------------------------

def _host_tag():
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True                   # someone else's process, or we cannot tell: keep
    return True


def _remove_stale_temps(directory, basename):
    """Delete `.{basename}.{host}.{pid}.*.tmp` left by processes of this host that are gone."""
    prefix, host = f".{basename}.", _host_tag()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix):-len(".tmp")].split(".")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and not _pid_alive(pid):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def save(obj, path, metadata=None):
    """Write `obj` to `path` (or a binary file object) as safetensors, with optional
    `metadata` (str -> str). `obj` is a dict of name -> Tensor/numpy array (written as
    plain safetensors), or any nesting of dicts, lists and tuples of tensors, numpy
    arrays, numbers, strings, bools and None (torch.save's checkpoints). The file is
    written to a temporary name in the same directory, flushed to disk, then renamed
    over `path`."""
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
            if key == _STRUCTURE_KEY:
                raise ValueError(f"mt.save: metadata key '{key}' is reserved")
        metadata = dict(metadata)

    if _is_flat(obj):
        arrays = {}
        for key, value in obj.items():
            if key == "__metadata__":
                raise ValueError("mt.save: '__metadata__' is reserved by the format; pass "
                                 "metadata= instead")
            arrays[key] = _as_array(key, value)
    else:
        encoder = _Encoder()
        root = encoder.encode(obj)
        arrays = encoder.arrays
        metadata = dict(metadata or {})
        metadata[_STRUCTURE_KEY] = json.dumps({"format": _FORMAT, "root": root},
                                              separators=(",", ":"))

    if hasattr(path, "write") and not isinstance(path, (str, bytes, os.PathLike)):
        path.write(safetensors.numpy.save(arrays, metadata=metadata))
        return
    _write_atomically(arrays, metadata, os.fspath(path))


def _write_atomically(arrays, metadata, path):
    directory = os.path.dirname(os.path.abspath(path))
    basename = os.path.basename(path)
    _remove_stale_temps(directory, basename)
    tmp = os.path.join(directory, f".{basename}.{_host_tag()}.{os.getpid()}."
                                  f"{secrets.token_hex(4)}.tmp")
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


# ---- reading -------------------------------------------------------------------------

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


def _json(raw, label, what):
    try:
        return json.loads(raw)
    except RecursionError:
        # NOTE: json's parser recurses once per nesting level; a hostile header of
        # 100,000 '[' would otherwise surface as RecursionError
        raise _damaged(label, f"{what} is nested too deeply to be a checkpoint") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(label, f"{what} is not valid JSON ({e})") from None


def _parse_header(f, size, label):
    """Check the header read from the binary file `f` of `size` bytes and return
    (names in file order, metadata)."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _damaged(label, f"the file is {size} bytes long, too short to hold the 8-byte "
                              "header length")
    header_len = int.from_bytes(prefix, "little")
    if header_len > size - 8:
        raise _damaged(label, f"the header claims {header_len} bytes but only {size - 8} "
                              f"bytes follow ({_guess_kind(prefix)})")
    if header_len > _MAX_HEADER:
        raise _damaged(label, f"the header length {header_len} is over the format's limit")
    raw = f.read(header_len)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _damaged(label, f"the header is not valid JSON ({e})") from None
    header = _json(text, label, "the header")
    if not isinstance(header, dict):
        raise _damaged(label, f"the header is a JSON {type(header).__name__}, not an object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _damaged(label, "__metadata__ must map strings to strings")

    data_len = size - 8 - header_len
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _damaged(label, f"the entry for '{name}' is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise _damaged(label, f"tensor '{name}' has dtype {dtype!r}, which microtensor "
                                  f"cannot hold (supported: {', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise _damaged(label, f"tensor '{name}' has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise _damaged(label, f"tensor '{name}' has bad data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise _damaged(label, f"tensor '{name}' of dtype {dtype} and shape {tuple(shape)} "
                                  f"needs {nbytes} bytes, but its data_offsets are {offsets}")
        if end > data_len:
            raise _damaged(label, f"tensor '{name}' ends at byte {end} of the data, but the "
                                  f"file holds only {data_len} bytes of data (truncated?)")
        entries.append((begin, name))
    entries.sort()
    return [name for _, name in entries], metadata


_FILE_KINDS = [(stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]


def _check_regular(path):
    """os.stat before any open: a FIFO would block open() forever, a device would be
    read without end. Symlinks are followed; a loop raises OSError(ELOOP)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "Too many levels of symbolic links (a symlink loop)",
                          path) from None
        raise
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory (expected a .safetensors file)",
                                path)
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise ValueError(f"{path} is {kind}, not a regular file; mt.load reads checkpoint "
                         "files")


def _map_location(map_location):
    """A function applied to each loaded tensor. microtensor has one device, the CPU."""
    if callable(map_location) and not isinstance(map_location, (str, Mapping)) \
            and not hasattr(map_location, "type"):
        def apply(t):
            out = map_location(t, "cpu")      # torch's (storage, location) convention
            if out is None:
                return t
            if not isinstance(out, Tensor):
                raise TypeError(f"map_location returned a {type(out).__name__}, expected the "
                                "tensor it was given")
            return out
        return apply
    targets = list(map_location.values()) if isinstance(map_location, Mapping) \
        else [map_location]
    for target in targets:
        if target is None:
            continue
        name = target if isinstance(target, str) else getattr(target, "type", None)
        if not isinstance(name, str):
            raise TypeError(f"map_location must be None, 'cpu', a device, a dict or a "
                            f"function, got {type(target).__name__}")
        if name.split(":")[0] != "cpu":
            raise RuntimeError(f"mt.load: map_location={str(target)!r} names a device "
                               "microtensor does not have; it runs on the CPU only "
                               "(use map_location='cpu')")
    return lambda t: t


def load(path, map_location=None, with_metadata=False, weights_only=None):
    """Read what `save` wrote, from a path or a binary file object: a dict of name ->
    Tensor for a flat file, the saved structure otherwise; `(obj, metadata)` with
    `with_metadata=True`. `map_location` may be None, 'cpu', a cpu device or a dict or
    function as torch takes them; another device raises RuntimeError. `weights_only`
    is accepted for torch's signature: loading never runs code either way. A missing
    file raises FileNotFoundError; a damaged or foreign file ValueError naming it."""
    del weights_only
    map_tensor = _map_location(map_location)
    if hasattr(path, "read") and not isinstance(path, (str, bytes, os.PathLike)):
        data = path.read()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("mt.load: the file object must be opened in binary mode")
        data = bytes(data)
        label = getattr(path, "name", None) or f"<{type(path).__name__}>"
        import io
        names, metadata = _parse_header(io.BytesIO(data), len(data), label)
        reader = lambda: safetensors.numpy.load(data)      # noqa: E731
    else:
        path = os.fspath(path)
        label = path
        _check_regular(path)
        # O_NONBLOCK: should the path turn into a FIFO after the check, open() still
        # returns at once and the fstat below refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a regular file; mt.load reads checkpoint files")
            names, metadata = _parse_header(f, st.st_size, label)
        reader = lambda: safetensors.numpy.load_file(path)  # noqa: E731
    try:
        arrays = reader()
    except Exception as e:   # the reader's SafetensorError and friends
        raise _damaged(label, f"{type(e).__name__}: {e}") from None
    for name in names:
        if not arrays[name].flags.writeable:
            arrays[name] = arrays[name].copy()

    structure = metadata.pop(_STRUCTURE_KEY, None)
    if structure is None:
        obj = {name: map_tensor(from_numpy(arrays[name])) for name in names}
    else:
        spec = _json(structure, label, "the checkpoint structure")
        if not isinstance(spec, dict) or "root" not in spec:
            raise _damaged(label, "the checkpoint structure has no root")
        if spec.get("format") != _FORMAT:
            raise _damaged(label, f"the checkpoint structure has format "
                                  f"{spec.get('format')!r}; this microtensor reads {_FORMAT!r}")
        obj = _decode(spec["root"], arrays, label, map_tensor)
    if with_metadata:
        return obj, dict(metadata)
    return obj
