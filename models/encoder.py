"""The 2017 Transformer shape: a bidirectional Encoder, a causal Decoder that
cross-attends to the encoder's output, and EncoderDecoder putting them together.

Defaults follow the paper: sinusoidal positions, post-norm blocks, ReLU MLP 4x wide,
embeddings scaled by sqrt(d_model), the output projection tied to the target embedding.
"""
import math

import numpy as np

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F

from models.attention import KVCache
from models.block import TransformerBlock, make_norm
from models.config import check_heads
from models.positional import SinusoidalPositionalEncoding


def padding_mask(mask, S):
    """A (B, S) bool mask (True = real token) as (B, 1, 1, S), broadcast over heads and queries."""
    if mask is None:
        return None
    if tuple(mask.shape[1:]) != (S,) or mask.ndim != 2:
        raise mt.ShapeError(f"the padding mask must be (B, S) with S={S}, got shape "
                            f"{tuple(mask.shape)}")
    if mask.dtype != mt.bool:
        raise TypeError(f"the padding mask must be bool (True = attend), got dtype {mask.dtype}")
    return mask.view(mask.shape[0], 1, 1, S)  # (B, 1, 1, S)


def check_ids(ids, vocab_size, what):
    if not isinstance(ids, mt.Tensor) or ids.dtype.kind not in "iu" or ids.ndim != 2:
        raise TypeError(f"{what} must be an int64 tensor (B, T) of token ids")
    a = ids.numpy()
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        bad = a.min() if a.min() < 0 else a.max()
        raise IndexError(f"{what} holds token id {bad}, outside the vocabulary of "
                         f"vocab_size={vocab_size}")


class _Stack(nn.Module):
    """Embedding * sqrt(d_model) + sinusoidal positions, then n_layer blocks (+ a final
    norm when pre-norm)."""

    def __init__(self, vocab_size, d_model, n_head, n_layer, d_ff, max_len, dropout, norm,
                 prenorm, activation, bias, causal, cross_attention):
        super().__init__()
        check_heads(d_model, n_head, "d_model")
        self.d_model, self.vocab_size = d_model, vocab_size
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = SinusoidalPositionalEncoding(d_model, max_len=max_len, dropout=dropout)
        self.layers = nn.ModuleList([
            TransformerBlock(d_model, n_head, d_ff=4 * d_model if d_ff is None else d_ff,
                             causal=causal, norm=norm, prenorm=prenorm, bias=bias,
                             dropout=dropout, activation=activation,
                             cross_attention=cross_attention)
            for _ in range(n_layer)])
        self.ln_f = make_norm(norm, d_model, bias) if prenorm else None

    def embed_tokens(self, ids, offset=0):
        x = self.embed(ids) * math.sqrt(self.d_model)  # (B, T, d_model)
        return self.pos(x, offset)


class Encoder(_Stack):
    """memory = Encoder(src, src_mask): (B, S) token ids -> (B, S, d_model), every position
    attending to every other real (unpadded) position."""

    def __init__(self, vocab_size, d_model=512, n_head=8, n_layer=6, d_ff=None, max_len=5000,
                 dropout=0.0, norm="layernorm", prenorm=False, activation="relu", bias=True):
        super().__init__(vocab_size, d_model, n_head, n_layer, d_ff, max_len, dropout, norm,
                         prenorm, activation, bias, causal=False, cross_attention=False)

    def forward(self, src, src_mask=None):
        """src (B, S) int64; src_mask (B, S) bool, True at real tokens (None = no padding)."""
        check_ids(src, self.vocab_size, "src")
        mask = padding_mask(src_mask, src.shape[1])
        x = self.embed_tokens(src)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x if self.ln_f is None else self.ln_f(x)


