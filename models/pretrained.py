"""GPT-2 checkpoints in Hugging Face's format: read them into a GPT, write a GPT back.

A checkpoint is a folder as transformers' `save_pretrained` writes it:

    config.json                        GPT2Config's fields (the shape, eps, activation, ...)
    model.safetensors                  the weights, or, sharded:
    model-00001-of-00002.safetensors   ... with model.safetensors.index.json naming
                                       the file of every weight

or one .safetensors file with a config.json beside it. The names are GPT's own
(`transformer.h.0.attn.c_attn.weight`, ...; GPT2Model, without the head, writes them
without the `transformer.` prefix) with one difference of layout: GPT-2's projections
are `Conv1D`s, whose weight is (in, out), where a Linear's is (out, in), so the four
matrices of every block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are transposed
on the way in and on the way out. The causal mask buffers (`attn.bias`,
`attn.masked_bias`) older checkpoints carry are derived, not weights: skipped.

The files are read with the safetensors package's reader, which checks the header and
memory-maps the file: each weight is copied once out of the page cache (then transposed
or cast where needed), with no buffer of the whole file in between; no file stays
mapped, so a checkpoint overwritten in place later cannot pull weights from under a
model. Nothing is ever unpickled: a folder
with only `pytorch_model.bin` is refused with the command that converts it.
"""
import contextlib
import dataclasses
import json
import os
import re
import threading

import numpy as np

from microtensor import nn

from models.config import GPTConfig

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "resolve_checkpoint"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# what a GPT-2 folder on the Hub holds that this project reads (weights and tokenizer)
HUB_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
             "model-*.safetensors", "vocab.json", "merges.txt", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# Conv1D weights: (in, out) in the file, (out, in) in a Linear
CONV1D = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                    r"\.weight")
MASK_BUFFER = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")

# config.json activation -> GPTConfig.mlp. gelu_new and gelu_pytorch_tanh are both
# 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); gelu is the exact x * Phi(x)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}
# fields whose other values change the numbers in ways GPT does not compute
FIXED_FIELDS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "add_cross_attention": False,
                "is_encoder_decoder": False}
# GPT2Config's defaults, for fields a config.json leaves out
HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                   n_inner=None, activation_function="gelu_new", resid_pdrop=0.1,
                   embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
                   tie_word_embeddings=True)
FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float64)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a GPT: the message names every problem."""


# ---- where the files are -------------------------------------------------------------

def _looks_like_repo_id(name):
    """'gpt2', 'openai-community/gpt2': what the Hub takes, and not a path of this machine."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", name) is not None \
        and not name.endswith((".safetensors", ".json"))


def _fetch_command(name):
    files = "config.json model.safetensors vocab.json merges.txt"
    return f"hf download {name} {files} --local-dir {name.split('/')[-1]}"


def resolve_checkpoint(path_or_name):
    """A local path (a folder or a .safetensors file) as it is; a Hub name ('gpt2')
    through the user's Hugging Face cache with huggingface_hub, downloading when online.
    A name that cannot be had is one line saying which command fetches it."""
    path = os.fspath(path_or_name)
    if not isinstance(path, str):
        raise TypeError(f"expected a path or a Hub name, got {type(path_or_name).__name__}")
    if os.path.exists(path):
        return path
    if not _looks_like_repo_id(path):
        raise FileNotFoundError(f"no checkpoint at {path}: expected a folder with config.json "
                                "and model.safetensors, or a .safetensors file")
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(
            f"{path!r} is not a folder here, and huggingface_hub (pip install "
            f"'microtensor[hf]') is not installed to fetch it; fetch the files with "
            f"`pip install huggingface_hub && {_fetch_command(path)}` and pass that "
            f"folder") from None
    try:
        return huggingface_hub.snapshot_download(repo_id=path, allow_patterns=list(HUB_FILES))
    except Exception as e:   # offline with an empty cache, no such repo, no network...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"cannot get {path!r} from the Hugging Face cache or Hub ({reason[:160]}); fetch "
            f"the files with `{_fetch_command(path)}` and pass that folder") from None


