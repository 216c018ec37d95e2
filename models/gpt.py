"""GPT: a decoder-only Transformer language model, with GPT-2's layer names.

With the default GPTConfig options this is GPT-2 (and nanoGPT's model): its state_dict
keys and layouts are theirs, so weights move between them unchanged. The other options
swap one piece at a time (norm, norm placement, position scheme, MLP, tying, residuals)
to study what each piece does.
"""
import contextlib
import math

import numpy as np

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F

from models.attention import KVCache
from models.block import TransformerBlock, make_norm
from models.config import GPTConfig
from models.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = cfg = config
        with _layers_skip_their_own_init():
            layers = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
            if cfg.pos == "learned":
                layers["wpe"] = LearnedPositionalEmbedding(cfg.block_size, cfg.n_embd)
            elif cfg.pos == "sinusoidal":
                layers["wpe"] = SinusoidalPositionalEncoding(cfg.n_embd, max_len=cfg.block_size)
            layers["drop"] = nn.Dropout(cfg.dropout if cfg.embd_dropout is None
                                        else cfg.embd_dropout)
            layers["h"] = nn.ModuleList([
                TransformerBlock(cfg.n_embd, cfg.n_head, d_ff=cfg.mlp_hidden, causal=True,
                                 norm=cfg.norm, prenorm=cfg.prenorm, residual=cfg.residual,
                                 bias=cfg.bias, dropout=cfg.dropout, activation=cfg.mlp,
                                 rope=cfg.pos == "rope", attn_dropout=cfg.attn_dropout,
                                 norm_eps=cfg.norm_eps)
                for _ in range(cfg.n_layer)])
            # post-norm blocks end in a norm already; a final one only pre-norm stacks need
            if cfg.prenorm:
                layers["ln_f"] = make_norm(cfg.norm, cfg.n_embd, cfg.bias, cfg.norm_eps)
            self.transformer = nn.ModuleDict(layers)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # the input embedding and the output projection are one matrix (GPT-2 does this)
            self.transformer.wte.weight = self.lm_head.weight
        self.init_weights()

    def init_weights(self):
        """GPT-2's init: N(0, 0.02) for every matrix and embedding, zero biases, and the
        projections that write into the residual stream (c_proj) scaled down by
        1/sqrt(2 * n_layer), so the stream's variance does not grow with depth.
        Each parameter is drawn once (a tied matrix too)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done = set()
        for module_name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                weight_std = residual_std if module_name.endswith("c_proj") else 0.02
                draws = [(module.weight, weight_std), (module.bias, None)]
            elif isinstance(module, (nn.Embedding, LearnedPositionalEmbedding)):
                draws = [(module.weight, 0.02)]
            else:
                continue
            for p, std in draws:
                if p is None or id(p) in done:
                    continue
                done.add(id(p))
                if std is None:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, path_or_name, *, dtype=None):
        """A GPT in eval mode with the weights of a Hugging Face GPT-2 checkpoint: a folder
        with config.json and model.safetensors (or shards and their index), a .safetensors
        file beside a config.json, or a Hub name ('gpt2') found through huggingface_hub's
        cache. dtype: float32 or float64; None keeps the checkpoint's (models/pretrained.py)."""
        from models.pretrained import load_pretrained
        return load_pretrained(cls, path_or_name, dtype=dtype)

    def save_pretrained(self, folder):
        """Write config.json and model.safetensors in Hugging Face's GPT-2 format, which
        transformers' GPT2LMHeadModel.from_pretrained(folder) and from_pretrained load."""
        from models.pretrained import save_pretrained
        return save_pretrained(self, folder)

    def num_parameters(self):
        """Every unique parameter counted once (a tied matrix once, position tables included)."""
        unique = {id(p): p for p in self.parameters()}
        return sum(p.numel() for p in unique.values())

    def check_tokens(self, idx):
        if not isinstance(idx, mt.Tensor):
            raise TypeError(f"idx must be an int64 tensor of token ids, got {type(idx).__name__}")
        if idx.dtype.kind not in "iu":
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        if idx.ndim != 2:
            raise mt.ShapeError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        T, block_size = idx.shape[1], self.config.block_size
        if T > block_size:
            raise mt.ShapeError(f"cannot forward a sequence of length T={T}: the block size is "
                                f"only block_size={block_size}")
        if mt.compiler.is_compiling():
            return      # a plan cannot read ids in Python; the embedding checks them itself
        ids = idx.numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise IndexError(f"token id {bad} is outside the vocabulary of vocab_size="
                             f"{self.config.vocab_size} (ids must be in [0, "
                             f"{self.config.vocab_size - 1}])")

    def hidden_states(self, idx, kv_caches=None):
        """The final normalised residual stream (B, T, n_embd) for token ids idx (B, T).
        With kv_caches (one KVCache per layer) idx continues the cached sequence."""
        self.check_tokens(idx)
        offset = 0 if kv_caches is None else kv_caches[0].length
        if offset + idx.shape[1] > self.config.block_size:
            raise mt.ShapeError(f"cannot run positions up to {offset + idx.shape[1]}: the block "
                                f"size is only block_size={self.config.block_size}")
        tr = self.transformer
        x = tr.wte(idx)  # (B, T, C)
        if self.config.pos in ("learned", "sinusoidal"):
            x = tr.wpe(x, offset)
        x = tr.drop(x)
        for i, block in enumerate(tr.h):
            x = block(x, kv_cache=None if kv_caches is None else kv_caches[i])
        if self.config.prenorm:
            x = tr.ln_f(x)
        return x

    def forward(self, idx, targets=None):
        """logits (B, T, vocab) for token ids idx (B, T); loss = mean cross-entropy against
        targets (B, T) when given (ids of -1 are ignored), else None."""
        logits = self.lm_head(self.hidden_states(idx))  # (B, T, vocab)
        loss = None
        if targets is not None:
            if tuple(targets.shape) != tuple(idx.shape):
                raise mt.ShapeError(f"targets have shape {tuple(targets.shape)} but idx has "
                                    f"shape {tuple(idx.shape)}")
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-1)  # (B*T, vocab) vs (B*T,)
        return logits, loss

    @mt.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, *,
                 generator=None, seed=None, use_cache=True):
        """Continue each row of idx (B, T) by max_new_tokens sampled tokens -> (B, T + max_new_tokens).

        Keeps a KV cache so each step runs only the newest token (use_cache=False runs
        the whole window at every step, the same tokens, slower). temperature=0 means
        greedy (argmax, the lowest id on a tie); top_k keeps the k likeliest tokens; top_p
        keeps the smallest set whose probability reaches p. A context longer than
        block_size is cropped to its last block_size tokens (position tables end there),
        recomputed without the cache. Randomness comes from `generator` (an mt.Generator),
        or from a generator of its own seeded with `seed`, or else from microtensor's
        default generator, so mt.manual_seed fixes the output.
        """
        check_sampling(temperature, top_k, top_p)
        if not isinstance(idx, mt.Tensor) or idx.ndim != 2:
            raise TypeError("idx must be an int64 tensor (B, T) of token ids")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if seed is not None:
            if generator is not None:
                raise ValueError("give generator= or seed=, not both")
            generator = mt.Generator().manual_seed(seed)
        block_size = self.config.block_size
        self.check_tokens(idx[:, -block_size:])
        # each layer's cache holds block_size positions from the start: a step writes its
        # token's k and v in place (models/attention.py, KVCache)
        caches = ([KVCache(capacity=block_size) for _ in range(self.config.n_layer)]
                  if use_cache else None)
        prompt = idx.numpy()
        B, T = prompt.shape
        tokens = np.empty((B, T + max_new_tokens), dtype=np.int64)  # filled as it goes
        tokens[:, :T] = prompt
        step_input = idx[:, -block_size:]  # the whole (cropped) prompt first
        for n in range(T, T + max_new_tokens):
            if caches is None:
                step_input = mt.from_numpy(tokens[:, max(0, n - block_size):n])
            elif caches[0].length + step_input.shape[1] > block_size:
                # the window slides: every position changes, so recompute it from scratch
                for cache in caches:
                    cache.reset()
                step_input = mt.from_numpy(tokens[:, n - block_size:n])
            x = self.hidden_states(step_input, caches)
            logits = self.lm_head(x[:, -1, :]).numpy()  # (B, vocab): only the last position
            sampling = (temperature, top_k, top_p) + (() if generator is None else (generator,))
            tokens[:, n:n + 1] = sample_next(logits, *sampling)  # (B, 1)
            step_input = mt.from_numpy(tokens[:, n:n + 1])
        return mt.from_numpy(tokens)


