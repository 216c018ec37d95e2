"""Helpers shared by train_char.py and sample.py: the corpus, the character tokenizer (or a
GPT-2 checkpoint's BPE), random batches, and checkpoints (safetensors via mt.save,
settings as JSON metadata).

Everything that can go wrong because of the user's input raises `CharDataError` with a
one-line message; the scripts print it (`prog: error: ...`) and exit with status 2.
"""
import hashlib
import json
import os
import sys

import numpy as np

import microtensor as mt

CHECKPOINT_FORMAT = "microtensor-char-gpt/1"


class CharDataError(ValueError):
    """A problem with the user's data, prompt, checkpoint or output directory."""


def exit_with_error(prog, message):
    """One line on stderr, exit status 2 (argparse's convention), no traceback."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -----------------------------------------------------------------------------
# corpus and tokenizer

def load_corpus(path=None):
    """The text at `path` (UTF-8), or Python's documentation text when path is None."""
    if path is None:
        # Shipped with CPython (the text behind `help("assert")` etc.), so the
        # default run needs no download.
        from pydoc_data.topics import topics
        return "".join(topics[k] for k in sorted(topics))
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CharDataError(f"data file not found: {path}") from None
    except IsADirectoryError:
        raise CharDataError(f"data path is a directory, not a text file: {path}") from None
    except OSError as e:
        raise CharDataError(f"cannot read data file {path}: {e.strerror}") from None
    try:
        # utf-8-sig: a byte-order mark is not part of the text
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CharDataError(f"data file {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} "
                            f"at offset {e.start} cannot be decoded") from None
    if not text:
        raise CharDataError(f"data file is empty: {path}")
    return text


def text_fingerprint(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_chars(chars):
    """'é' (U+00E9), '\\t' (U+0009): readable even for invisible characters."""
    return ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars)


class CharTokenizer:
    """One token per distinct character of the corpus, in code point order."""

    def __init__(self, chars):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text):
        return cls(sorted(set(text)))

    @property
    def vocab_size(self):
        return len(self.chars)

    def unknown_chars(self, text):
        return sorted(set(text) - self.stoi.keys())

    def encode(self, text, what="text"):
        unknown = self.unknown_chars(text)
        if unknown:
            raise CharDataError(f"the {what} contains {len(unknown)} character(s) not in the "
                                f"vocabulary: {describe_chars(unknown[:20])}"
                                + (" ..." if len(unknown) > 20 else ""))
        return np.array([self.stoi[c] for c in text], dtype=np.int64)

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


# what a Hugging Face checkpoint folder holds for its tokenizer (copied beside a fine-tune)
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json")


class BPETokenizerFiles:
    """The BPE tokenizer of a GPT-2 checkpoint folder (models.BPETokenizer) with
    CharTokenizer's interface: encode -> int64 array, decode, vocab_size."""

    chars = None   # no character vocabulary to store in a checkpoint

    def __init__(self, folder):
        try:
            from models import BPETokenizer
        except ImportError:
            raise CharDataError("this checkout has no models.BPETokenizer (models/tokenizer.py) "
                                "to read the checkpoint's vocab.json and merges.txt") from None
        if not any(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_FILES[:3]):
            raise CharDataError(f"{folder} holds no tokenizer (vocab.json and merges.txt, or "
                                "tokenizer.json)")
        try:
            self.bpe = BPETokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as e:
            raise CharDataError(f"cannot read the tokenizer in {folder}: {e}") from None
        self.folder = folder

    @property
    def vocab_size(self):
        return self.bpe.vocab_size

    def encode(self, text, what="text"):
        return np.array(self.bpe.encode(text), dtype=np.int64)

    def decode(self, ids):
        return self.bpe.decode([int(i) for i in ids])