def _weight_files(path):
    """(config.json's path, [safetensors files], index weight_map or None) for a folder
    or a .safetensors file."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"{path} is not a .safetensors file: give the checkpoint "
                                  "folder or its model.safetensors")
        return os.path.join(os.path.dirname(path), CONFIG_NAME), [path], None
    folder = path
    config = os.path.join(folder, CONFIG_NAME)
    single, index = os.path.join(folder, WEIGHTS_NAME), os.path.join(folder, INDEX_NAME)
    if os.path.exists(single):
        return config, [single], None
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a "
                                  f"'weight_map'): {e}") from None
        for name in files:
            if os.path.basename(name) != name:
                raise CheckpointError(f"{index} names a shard outside its folder: {name!r}")
        return config, [os.path.join(folder, name) for name in files], weight_map
    pickles = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
               if os.path.exists(os.path.join(folder, n))]
    if pickles:
        raise CheckpointError(
            f"{folder} holds only {pickles[0]}, a pickle, which microtensor never loads (it "
            f"can run code); convert it to safetensors once with transformers: python -c "
            f"\"from transformers import GPT2LMHeadModel as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}')\"")
    raise CheckpointError(f"{folder} holds no {WEIGHTS_NAME} (nor {INDEX_NAME}): not a "
                          "Hugging Face checkpoint folder")


# ---- config.json <-> GPTConfig ---------------------------------------------------------

def read_config(path):
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no {CONFIG_NAME} at {path}: the weights alone do not say the "
                              "model's shape") from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def config_from_hf(hf, where=CONFIG_NAME):
    """GPTConfig for a GPT-2 config.json's dict; a field that would change the numbers
    and that GPT does not compute is an error naming it."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{where}: model_type={hf['model_type']!r}; GPT reads GPT-2 "
                              "checkpoints (model_type 'gpt2')")
    for field, value in FIXED_FIELDS.items():
        if field in hf and hf[field] != value:
            raise CheckpointError(f"{where}: {field}={json.dumps(hf[field])} is not supported "
                                  f"(GPT computes {field}={json.dumps(value)})")
    cfg = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if k in HF_DEFAULTS}}
    for field in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        value = cfg[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: {field}={value!r} must be a positive integer")
    if "n_ctx" in hf and hf["n_ctx"] != cfg["n_positions"]:
        raise CheckpointError(f"{where}: n_ctx={hf['n_ctx']} differs from n_positions="
                              f"{cfg['n_positions']}; GPT has one context length")
    activation = cfg["activation_function"]
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{where}: activation_function={activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
    n_inner = cfg["n_inner"]
    if n_inner is not None and (isinstance(n_inner, bool) or not isinstance(n_inner, int)
                                or n_inner < 1):
        raise CheckpointError(f"{where}: n_inner={n_inner!r} must be a positive integer or null")
    eps = cfg["layer_norm_epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise CheckpointError(f"{where}: layer_norm_epsilon={eps!r} must be a number > 0")
    if not isinstance(cfg["tie_word_embeddings"], bool):
        raise CheckpointError(f"{where}: tie_word_embeddings="
                              f"{cfg['tie_word_embeddings']!r} must be true or false")
    for field in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        p = cfg[field]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise CheckpointError(f"{where}: {field}={p!r} must be a probability in [0, 1)")
    try:
        return GPTConfig(vocab_size=cfg["vocab_size"], block_size=cfg["n_positions"],
                         n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                         dropout=float(cfg["resid_pdrop"]),
                         attn_dropout=float(cfg["attn_pdrop"]),
                         embd_dropout=float(cfg["embd_pdrop"]),
                         mlp=ACTIVATIONS[activation], d_ff=n_inner,
                         norm_eps=float(eps), tie_weights=cfg["tie_word_embeddings"])
    except ValueError as e:   # n_embd not divisible by n_head, ...
        raise CheckpointError(f"{where}: {e}") from None


def config_to_hf(config, dtype, base=None):
    """config.json's dict for a GPTConfig (on top of `base`, the dict the model was
    loaded from, so fields this project does not read, e.g. the token ids, survive)."""
    cfg = config
    unsupported = [(name, getattr(cfg, name), want) for name, want in
                   (("norm", "layernorm"), ("prenorm", True), ("pos", "learned"),
                    ("bias", True), ("residual", True))
                   if getattr(cfg, name) != want]
    if cfg.mlp == "swiglu":
        unsupported.append(("mlp", "swiglu", "gelu_tanh, gelu or relu"))
    if unsupported:
        raise CheckpointError("GPT-2's format cannot hold this model: " + "; ".join(
            f"{name}={value!r} (GPT-2 has {want!r})" for name, value, want in unsupported))
    out = dict(base or {})
    for stale in ("_name_or_path", "transformers_version"):
        out.pop(stale, None)
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[cfg.mlp]
    if out.get("activation_function") in ACTIVATIONS \
            and ACTIVATIONS[out["activation_function"]] == cfg.mlp:
        activation = out["activation_function"]   # gelu_pytorch_tanh stays itself
    dropout = cfg.dropout
    out.update(
        model_type="gpt2", architectures=["GPT2LMHeadModel"],
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_inner=None if cfg.d_ff is None or cfg.d_ff == 4 * cfg.n_embd else cfg.d_ff,
        activation_function=activation,
        resid_pdrop=dropout,
        embd_pdrop=dropout if cfg.embd_dropout is None else cfg.embd_dropout,
        attn_pdrop=dropout if cfg.attn_dropout is None else cfg.attn_dropout,
        layer_norm_epsilon=1e-5 if cfg.norm_eps is None else cfg.norm_eps,
        tie_word_embeddings=cfg.tie_weights, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        dtype=np.dtype(dtype).name)
    out.pop("n_ctx", None)
    return out


# ---- reading the weights ---------------------------------------------------------------

def _read_tensors(path):
    """name -> numpy array for every tensor of the safetensors file at `path`, through
    the safetensors package's reader (it checks the header and memory-maps the file:
    each tensor is one copy out of the page cache, with no buffer of the whole file)."""
    import safetensors
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is not a regular file")
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:   # SafetensorError and friends: a damaged or foreign file
        raise CheckpointError(f"{path} is not a valid safetensors file: "
                              f"{type(e).__name__}: {e}") from None


def _canonical(name):
    """GPT's own name for a key as GPT2LMHeadModel or GPT2Model writes it."""
    if name.startswith("transformer.") or name == "lm_head.weight":
        return name
    return "transformer." + name


def _as_dtype(dtype):
    """mt.float32, np.float64, 'float32', ... -> numpy dtype; None stays None."""
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)   # mt.float64, np.float64 and 'float64' alike
    except TypeError:
        resolved = None
    if resolved not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}")
    return resolved


_building = threading.Lock()


@contextlib.contextmanager
def _no_random_init():
    """Build a model without drawing its random init: every weight is overwritten by the
    checkpoint's, and at 124M parameters the draws would take longer than the load.

    NOTE: the layers call microtensor.nn.init's functions through the module, so they are
    swapped for ones that leave the (uninitialised) values as they are, under a lock;
    a module built meanwhile in another thread would get no init either."""
    names = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "xavier_uniform_")
    with _building:
        saved = {n: getattr(nn.init, n) for n in names}
        try:
            for n in names:
                setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
            yield
        finally:
            for n, fn in saved.items():
                setattr(nn.init, n, fn)