@contextlib.contextmanager
def _layers_skip_their_own_init():
    """While a GPT makes its layers, their constructors' own random draws (Linear's
    uniform, the embeddings' normal) are skipped: GPT.init_weights draws every weight
    right after, once. (Drawing GPT-2's 124M numbers twice, some four times, was most of
    the time it took to build.) Only the draws are skipped: the constant inits (norms'
    ones, zeros) still run.
    NOTE: the skip is a process-wide swap of nn.init's two draw functions for the
    duration of the build: a layer made in another thread meanwhile would skip its own."""
    saved = nn.init.normal_, nn.init.uniform_

    def skip(tensor, *args, **kwargs):
        return tensor
    nn.init.normal_ = nn.init.uniform_ = skip
    try:
        yield
    finally:
        nn.init.normal_, nn.init.uniform_ = saved


def check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The distribution sample_next draws from: probabilities (B, vocab) in float64.

    logits / temperature, then top_k keeps the k likeliest tokens (ties with the k-th
    kept too), then top_p (nucleus) keeps the smallest set of likeliest tokens whose
    probability reaches top_p: sorted from the likeliest, a token is kept while the mass
    of the tokens before it is still below top_p (so the first token always stays, and at
    an exact boundary, mass == top_p, the next token is dropped). The kept probabilities
    are renormalised. temperature must be > 0 here (0 is greedy, see sample_next)."""
    logits = np.asarray(logits, dtype=np.float64) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]  # (B, 1)
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # likeliest first, ties by id
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # NOTE: the mass before each token is the running sum shifted by one, not
        # cumsum - p: that subtraction rounds, and a token sitting exactly on the
        # boundary could then be kept
        mass_before = np.zeros_like(sorted_probs)
        np.cumsum(sorted_probs[:, :-1], axis=-1, out=mass_before[:, 1:])
        keep_sorted = mass_before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token id per row of logits (B, vocab), as an int64 array (B, 1)."""
    if temperature == 0:
        return logits.argmax(axis=-1)[:, None].astype(np.int64)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    cdf = np.cumsum(probs, axis=-1)  # (B, vocab)
    u = mt.rand(probs.shape[0], 1, dtype=mt.float64, generator=generator).numpy() * cdf[:, -1:]
    choice = (cdf <= u).sum(axis=-1)  # first index whose cdf exceeds u
    return np.minimum(choice, probs.shape[-1] - 1)[:, None].astype(np.int64)
