"""The reference answers of the backprop exercise (examples/backprop_by_hand.py).

Try the exercise before reading on: copy examples/backprop_template.py and fill it in.

Every function returns dL/d(one tensor) as a numpy array of that tensor's shape, from
the forward values `f`, the gradients found so far `d` and the parameters `p` (see the
template for what each holds). `python examples/backprop_by_hand.py --solution` checks
these against the engine; the tests plant classic mistakes in them.
"""
import math

import numpy as np

_erf = np.vectorize(math.erf)


def _heads(a, n_head):
    """(B, T, C) -> (B, nh, T, hs)"""
    B, T, C = a.shape
    return a.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _merge(a):
    """(B, nh, T, hs) -> (B, T, C)"""
    B, nh, T, hs = a.shape
    return a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def _into_layer_norm(f, d, p, ln):
    """What a layer norm sends back to its input x, through mean, var and xhat:
    xhat = (x - mean) / sqrt(var + eps), var = mean((x - mean)^2), mean = mean(x)."""
    x, mean, var = f[ln + "in"], f[ln + "mean"], f[ln + "var"]
    n = x.shape[-1]
    return (d[ln + "xhat"] / np.sqrt(var + p["eps"])
            + d[ln + "var"] * 2 * (x - mean) / n
            + d[ln + "mean"] / n)


# -- the loss and the head ----------------------------------------------------------

def d_loss(f, d, p):
    return np.ones_like(f["loss"])


def d_logprobs(f, d, p):
    B, T = f["targets"].shape
    g = np.zeros_like(f["logprobs"])
    b, t = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    g[b, t, f["targets"]] = -d["loss"] / (B * T)
    return g


def d_logits(f, d, p):
    g = d["logprobs"]
    return g - np.exp(f["logprobs"]) * g.sum(-1, keepdims=True)


def d_lnf_out(f, d, p):
    return d["logits"] @ p["Wout"].T


def d_x_last(f, d, p):
    return _into_layer_norm(f, d, p, "ln_f.")


# -- every layer norm (ln1 and ln2 of each layer, ln_f) ---------------------------------

def d_ln_xhat(f, d, p):
    return d["out"] * p["w"]


def d_ln_var(f, d, p):
    x, mean, var = f["in"], f["mean"], f["var"]
    return (d["xhat"] * (x - mean) * -0.5 * (var + p["eps"]) ** -1.5).sum(-1, keepdims=True)


def d_ln_mean(f, d, p):
    x, mean, var = f["in"], f["mean"], f["var"]
    through_xhat = (-d["xhat"] / np.sqrt(var + p["eps"])).sum(-1, keepdims=True)
    through_var = d["var"] * (-2 * (x - mean)).mean(-1, keepdims=True)
    return through_xhat + through_var


# -- one layer, walked backwards from its output ---------------------------------------

def d_mlp_out(f, d, p):
    return d["out"]


def d_gelu(f, d, p):
    return d["mlp_out"] @ p["W2"].T


def d_fc(f, d, p):
    x = f["fc"]
    cdf = 0.5 * (1 + _erf(x / math.sqrt(2)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return d["gelu"] * (cdf + x * pdf)


def d_ln2_out(f, d, p):
    return d["fc"] @ p["W1"].T


def d_mid(f, d, p):
    return d["out"] + _into_layer_norm(f, d, p, "ln2.")


def d_attn_out(f, d, p):
    return d["mid"]


def d_y(f, d, p):
    return d["attn_out"] @ p["Wo"].T


def d_att(f, d, p):
    return _heads(d["y"], p["n_head"]) @ f["v"].swapaxes(-1, -2)


def d_masked(f, d, p):
    att, g = f["att"], d["att"]
    return att * (g - (g * att).sum(-1, keepdims=True))


def d_scores(f, d, p):
    return np.where(f["causal"], d["masked"], 0.0)


def d_v(f, d, p):
    return f["att"].swapaxes(-1, -2) @ _heads(d["y"], p["n_head"])


def d_k(f, d, p):
    return d["scores"].swapaxes(-1, -2) @ f["q"] * p["scale"]


def d_q(f, d, p):
    return d["scores"] @ f["k"] * p["scale"]


def d_ln1_out(f, d, p):
    return (_merge(d["q"]) @ p["Wq"].T + _merge(d["k"]) @ p["Wk"].T
            + _merge(d["v"]) @ p["Wv"].T)


def d_x(f, d, p):
    return d["mid"] + _into_layer_norm(f, d, p, "ln1.")


# -- the embeddings -------------------------------------------------------------------

def d_pos_emb(f, d, p):
    return d["x0"].sum(0)


def d_tok_emb(f, d, p):
    return d["x0"]
