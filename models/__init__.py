"""The Transformer family, built from microtensor layers.

    from models import GPT, GPTConfig
    model = GPT(GPTConfig.char_small(vocab_size=65))
    logits, loss = model(idx, targets)          # idx, targets: int64 (B, T)
    model.generate(idx, max_new_tokens=100, top_k=10)

Files, smallest first: config (GPTConfig), positional (learned, sinusoidal, rotary),
attention (MultiHeadAttention, KVCache), feedforward (FeedForward), block
(TransformerBlock), gpt (GPT), encoder (Encoder, Decoder, EncoderDecoder), pretrained
(GPT.from_pretrained / save_pretrained: Hugging Face GPT-2 checkpoints), tokenizer
(BPETokenizer: byte-level BPE, GPT-2's and tiktoken's files).
"""
from models.config import GPTConfig
from models.positional import (LearnedPositionalEmbedding, SinusoidalPositionalEncoding,
                               RotaryEmbedding)
from models.attention import MultiHeadAttention, KVCache
from models.feedforward import FeedForward
from models.block import TransformerBlock
from models.gpt import GPT
from models.encoder import Encoder, Decoder, EncoderDecoder
from models.pretrained import CheckpointError
from models.tokenizer import BPETokenizer

__all__ = ["GPT", "GPTConfig", "MultiHeadAttention", "KVCache", "SinusoidalPositionalEncoding",
           "LearnedPositionalEmbedding", "RotaryEmbedding", "FeedForward", "TransformerBlock",
           "Encoder", "Decoder", "EncoderDecoder", "CheckpointError", "BPETokenizer"]