class Decoder(_Stack):
    """Causal self-attention over the target so far, cross-attention to the encoder's memory."""

    def __init__(self, vocab_size, d_model=512, n_head=8, n_layer=6, d_ff=None, max_len=5000,
                 dropout=0.0, norm="layernorm", prenorm=False, activation="relu", bias=True):
        super().__init__(vocab_size, d_model, n_head, n_layer, d_ff, max_len, dropout, norm,
                         prenorm, activation, bias, causal=True, cross_attention=True)

    def forward(self, tgt, memory, memory_mask=None, caches=None):
        """tgt (B, T) ids; memory (B, S, d_model); memory_mask (B, 1, 1, S) or None.
        caches: per layer a (self, cross) pair of KVCache, to decode one token at a time."""
        check_ids(tgt, self.vocab_size, "tgt")
        offset = 0 if caches is None else caches[0][0].length
        x = self.embed_tokens(tgt, offset)
        for i, layer in enumerate(self.layers):
            self_cache, cross_cache = (None, None) if caches is None else caches[i]
            x = layer(x, kv_cache=self_cache, context=memory, context_mask=memory_mask,
                      cross_kv_cache=cross_cache)
        return x if self.ln_f is None else self.ln_f(x)


class EncoderDecoder(nn.Module):
    """(logits, loss) = model(src, tgt, targets): translate src (B, S) into tgt (B, T).

    tgt is the decoder input (the target shifted right, starting with a BOS id) and
    targets the ids to predict at each position. With pad_id set, padded source
    positions are masked out of attention and padded targets out of the loss.
    """

    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, n_head=8, n_layer=6,
                 n_decoder_layer=None, d_ff=None, max_len=5000, dropout=0.1,
                 norm="layernorm", prenorm=False, activation="relu", bias=True,
                 tie_weights=True, pad_id=None):
        super().__init__()
        self.pad_id = pad_id
        common = dict(d_model=d_model, n_head=n_head, d_ff=d_ff, max_len=max_len,
                      dropout=dropout, norm=norm, prenorm=prenorm, activation=activation,
                      bias=bias)
        self.encoder = Encoder(src_vocab_size, n_layer=n_layer, **common)
        self.decoder = Decoder(tgt_vocab_size, n_layer=n_layer if n_decoder_layer is None
                               else n_decoder_layer, **common)
        self.lm_head = nn.Linear(d_model, tgt_vocab_size, bias=False)
        self.init_weights()
        if tie_weights:
            self.lm_head.weight = self.decoder.embed.weight

    def init_weights(self):
        """Xavier-uniform matrices, zero biases, embeddings N(0, 1/d_model) (so that after
        the sqrt(d_model) scale they have unit variance, like the position table)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=module.weight.shape[1] ** -0.5)

    def num_parameters(self):
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def source_mask(self, src, src_mask=None):
        """(B, S) bool: the given mask, else src != pad_id, else None (nothing padded)."""
        if src_mask is None and self.pad_id is not None:
            src_mask = src != self.pad_id
        return src_mask

    def encode(self, src, src_mask=None):
        src_mask = self.source_mask(src, src_mask)
        return self.encoder(src, src_mask), padding_mask(src_mask, src.shape[1])

    def forward(self, src, tgt, targets=None, src_mask=None):
        memory, memory_mask = self.encode(src, src_mask)
        logits = self.lm_head(self.decoder(tgt, memory, memory_mask))  # (B, T, vocab)
        loss = None
        if targets is not None:
            ignore = -100 if self.pad_id is None else self.pad_id
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=ignore)  # (B*T, vocab) vs (B*T,)
        return logits, loss

    @mt.no_grad()
    def generate(self, src, max_new_tokens, bos_id, eos_id=None, src_mask=None):
        """Greedy decoding with KV caches: ids (B, 1 + n) starting with bos_id, n <= max_new_tokens.
        With eos_id, a row that has produced it continues with pad_id (or eos_id when no
        pad_id is set), and decoding stops early once every row has."""
        memory, memory_mask = self.encode(src, src_mask)
        B = src.shape[0]
        caches = [(KVCache(), KVCache()) for _ in self.decoder.layers]
        tokens = np.full((B, 1), bos_id, dtype=np.int64)
        done = np.zeros(B, dtype=bool)
        for _ in range(max_new_tokens):
            x = self.decoder(mt.from_numpy(tokens[:, -1:]), memory, memory_mask, caches)
            next_token = self.lm_head(x[:, -1, :]).numpy().argmax(axis=-1)  # (B,)
            if eos_id is not None:
                filler = eos_id if self.pad_id is None else self.pad_id
                next_token = np.where(done, filler, next_token)
                done |= next_token == eos_id
            tokens = np.concatenate([tokens, next_token[:, None].astype(np.int64)], axis=1)
            if eos_id is not None and done.all():
                break
        return mt.from_numpy(tokens)
