"""Each fused op (a FusedNode: a hand-written kernel forward and backward) against the
composite of primitives declared beside it: the same output, and the same gradients for
a random upstream gradient, in float64. The composite is also the op's create-graph rule,
so this is what makes its second derivative the kernel's first one differentiated."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.autograd.graph_rules import FusedNode
from microtensor.ops.attention import attention_on_views

from test_higher_order import _python_nodes

rng = np.random.default_rng(11)


def t(*shape, positive=False):
    a = rng.standard_normal(shape)
    return mt.tensor(np.abs(a) + 0.5 if positive else a, requires_grad=True)


def rope_tables(T, d):
    angles = rng.standard_normal((T, d // 2))
    return np.cos(np.repeat(angles, 2, -1)), np.sin(np.repeat(angles, 2, -1))


COS, SIN = rope_tables(5, 6)
MASK = mt.tensor(rng.standard_normal((5, 7)))
IDS = mt.tensor(np.array([[0, 3, 3], [5, 1, 0]]))

def _heads_of(x, B=2, T=5, nh=3, hs=2):
    """attention on views of x (B, T, 3C): the fused call mt.compile makes of a head split,
    with the head split itself as its composite"""
    C, item = nh * hs, x.numpy().itemsize
    views = tuple((i * C, (B, nh, T, hs), (T * 3 * C * item, hs * item, 3 * C * item, item))
                  for i in range(3))

    def chain(x):
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)
    return attention_on_views(x, views, chain, (B, T, C), is_causal=True)


# name -> (node type, call, inputs); sizes that divide nothing, kinks avoided
CASES = {
    "gelu": ("GeluBackward", lambda x: F.gelu(x), lambda: [t(7, 9)]),
    "gelu_tanh": ("GeluBackward", lambda x: F.gelu(x, approximate="tanh"), lambda: [t(7, 9)]),
    "silu": ("SiluBackward", F.silu, lambda: [t(3, 11)]),
    "linear": ("LinearBackward", F.linear, lambda: [t(2, 3, 5), t(7, 5), t(7)]),
    "linear_no_bias": ("LinearBackward", F.linear, lambda: [t(4, 5), t(3, 5)]),
    "embedding": ("EmbeddingBackward", lambda w: F.embedding(IDS, w), lambda: [t(6, 4)]),
    "embedding_padding": ("EmbeddingBackward", lambda w: F.embedding(IDS, w, padding_idx=3),
                          lambda: [t(6, 4)]),
    "dropout": ("DropoutBackward", lambda x: F.dropout(x, 0.3, training=True), lambda: [t(6, 7)]),
    "rope": ("RopeBackward", lambda x: F.rotary_embedding(x, COS, SIN), lambda: [t(2, 5, 6)]),
    "layer_norm": ("LayerNormBackward", lambda x, w, b: F.layer_norm(x, (5,), w, b, 1e-5),
                   lambda: [t(3, 4, 5), t(5), t(5)]),
    "layer_norm_2d": ("LayerNormBackward", lambda x: F.layer_norm(x, (4, 5)), lambda: [t(3, 4, 5)]),
    "rms_norm": ("RMSNormBackward", lambda x, w: F.rms_norm(x, (5,), w, 1e-6),
                 lambda: [t(3, 5), t(5)]),
    "attention_causal": ("AttentionBackward",
                         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         lambda: [t(2, 3, 5, 4), t(2, 3, 5, 4), t(2, 3, 5, 4)]),
    "attention_mask": ("AttentionBackward",
                       lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=MASK),
                       lambda: [t(2, 5, 4), t(2, 7, 4), t(2, 7, 3)]),
    "attention_live_mask": ("AttentionBackward",
                            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                            lambda: [t(2, 5, 4), t(2, 7, 4), t(2, 7, 3), t(5, 7)]),
    "attention_on_views": ("ViewsAttentionBackward", _heads_of, lambda: [t(2, 5, 18)]),
    "cumprod": ("CumprodBackward", lambda x: mt.cumprod(x, 1), lambda: [t(3, 6)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fused_kernel_is_its_composite(name):
    node_type, call, make = CASES[name]
    mt.manual_seed(3)
    inputs = make()
    out = call(*inputs)
    node = out.grad_fn
    assert isinstance(node, FusedNode) and type(node).__name__ == node_type, type(node)
    # the composite, on copies of the inputs (its own graph, its own gradients)
    copies = [None if x is None else x.detach().requires_grad_() for x in node.inputs]
    ref = node.composite(*copies)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)
    u = mt.tensor(rng.standard_normal(out.shape))
    live = [x for x in node.inputs if x is not None and x.requires_grad]
    theirs = [c for x, c in zip(node.inputs, copies) if x is not None and x.requires_grad]
    got = mt.autograd.grad(out, live, u)
    want = mt.autograd.grad(ref, theirs, u)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-12)


def test_every_fused_node_is_checked_against_its_composite():
    fused = {cls.__name__ for name, cls in _python_nodes().items()
             if issubclass(cls, FusedNode) and cls is not FusedNode}
    checked = {node_type for node_type, _, _ in CASES.values()}
    assert fused == checked, f"fused nodes without a case: {fused - checked}"
