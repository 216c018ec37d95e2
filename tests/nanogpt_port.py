"""A GPT and its training loop written in PyTorch's dialect, in the shape of nanoGPT's
model.py / train.py / sample.py (config dataclass, GPT-2 layer names, param groups split
by p.dim() >= 2, warm-up + cosine lr, estimate_loss under no_grad, nested checkpoints).

The first three import lines are the only ones that name the framework:
tests/test_nanogpt_port.py runs this file as it is (microtensor) and with those lines
switched to torch, and compares the two runs.
"""
import microtensor as torch
import microtensor.nn as nn
from microtensor.nn import functional as F

import inspect
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, asdict

import numpy as np


# ---------------------------------------------------------------------------- model.py

class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (F.layer_norm takes None)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention") and config.flash
        if not self.flash:
            # the causal mask, kept as a buffer so it follows the module around
            mask = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)   # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)   # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)   # (B, nh, T, hs)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0,
                                               is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v                                      # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)    # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None and config.block_size is not None
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the token embedding is the output projection
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)   # (t,)
        tok_emb = self.transformer.wte(idx)                          # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)                          # (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])    # only the last position: (b, 1, vocab)
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            if hasattr(block.attn, "bias"):
                block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # matrices (and embeddings) decay, biases and norm gains do not
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ---------------------------------------------------------------------------- train.py

def default_config(**overrides):
    cfg = dict(
        out_dir="out", eval_interval=10, log_interval=5, eval_iters=4, always_save_checkpoint=True,
        init_from="scratch", gradient_accumulation_steps=1, batch_size=8, block_size=32,
        n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True, learning_rate=3e-3,
        max_iters=40, weight_decay=1e-1, beta1=0.9, beta2=0.99, grad_clip=1.0, decay_lr=True,
        warmup_iters=5, lr_decay_iters=40, min_lr=3e-4, device="cpu", dtype="float32",
        compile=False, seed=1337, flash=True,
    )
    cfg.update(overrides)
    return cfg


def get_lr(it, cfg):
    """Linear warm-up, then cosine decay down to min_lr."""
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it > cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    decay_ratio = (it - cfg["warmup_iters"]) / (cfg["lr_decay_iters"] - cfg["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return cfg["min_lr"] + coeff * (cfg["learning_rate"] - cfg["min_lr"])


def make_get_batch(data, cfg):
    """Batches drawn by a numpy generator seeded from (seed, split, step), so a resumed
    run (and the same script under another framework) sees the same batches."""
    device, block_size, batch_size = cfg["device"], cfg["block_size"], cfg["batch_size"]

    def get_batch(split, step):
        d = data[split]
        rng = np.random.default_rng([cfg["seed"], 0 if split == "train" else 1, step])
        ix = torch.from_numpy(rng.integers(0, len(d) - block_size, (batch_size,)))
        x = torch.stack([torch.from_numpy((d[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((d[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)

    return get_batch


def train(data, cfg, model_state=None, log=None):
    """nanoGPT's train.py as a function: returns (model, history); writes ckpt.pt to
    out_dir. `model_state` (numpy arrays by name) replaces the initial weights, so two
    frameworks can start from the same point."""
    log = log or (lambda *a: None)
    device = cfg["device"]
    device_type = "cuda" if "cuda" in device else "cpu"
    os.makedirs(cfg["out_dir"], exist_ok=True)
    torch.manual_seed(cfg["seed"])
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[cfg["dtype"]]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type,
                                                                        dtype=ptdtype)
    get_batch = make_get_batch(data, cfg)

    iter_num, best_val_loss = 0, 1e9
    model_args = dict(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                      block_size=cfg["block_size"], bias=cfg["bias"], vocab_size=None,
                      dropout=cfg["dropout"], flash=cfg["flash"])
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    if cfg["init_from"] == "scratch":
        model_args["vocab_size"] = data["vocab_size"]
        model = GPT(GPTConfig(**model_args))
        if model_state is not None:
            model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model_state.items()})
    elif cfg["init_from"] == "resume":
        checkpoint = torch.load(ckpt_path, map_location=device)
        for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
            model_args[k] = checkpoint["model_args"][k]
        model = GPT(GPTConfig(**model_args))
        state_dict = checkpoint["model"]
        unwanted_prefix = "_orig_mod."
        for k, v in list(state_dict.items()):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        iter_num = checkpoint["iter_num"]
        best_val_loss = checkpoint["best_val_loss"]
    model.to(device)

    scaler = torch.amp.GradScaler(enabled=(cfg["dtype"] == "float16"))
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                           (cfg["beta1"], cfg["beta2"]), device_type)
    if cfg["init_from"] == "resume":
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(cfg["eval_iters"])
            for k in range(cfg["eval_iters"]):
                X, Y = get_batch(split, 10_000 + k)       # fixed eval batches
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    history = {"train_loss": [], "eval": []}
    X, Y = get_batch("train", iter_num)
    t0 = time.time()
    while True:
        lr = get_lr(iter_num, cfg) if cfg["decay_lr"] else cfg["learning_rate"]
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % cfg["eval_interval"] == 0:
            losses = estimate_loss()
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            history["eval"].append((iter_num, float(losses["train"]), float(losses["val"])))
            if losses["val"] < best_val_loss or cfg["always_save_checkpoint"]:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "model_args": model_args,
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                        "config": cfg,
                    }
                    log(f"saving checkpoint to {cfg['out_dir']}")
                    torch.save(checkpoint, ckpt_path)

        for micro_step in range(cfg["gradient_accumulation_steps"]):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / cfg["gradient_accumulation_steps"]
            X, Y = get_batch("train", iter_num + 1)       # prefetch the next batch
            scaler.scale(loss).backward()
        if cfg["grad_clip"] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        lossf = loss.item() * cfg["gradient_accumulation_steps"]
        history["train_loss"].append(lossf)
        if iter_num % cfg["log_interval"] == 0:
            log(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1
        if iter_num > cfg["max_iters"]:
            break
    return model, history


# --------------------------------------------------------------------------- sample.py

def sample(cfg, start_ids, max_new_tokens=20, temperature=0.8, top_k=10, seed=1337):
    """Load ckpt.pt as sample.py does and generate from `start_ids`."""
    device = cfg["device"]
    torch.manual_seed(seed)
    checkpoint = torch.load(os.path.join(cfg["out_dir"], "ckpt.pt"), map_location=device)
    gptconf = GPTConfig(**checkpoint["model_args"])
    model = GPT(gptconf)
    state_dict = checkpoint["model"]
    model.load_state_dict(state_dict)
    model.eval()
    model.to(device)
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
    with torch.no_grad():
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)
    return y[0].tolist(), asdict(gptconf)
