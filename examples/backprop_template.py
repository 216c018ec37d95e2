"""Your backward pass of a small GPT: fill in one numpy function per kind of tensor.

    cp examples/backprop_template.py mine.py
    python examples/backprop_by_hand.py --mine mine.py     # after each function you write

The forward (examples/backprop_by_hand.py, `forward`), for a batch of B=4 sequences of
T=8 characters, width C=16, two heads of size hs=8, two layers:

    x0 = tok_emb + pos_emb                      tok_emb = wte[idx], pos_emb = wpe[:T]
    for each layer (x is its input stream, out its output stream):
        ln1.* = layer_norm(x)                   mean, var, xhat, out = xhat * w + b
        q, k, v = heads(ln1.out @ Wq), heads(ln1.out @ Wk), heads(ln1.out @ Wv)
        scores = q @ k^T * scale                scale = 1 / sqrt(hs)
        masked = where(causal, scores, -inf)
        att = softmax(masked, -1)
        y = merge_heads(att @ v)                (B, nh, T, hs) -> (B, T, C)
        attn_out = y @ Wo
        mid = x + attn_out
        ln2.* = layer_norm(mid)
        fc = ln2.out @ W1 + b1;  gelu = gelu(fc);  mlp_out = gelu @ W2 + b2
        out = mid + mlp_out
    ln_f.* = layer_norm(x2);  logits = ln_f.out @ Wout;  logprobs = log_softmax(logits)
    loss = -mean over (b, t) of logprobs[b, t, targets[b, t]]

    layer_norm(x): mean = x.mean(-1, keepdims)     var = ((x - mean) ** 2).mean(-1, keepdims)
                   xhat = (x - mean) / sqrt(var + eps)     out = xhat * w + b

Each function gets three dict-like arguments and returns dL/d(its tensor) as a numpy
array of that tensor's shape:

    f   forward values: f["q"], f["att"], ...; also f["idx"], f["targets"] (B, T) and
        f["causal"] (T, T), True where a query may see a key;
    d   the gradients computed so far (yours, in the order backward computes them:
        `python examples/backprop_by_hand.py` lists it);
    p   parameters: p["Wq"], p["W1"], p["b1"], ... and the constants p["eps"],
        p["scale"] (1 / sqrt(hs)), p["n_head"].

Inside a layer's functions the names are the layer's own: f["q"] is this layer's q,
d["out"] the gradient of its output stream, f["x"] its input stream, f["ln1.xhat"] its
first layer norm's xhat, p["Wq"] its weight. The three d_ln_* functions run for every
layer norm (ln1 and ln2 of each layer, and ln_f), with the names "in" (the norm's input
stream), "mean", "var", "xhat", "out", and p["w"], p["b"] its parameters. Global names
("loss", "h0.q", "x1", "ln_f.out") work everywhere.

A function that raises NotImplementedError counts as not done yet; helpers of your own
are fine (any name that does not start with d_).
"""
import math

import numpy as np


# -- the loss and the head ----------------------------------------------------------

def d_loss(f, d, p):
    """dL/dloss, shape (): where backward starts. (Done for you.)"""
    return np.ones_like(f["loss"])


def d_logprobs(f, d, p):
    """(B, T, V). loss = -mean over the B*T positions of logprobs[b, t, targets[b, t]]."""
    raise NotImplementedError


def d_logits(f, d, p):
    """(B, T, V). logprobs = logits - log(sum(exp(logits), -1)); exp(logprobs) is softmax."""
    raise NotImplementedError


def d_lnf_out(f, d, p):
    """(B, T, C). logits = ln_f.out @ Wout."""
    raise NotImplementedError


def d_x_last(f, d, p):
    """(B, T, C), the stream x2 out of the last layer: read by ln_f only (its mean, its
    variance and its xhat all read it)."""
    raise NotImplementedError


# -- every layer norm: names "in", "mean", "var", "xhat", "out", p["w"], p["b"] ----------

def d_ln_xhat(f, d, p):
    """(B, T, C). out = xhat * w + b."""
    raise NotImplementedError


def d_ln_var(f, d, p):
    """(B, T, 1). xhat = (in - mean) * (var + eps) ** -0.5."""
    raise NotImplementedError


def d_ln_mean(f, d, p):
    """(B, T, 1). mean is read by xhat and by var = ((in - mean) ** 2).mean(-1)."""
    raise NotImplementedError


# -- one layer, from its output stream back to its input stream --------------------------

def d_mlp_out(f, d, p):
    """(B, T, C). out = mid + mlp_out."""
    raise NotImplementedError


def d_gelu(f, d, p):
    """(B, T, 4C). mlp_out = gelu @ W2 + b2."""
    raise NotImplementedError


def d_fc(f, d, p):
    """(B, T, 4C). gelu = fc * Phi(fc), Phi the standard normal CDF:
    Phi(x) = 0.5 * (1 + erf(x / sqrt(2))), its density phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
    (numpy has no erf: np.vectorize(math.erf) does.)"""
    raise NotImplementedError


def d_ln2_out(f, d, p):
    """(B, T, C). fc = ln2.out @ W1 + b1."""
    raise NotImplementedError


def d_mid(f, d, p):
    """(B, T, C). mid is read twice: by out = mid + mlp_out, and by ln2 (its mean, var
    and xhat)."""
    raise NotImplementedError


def d_attn_out(f, d, p):
    """(B, T, C). mid = x + attn_out."""
    raise NotImplementedError


def d_y(f, d, p):
    """(B, T, C). attn_out = y @ Wo."""
    raise NotImplementedError


def d_att(f, d, p):
    """(B, nh, T, T). y = merge_heads(att @ v): merge_heads(a) is
    a.transpose(0, 2, 1, 3).reshape(B, T, C)."""
    raise NotImplementedError


def d_masked(f, d, p):
    """(B, nh, T, T). att = softmax(masked, -1), row by row."""
    raise NotImplementedError


def d_scores(f, d, p):
    """(B, nh, T, T). masked = where(causal, scores, -inf)."""
    raise NotImplementedError


def d_v(f, d, p):
    """(B, nh, T, hs). y = merge_heads(att @ v)."""
    raise NotImplementedError


def d_k(f, d, p):
    """(B, nh, T, hs). scores = q @ k^T * scale (k^T: the last two axes swapped)."""
    raise NotImplementedError


def d_q(f, d, p):
    """(B, nh, T, hs). scores = q @ k^T * scale."""
    raise NotImplementedError


def d_ln1_out(f, d, p):
    """(B, T, C). q, k, v = heads(ln1.out @ Wq), heads(ln1.out @ Wk), heads(ln1.out @ Wv);
    heads(a) is a.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)."""
    raise NotImplementedError


def d_x(f, d, p):
    """(B, T, C), the stream into the layer (x0 for the first, x1 for the second): read
    by mid = x + attn_out and by ln1."""
    raise NotImplementedError


# -- the embeddings -------------------------------------------------------------------

def d_pos_emb(f, d, p):
    """(T, C). x0 = tok_emb + pos_emb: pos_emb (T, C) is broadcast over the batch."""
    raise NotImplementedError


def d_tok_emb(f, d, p):
    """(B, T, C). x0 = tok_emb + pos_emb."""
    raise NotImplementedError