def copy_tokenizer(src_folder, dst_folder):
    """Copy the tokenizer files of a checkpoint folder (atomically each), so that a
    fine-tuned model's folder is complete on its own."""
    import shutil
    os.makedirs(dst_folder, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(src_folder, name)
        if os.path.exists(src):
            tmp = os.path.join(dst_folder, f".{name}.{os.getpid()}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(dst_folder, name))


def train_val_split(ids, block_size, data_name):
    """First 90% for training, last 10% for validation; each must hold one (x, y) pair."""
    n_train = int(0.9 * len(ids))
    train, val = ids[:n_train], ids[n_train:]
    need = block_size + 1
    if len(val) < need:
        raise CharDataError(
            f"{data_name} has {len(ids)} characters: its validation split (the last 10%, "
            f"{len(val)} characters) is shorter than block_size + 1 = {need}; use a text of "
            f"at least {10 * need} characters or a smaller --block_size")
    return train, val


def get_batch(data, block_size, batch_size, rng):
    """Random windows: x = data[i:i+T], y = data[i+1:i+T+1] (nanoGPT's sampler)."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)  # i + T + 1 <= len
    offsets = starts[:, None] + np.arange(block_size)                    # (B, T)
    return mt.from_numpy(data[offsets]), mt.from_numpy(data[offsets + 1])


# -----------------------------------------------------------------------------
# threads

def _openblas_function(name):
    """A function of the OpenBLAS that numpy loaded (None if not found). numpy's wheels
    ship it with prefixed, 64-bit-integer symbol names."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for lib_path in sorted(libs):
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", "")):
            fn = getattr(lib, f"{prefix}openblas_{name}{suffix}", None)
            if fn is not None:
                return fn
    return None


def set_blas_threads(n):
    """Best effort: numpy's OpenBLAS uses n threads from now on (the environment
    variables only count before numpy is imported). Returns True when it worked."""
    import ctypes
    fn = _openblas_function("set_num_threads")
    if fn is not None:
        fn(ctypes.c_int(n))
    return fn is not None


def get_blas_threads():
    """OpenBLAS's thread count, or None when it cannot be found."""
    fn = _openblas_function("get_num_threads")
    return None if fn is None else int(fn())


# -----------------------------------------------------------------------------
# checkpoints
#
# One safetensors file: the model's state_dict under its own key names (so the file
# loads straight into nanoGPT's PyTorch GPT after dropping the "optimizer/" keys), the
# optimizer's tensors under "optimizer/...", and everything else as JSON strings in the
# metadata. The optimizer's state_dict is a nested structure of dicts (with int keys),
# lists, tuples, numbers and tensors; `_flatten` stores its tensors and replaces each by
# a reference so that the skeleton is JSON, `_unflatten` undoes it exactly.

def _flatten(obj, key, tensors):
    if isinstance(obj, mt.Tensor):
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        tensors[key] = obj
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        # NOTE: a list of pairs, not a JSON object, so that int keys stay ints
        return {"__dict__": [[k, _flatten(v, f"{key}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint ({key})")


def _unflatten(obj, tensors):
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
    return obj


def save_checkpoint(path, model, optimizer, info):
    """Write model + optimizer + `info` (a dict of JSON-able values) atomically: mt.save
    writes a temporary file of its own (a name no other process uses) and renames it, so
    a crash mid-write leaves the previous file intact."""
    tensors = dict(model.state_dict())
    optimizer_skeleton = _flatten(optimizer.state_dict(), "optimizer", tensors)
    metadata = {"format": CHECKPOINT_FORMAT, "optimizer": json.dumps(optimizer_skeleton)}
    metadata.update({k: json.dumps(v) for k, v in info.items()})
    mt.save(tensors, path, metadata=metadata)


class DamagedCheckpoint(CharDataError):
    """A checkpoint file that exists but cannot be read (truncated, overwritten)."""

    def __init__(self, message, path):
        super().__init__(message)
        self.path = path


# train_char.py writes two independent files (each atomically, never one a link to the
# other), so damage to one never touches the other
LAST, BEST = "ckpt_last.safetensors", "ckpt_best.safetensors"


def other_checkpoint(path):
    """The other of ckpt_last / ckpt_best beside `path` when it exists, else None."""
    name = os.path.basename(path)
    if name not in (LAST, BEST):
        return None
    other = os.path.join(os.path.dirname(path), BEST if name == LAST else LAST)
    return other if os.path.exists(other) else None


def readable_iter(path):
    """The iteration a checkpoint holds when it loads, else None."""
    try:
        return load_checkpoint(path)[2].get("iter")
    except CharDataError:
        return None


def load_checkpoint(path):
    """-> (model_state_dict, optimizer_state_dict, info) with info's JSON decoded. A file
    that exists but cannot be read raises DamagedCheckpoint."""
    if not os.path.exists(path):
        raise CharDataError(f"checkpoint not found: {path}")
    try:
        tensors, metadata = mt.load(path, with_metadata=True)
    except (ValueError, OSError) as e:
        raise DamagedCheckpoint(f"cannot read checkpoint {path}: {e}", path) from None
    metadata = metadata or {}
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise DamagedCheckpoint(f"{path} is not a train_char.py checkpoint "
                                f"(its metadata has no format '{CHECKPOINT_FORMAT}')", path)
    try:
        info = {k: json.loads(v) for k, v in metadata.items() if k not in ("format", "optimizer")}
        optimizer_state = _unflatten(json.loads(metadata["optimizer"]), tensors)
    except (ValueError, KeyError) as e:
        raise DamagedCheckpoint(f"checkpoint {path} has damaged metadata: {e}", path) from None
    missing = [k for k in ("run", "config", "vocab", "iter") if k not in info]
    if missing:
        raise DamagedCheckpoint(f"checkpoint {path} has damaged metadata: no "
                                f"{', '.join(missing)}", path)
    model_state = {k: v for k, v in tensors.items() if not k.startswith("optimizer/")}
    return model_state, optimizer_state, info


def newest_checkpoint(out_dir):
    """The most recently written *.safetensors in out_dir (ckpt_last wins a tie)."""
    try:
        names = [n for n in os.listdir(out_dir)
                 if n.endswith(".safetensors") and not n.startswith(".")]
    except FileNotFoundError:
        raise CharDataError(f"output directory not found: {out_dir}") from None
    if not names:
        raise CharDataError(f"no checkpoint (*.safetensors) in {out_dir}")
    paths = [os.path.join(out_dir, n) for n in names]
    return max(paths, key=lambda p: (os.path.getmtime(p),
                                     os.path.basename(p) == "ckpt_last.safetensors"))


def build_model(config_dict, model_state=None, source="checkpoint"):
    """GPT from a stored config (and weights), with a clear error if they do not fit."""
    from models import GPT, GPTConfig
    try:
        model = GPT(GPTConfig(**config_dict))
    except (TypeError, ValueError) as e:
        raise CharDataError(f"the {source}'s model config cannot be built: {e}") from None
    if model_state is not None:
        try:
            model.load_state_dict(model_state)
        except (KeyError, ValueError, RuntimeError) as e:
            raise CharDataError(f"the {source}'s weights do not fit its config: {e}") from None
    return model
