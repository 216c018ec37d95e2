"""The PyTorch side of the comparison: the same GPT (GPT-2 / nanoGPT architecture)
written in plain torch, with the same parameter names and layouts as models.GPT, so
microtensor's state_dict loads into it unchanged.

Pre-norm blocks (LayerNorm with bias), learned positions, causal self-attention through
torch's fused scaled_dot_product_attention, a GELU MLP of width 4*n_embd, the output
projection tied to the token embedding. Only what the benchmark needs: no generation,
no dropout (the benchmark trains with dropout 0).
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v in one product
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd, bias=True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=True):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        # GPT-2's init (overwritten when microtensor's weights are loaded)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            else:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def from_microtensor(mt_model, dtype=torch.float32):
    """A TorchGPT holding a copy of a microtensor GPT's weights (same keys, same
    layouts), for a run from the same initial point."""
    cfg = mt_model.config
    model = TorchGPT(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
                     cfg.bias)
    sd = {k: torch.from_numpy(np.array(v.numpy(), copy=True)) for k, v in
          mt_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # microtensor may keep extra buffers (e.g. a causal mask); every torch parameter
    # must be covered
    if missing:
        raise KeyError(f"microtensor's state_dict lacks {missing}")
    extra_params = [k for k in unexpected if not k.endswith((".bias_mask", ".mask"))
                    and k.split(".")[-1] in ("weight", "bias")]
    if extra_params:
        raise KeyError(f"unexpected parameters {extra_params}")
    return model.to(dtype)


def configure_optimizer(model, lr, weight_decay, betas):
    """AdamW with weight decay on matrices only (biases, norms: none), as nanoGPT does."""
    params = {id(p): p for p in model.parameters()}.values()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=1e-8)