def load_pretrained(cls, path_or_name, dtype=None, overrides=None):
    """A `cls` (GPT) in eval mode with the checkpoint's weights (see the module docstring).
    dtype: None keeps the checkpoint's float32/float64 (float16 becomes float32).
    overrides: GPTConfig fields that do not touch the weights' shapes (the dropouts)."""
    want = _as_dtype(dtype)
    path = resolve_checkpoint(path_or_name)
    config_path, files, weight_map = _weight_files(path)
    hf = read_config(config_path)
    config = config_from_hf(hf, config_path)
    if overrides:
        config = dataclasses.replace(config, **overrides)

    tensors, problems, sources = {}, [], {}
    for file in files:
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing: the index {INDEX_NAME} names it")
        for name, array in _read_tensors(file).items():
            if MASK_BUFFER.search(name):
                continue                       # the causal mask, rebuilt by attention
            key = _canonical(name)
            if key in tensors:
                problems.append(f"{key} is stored twice ({sources[key]} and {name})")
            tensors[key], sources[key] = array, name
    if weight_map is not None:
        listed = {_canonical(n) for n in weight_map if not MASK_BUFFER.search(n)}
        for key in sorted(listed - tensors.keys()):
            problems.append(f"{key} is in {INDEX_NAME} but in none of its files")

    with _no_random_init():
        model = cls(config)
    targets = model.state_dict(keep_vars=True)
    if config.tie_weights:
        del targets["lm_head.weight"]          # the same matrix as transformer.wte.weight
        head = tensors.pop("lm_head.weight", None)
        wte = tensors.get("transformer.wte.weight")
        if head is not None and wte is not None and (
                head.shape != wte.shape or not np.array_equal(head, wte)):
            problems.append("lm_head.weight differs from transformer.wte.weight, but "
                            "config.json ties them (tie_word_embeddings: true)")
    missing = [k for k in targets if k not in tensors]
    unexpected = [k for k in tensors if k not in targets]
    wrong = []
    for key, target in targets.items():
        if key in tensors:
            shape = tensors[key].shape[::-1] if CONV1D.fullmatch(key) else tensors[key].shape
            if tuple(shape) != tuple(target.shape):
                stored = tuple(tensors[key].shape)
                expected = tuple(target.shape[::-1]) if CONV1D.fullmatch(key) else tuple(target.shape)
                wrong.append(f"{key} {stored} (config.json's shape gives {expected})")
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if wrong:
        problems.append("wrong shape: " + ", ".join(wrong))
    if problems:
        raise CheckpointError(f"{path} does not fit its config.json: " + "; ".join(problems))

    for key, target in targets.items():
        array = tensors[key]
        if array.dtype.kind != "f":
            raise CheckpointError(f"{key} has dtype {array.dtype}; weights are floating point")
        if CONV1D.fullmatch(key):
            array = array.T                    # (in, out) -> Linear's (out, in)
        target_dtype = want or (array.dtype if array.dtype in FLOAT_DTYPES else np.dtype(np.float32))
        # C-contiguous and of its own (the reader's arrays are copies already)
        target._data = np.ascontiguousarray(array, dtype=target_dtype)
    model.hf_config = hf    # save_pretrained keeps the fields GPT does not read
    return model.eval()


# ---- writing ---------------------------------------------------------------------------

def save_pretrained(model, folder):
    """Write config.json and model.safetensors (Hugging Face's names, Conv1D layout,
    metadata {"format": "pt"}) into `folder`, each file atomically (a temporary name, then
    a rename), so transformers' GPT2LMHeadModel.from_pretrained(folder) loads it."""
    import microtensor as mt
    config = model.config
    state = model.state_dict()
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"the model's weights have several dtypes ({dtypes}); cast it "
                              "to one with .float() or .double()")
    hf = config_to_hf(config, dtypes.pop(), getattr(model, "hf_config", None))
    arrays = {}
    for key, tensor in state.items():
        if key == "lm_head.weight" and config.tie_weights:
            continue                           # transformers ties it back to wte
        array = tensor.numpy()
        arrays[key] = np.ascontiguousarray(array.T if CONV1D.fullmatch(key) else array)
    os.makedirs(folder, exist_ok=True)
    mt.save(arrays, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    # a sharded checkpoint there before would otherwise be read instead of this one
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        os.remove(index)
    tmp = os.path.join(folder, f".{CONFIG_NAME}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, os.path.join(folder, CONFIG_NAME))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return folder
