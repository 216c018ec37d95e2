"""nn.MultiheadAttention and the nn.Transformer* modules against torch's: built with the
weights of torch's state_dict, they give torch's outputs, input gradients and every
parameter's gradient (float64 tight, float32 loose) across masks (bool, float, 2-D, 3-D,
key padding, is_causal), batch_first, norm_first, activations, kdim/vdim, add_bias_kv,
add_zero_attn, need_weights, unbatched inputs, train (dropout 0) and eval; float64
gradchecks and gradgradchecks; the fused kernel on the need_weights=False path; errors."""
import numpy as np
import pytest

import microtensor as mt
from microtensor import nn
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # torch's note on a bool padding mask beside a float attn_mask (both are
              # supported; microtensor turns each into an additive float mask)
              pytest.mark.filterwarnings("ignore:Support for mismatched"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]

TOL = {torch.float64: dict(rtol=1e-8, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-5)}
E, NH = 8, 2            # embed_dim, heads (head_dim 4)
B, L, S = 3, 5, 4       # batch, target length, source length (L != S: no square confusion)


# ---- helpers ------------------------------------------------------------------------------

def port(t_mod, m_mod):
    """Load torch's state_dict (as numpy) into the microtensor module; the keys must be
    torch's, in torch's order."""
    sd = t_mod.state_dict()
    assert list(m_mod.state_dict()) == list(sd)
    m_mod.load_state_dict({k: v.detach().numpy() for k, v in sd.items()})
    return m_mod


def to_mt(t_inputs):
    """torch tensors -> microtensor tensors (leaves keep requires_grad); the same torch
    object maps to the same microtensor object, so that `query is key` still holds."""
    memo = {}
    out = {}
    for name, t in t_inputs.items():
        if not isinstance(t, torch.Tensor):
            out[name] = t
            continue
        if id(t) not in memo:
            memo[id(t)] = mt.tensor(t.detach().numpy().copy(), requires_grad=t.requires_grad)
        out[name] = memo[id(t)]
    return out


def outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


def assert_same(t_mod, m_mod, t_inputs, call=None, seed=0):
    """Outputs, input gradients and parameter gradients for a random upstream gradient."""
    call = call or (lambda mod, kw: mod(**kw))
    m_inputs = to_mt(t_inputs)
    t_outs, m_outs = outputs(call(t_mod, t_inputs)), outputs(call(m_mod, m_inputs))
    assert [o is None for o in t_outs] == [o is None for o in m_outs]
    dtype = next(p.dtype for p in t_mod.parameters())
    tol = TOL[dtype]
    gen = torch.Generator().manual_seed(seed)
    pairs = [(t, m) for t, m in zip(t_outs, m_outs) if t is not None]
    grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t, _ in pairs]
    for (t, m) in pairs:
        assert tuple(m.shape) == tuple(t.shape)
        np.testing.assert_allclose(m.detach().numpy(), t.detach().numpy(), **tol)
    torch.autograd.backward([t for t, _ in pairs], grads)
    loss = sum((m * mt.tensor(g.numpy())).sum() for (_, m), g in zip(pairs, grads))
    loss.backward()
    for name, t in t_inputs.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            np.testing.assert_allclose(m_inputs[name].grad.numpy(), t.grad.numpy(), **tol,
                                       err_msg=f"gradient of input {name}")
    t_params = dict(t_mod.named_parameters())
    m_params = dict(m_mod.named_parameters())
    assert list(m_params) == list(t_params)
    for name, tp in t_params.items():
        mp = m_params[name]
        if tp.grad is None:
            assert mp.grad is None or not np.any(mp.grad.numpy()), name
            continue
        np.testing.assert_allclose(mp.grad.numpy(), tp.grad.numpy(), **tol,
                                   err_msg=f"gradient of parameter {name}")


def rand(*shape, dtype=torch.float64, grad=True, gen=None):
    return torch.randn(*shape, dtype=dtype, generator=gen).requires_grad_(grad)


def bool_mask(*shape, gen):
    """True = not allowed (torch's MultiheadAttention); the first key always allowed, so
    that no row is masked whole (torch gives NaN there, microtensor's kernel zeros)."""
    m = torch.rand(*shape, generator=gen) > 0.6
    m[..., 0] = False
    return m


def float_mask(*shape, dtype, gen):
    """Values added to the scores, -inf where bool_mask says."""
    m = torch.randn(*shape, dtype=dtype, generator=gen)
    return m.masked_fill(bool_mask(*shape, gen=gen), float("-inf"))


def masks(kind, dtype, gen, batched=True, L=L, S=S, nh=NH, B=B):
    """attn_mask / key_padding_mask / is_causal keyword arguments of one kind of mask."""
    bsz = B if batched else 1
    kpm_shape = (B, S) if batched else (S,)
    three = (bsz * nh, L, S)
    return {
        "none": {},
        "bool2d": dict(attn_mask=bool_mask(L, S, gen=gen)),
        "float2d": dict(attn_mask=float_mask(L, S, dtype=dtype, gen=gen)),
        "bool3d": dict(attn_mask=bool_mask(*three, gen=gen)),
        "float3d": dict(attn_mask=float_mask(*three, dtype=dtype, gen=gen)),
        "kpm_bool": dict(key_padding_mask=bool_mask(*kpm_shape, gen=gen)),
        "kpm_float": dict(key_padding_mask=float_mask(*kpm_shape, dtype=dtype, gen=gen)),
        "bool2d+kpm": dict(attn_mask=bool_mask(L, S, gen=gen),
                           key_padding_mask=bool_mask(*kpm_shape, gen=gen)),
        "float3d+kpm": dict(attn_mask=float_mask(*three, dtype=dtype, gen=gen),
                            key_padding_mask=float_mask(*kpm_shape, dtype=dtype, gen=gen)),
        "causal": dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(
            L, dtype=dtype), is_causal=True),
        "causal+kpm": dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(
            L, dtype=dtype), is_causal=True, key_padding_mask=bool_mask(*kpm_shape, gen=gen)),
    }[kind]


def seq(T, E, batch_first, dtype=torch.float64, gen=None, batched=True):
    if not batched:
        return rand(T, E, dtype=dtype, gen=gen)
    return rand(*((B, T, E) if batch_first else (T, B, E)), dtype=dtype, gen=gen)


def mha_pair(dtype=torch.float64, **kw):
    t = torch.nn.MultiheadAttention(E, NH, **kw).to(dtype)
    m = nn.MultiheadAttention(E, NH, **kw)
    m.to(mt.float64 if dtype == torch.float64 else mt.float32)
    return t, port(t, m)


# ---- MultiheadAttention ---------------------------------------------------------------------

MASK_KINDS = ["none", "bool2d", "float2d", "bool3d", "float3d", "kpm_bool", "kpm_float",
              "bool2d+kpm", "float3d+kpm"]


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mha_self_attention_masks(kind, batch_first, need_weights, average):
    gen = torch.Generator().manual_seed(1)
    t, m = mha_pair(batch_first=batch_first)
    x = seq(L, E, batch_first, gen=gen)
    kw = masks(kind, torch.float64, gen, S=L)
    assert_same(t, m, dict(query=x, key=x, value=x, need_weights=need_weights,
                           average_attn_weights=average, **kw))


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kind", ["causal", "causal+kpm"])
def test_mha_is_causal(kind, need_weights):
    # need_weights=False without padding: the mask is dropped for the kernel's causal path
    gen = torch.Generator().manual_seed(2)
    t, m = mha_pair(batch_first=True)
    x = seq(L, E, True, gen=gen)
    kw = masks(kind, torch.float64, gen, S=L)
    assert_same(t, m, dict(query=x, key=x, value=x, need_weights=need_weights, **kw))


def test_mha_is_causal_is_a_hint_that_replaces_the_mask():
    # torch's rule: is_causal with need_weights=False and no padding ignores attn_mask's
    # values; a non-causal mask given with the hint is overruled by the causal one
    gen = torch.Generator().manual_seed(3)
    t, m = mha_pair(batch_first=True)
    x = seq(L, E, True, gen=gen)
    kw = dict(attn_mask=bool_mask(L, L, gen=gen), is_causal=True, need_weights=False)
    assert_same(t, m, dict(query=x, key=x, value=x, **kw))


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("variant", ["cross", "separate", "bias_kv", "zero_attn",
                                     "bias_kv+zero_attn", "kdim_vdim", "no_bias"])
@pytest.mark.parametrize("kind", ["none", "bool2d+kpm", "float3d+kpm"])
def test_mha_variants(variant, kind, need_weights, average):
    gen = torch.Generator().manual_seed(4)
    kw = {"bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True),
          "bias_kv+zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
          "kdim_vdim": dict(kdim=5, vdim=7), "no_bias": dict(bias=False)}.get(variant, {})
    t, m = mha_pair(**kw)
    q = seq(L, E, False, gen=gen)
    k = seq(S, kw.get("kdim", E), False, gen=gen)
    if variant == "cross" or variant == "no_bias":
        v = k                                       # key is value: one (2E) projection
    else:
        v = seq(S, kw.get("vdim", E), False, gen=gen)
    assert_same(t, m, dict(query=q, key=k, value=v, need_weights=need_weights,
                           average_attn_weights=average, **masks(kind, torch.float64, gen)))


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("kind", ["none", "bool2d", "float3d", "kpm_bool", "bool2d+kpm"])
@pytest.mark.parametrize("variant", ["plain", "bias_kv+zero_attn", "kdim_vdim"])
def test_mha_unbatched(variant, kind, need_weights, average):
    gen = torch.Generator().manual_seed(5)
    kw = {"bias_kv+zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
          "kdim_vdim": dict(kdim=5, vdim=7)}.get(variant, {})
    t, m = mha_pair(batch_first=True, **kw)    # batch_first has no say on 2-D inputs
    q = seq(L, E, True, gen=gen, batched=False)
    k = seq(S, kw.get("kdim", E), True, gen=gen, batched=False)
    v = seq(S, kw.get("vdim", E), True, gen=gen, batched=False)
    assert_same(t, m, dict(query=q, key=k, value=v, need_weights=need_weights,
                           average_attn_weights=average,
                           **masks(kind, torch.float64, gen, batched=False)))


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_float32(batch_first, need_weights):
    gen = torch.Generator().manual_seed(6)
    t, m = mha_pair(dtype=torch.float32, batch_first=batch_first, add_bias_kv=True)
    x = seq(L, E, batch_first, dtype=torch.float32, gen=gen)
    kw = masks("bool2d+kpm", torch.float32, gen, S=L)
    assert_same(t, m, dict(query=x, key=x, value=x, need_weights=need_weights, **kw))


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dims", [2, 3])
def test_mha_learned_float_mask_takes_its_gradient(dims, need_weights):
    # a float attn_mask that requires grad (a learned bias) is an input like any other
    gen = torch.Generator().manual_seed(9)
    t, m = mha_pair(batch_first=True)
    x = seq(L, E, True, gen=gen)
    bias = rand(*((L, L) if dims == 2 else (B * NH, L, L)), gen=gen)
    assert_same(t, m, dict(query=x, key=x, value=x, attn_mask=bias, need_weights=need_weights,
                           key_padding_mask=float_mask(B, L, dtype=torch.float64, gen=gen)))


@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_dropout_zero_in_training_and_dropout_off_in_eval(need_weights):
    gen = torch.Generator().manual_seed(7)
    t, m = mha_pair(batch_first=True, dropout=0.0)
    x = seq(L, E, True, gen=gen)
    assert m.training and t.training
    assert_same(t, m, dict(query=x, key=x, value=x, need_weights=need_weights))
    t, m = mha_pair(batch_first=True, dropout=0.5)
    t.eval(), m.eval()
    x = seq(L, E, True, gen=gen)
    kw = masks("kpm_bool", torch.float64, gen, S=L)
    assert_same(t, m, dict(query=x, key=x, value=x, need_weights=need_weights, **kw))


def test_mha_parameters_and_init_are_torchs():
    for kw, names in [({}, ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]),
                      (dict(kdim=5, vdim=7, add_bias_kv=True),
                       ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                        "bias_k", "bias_v", "out_proj.weight", "out_proj.bias"]),
                      (dict(bias=False), ["in_proj_weight", "out_proj.weight"])]:
        t = torch.nn.MultiheadAttention(E, NH, **kw)
        m = nn.MultiheadAttention(E, NH, **kw)
        assert list(dict(t.named_parameters())) == names == list(dict(m.named_parameters()))
        for (name, tp), mp in zip(t.named_parameters(), m.parameters()):
            assert tuple(mp.shape) == tuple(tp.shape) and mp.dtype == mt.float32, name
    m = nn.MultiheadAttention(64, 4, add_bias_kv=True)
    w = m.in_proj_weight.numpy()
    bound = np.sqrt(6.0 / (64 + 3 * 64))                     # xavier_uniform_ of (3E, E)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert not np.any(m.in_proj_bias.numpy()) and not np.any(m.out_proj.bias.numpy())
    wo = m.out_proj.weight.numpy()                           # Linear's own default
    assert np.abs(wo).max() <= 1 / 8 and np.abs(wo).max() > 0.9 / 8
    assert 0.1 < m.bias_k.numpy().std() < 0.25                # xavier_normal_: sqrt(2/128)
    assert (m.embed_dim, m.num_heads, m.head_dim, m.kdim, m.vdim, m._qkv_same_embed_dim) == \
        (64, 4, 16, 64, 64, True)


def _names(node, seen=None):
    """Every node name of a graph (from an output's grad_fn)."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return []
    seen.add(id(node))
    names = [node.name()]
    for nxt, _ in node.next_functions:
        names += _names(nxt, seen)
    return names


@pytest.mark.parametrize("kind", ["none", "bool2d+kpm", "causal"])
def test_mha_need_weights_false_runs_the_fused_attention_kernel(kind):
    gen = torch.Generator().manual_seed(8)
    m = nn.MultiheadAttention(E, NH, batch_first=True).double()
    kw = to_mt(masks(kind, torch.float64, gen, S=L))
    x = mt.tensor(np.random.randn(B, L, E), requires_grad=True)
    out, weights = m(x, x, x, need_weights=False, **kw)
    names = _names(out.grad_fn)
    assert weights is None
    assert "AttentionBackward" in names and "SoftmaxBackward" not in names
    out, weights = m(x, x, x, need_weights=True, **kw)       # the weights: explicit softmax
    names = _names(out.grad_fn)
    assert "SoftmaxBackward" in names and "AttentionBackward" not in names
    # and the same without a graph: the profiler sees F.scaled_dot_product_attention
    from microtensor.profiler import Profiler
    with mt.no_grad(), Profiler(backward=False) as prof:
        m(x, x, x, need_weights=False, **kw)
    assert any("scaled_dot_product_attention" in label for _, label in prof.stats)
    layer = nn.TransformerEncoderLayer(E, NH, 16, dropout=0.0, batch_first=True).double()
    assert "AttentionBackward" in _names(layer(x).grad_fn)


def test_mha_gradcheck_and_gradgradcheck():
    m = nn.MultiheadAttention(4, 2, add_bias_kv=True).double()
    q = mt.tensor(np.random.randn(3, 2, 4), requires_grad=True)
    kv = mt.tensor(np.random.randn(2, 2, 4), requires_grad=True)
    am = mt.tensor(np.array([[False, True], [False, False], [True, False]]))
    params = list(m.parameters())
    for need_weights in (True, False):
        def f(q, kv, *ps):
            out, w = m(q, kv, kv, attn_mask=am, need_weights=need_weights)
            return (out, w) if need_weights else out
        assert mt.gradcheck(f, (q, kv, *params))
        assert mt.gradgradcheck(f, (q, kv, *params))


# ---- Transformer layers -----------------------------------------------------------------------

ACTIVATIONS = {
    "relu": ("relu", "relu"),
    "gelu": ("gelu", "gelu"),
    "function": (lambda x: torch.nn.functional.silu(x), lambda x: F.silu(x)),
    "module": (torch.nn.GELU(approximate="tanh"), nn.GELU(approximate="tanh")),
}


def layer_pair(name, dtype=torch.float64, activation="relu", **kw):
    t_act, m_act = ACTIVATIONS[activation]
    t = getattr(torch.nn, name)(E, NH, 16, activation=t_act, **kw).to(dtype)
    m = getattr(nn, name)(E, NH, 16, activation=m_act, **kw)
    m.to(mt.float64 if dtype == torch.float64 else mt.float32)
    return t, port(t, m)


def layer_masks(kind, dtype, gen, T, batched=True, prefix="src", mask_name="src_mask"):
    kw = masks(kind, dtype, gen, batched=batched, L=T, S=T)
    out = {}
    if "attn_mask" in kw:
        out[mask_name] = kw["attn_mask"]
    if "key_padding_mask" in kw:
        out[f"{prefix}_key_padding_mask"] = kw["key_padding_mask"]
    if kw.get("is_causal"):
        out["is_causal" if prefix == "src" else f"{prefix}_is_causal"] = True
    return out


ENC_MASKS = ["none", "bool2d", "float3d", "kpm_bool", "kpm_float", "bool2d+kpm", "causal",
             "causal+kpm"]


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_encoder_layer(batch_first, norm_first, activation):
    gen = torch.Generator().manual_seed(10)
    t, m = layer_pair("TransformerEncoderLayer", activation=activation, dropout=0.0,
                      batch_first=batch_first, norm_first=norm_first)
    x = seq(L, E, batch_first, gen=gen)
    assert_same(t, m, dict(src=x, **layer_masks("bool2d+kpm", torch.float64, gen, L)))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("kind", ENC_MASKS)
def test_encoder_layer_masks_train_and_eval(kind, train):
    gen = torch.Generator().manual_seed(11)
    # dropout 0 in training; dropout 0.3 switched off by eval()
    t, m = layer_pair("TransformerEncoderLayer", dropout=0.0 if train else 0.3,
                      batch_first=True, norm_first=kind.startswith("causal"))
    t.train(train), m.train(train)
    x = seq(L, E, True, gen=gen)
    assert_same(t, m, dict(src=x, **layer_masks(kind, torch.float64, gen, L)))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("kind", ["none", "bool2d", "kpm_bool", "causal"])
def test_encoder_layer_unbatched(kind, norm_first):
    gen = torch.Generator().manual_seed(12)
    t, m = layer_pair("TransformerEncoderLayer", dropout=0.0, norm_first=norm_first)
    x = seq(L, E, False, gen=gen, batched=False)
    assert_same(t, m, dict(src=x, **layer_masks(kind, torch.float64, gen, L, batched=False)))


def decoder_inputs(kind, memory_kind, gen, batch_first, dtype=torch.float64, batched=True):
    tgt = seq(L, E, batch_first, dtype=dtype, gen=gen, batched=batched)
    memory = seq(S, E, batch_first, dtype=dtype, gen=gen, batched=batched)
    kw = layer_masks(kind, dtype, gen, L, batched=batched, prefix="tgt", mask_name="tgt_mask")
    mk = masks(memory_kind, dtype, gen, batched=batched)
    if "attn_mask" in mk:
        kw["memory_mask"] = mk["attn_mask"]
    if "key_padding_mask" in mk:
        kw["memory_key_padding_mask"] = mk["key_padding_mask"]
    return dict(tgt=tgt, memory=memory, **kw)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_decoder_layer(batch_first, norm_first, activation):
    gen = torch.Generator().manual_seed(13)
    t, m = layer_pair("TransformerDecoderLayer", activation=activation, dropout=0.0,
                      batch_first=batch_first, norm_first=norm_first)
    assert_same(t, m, decoder_inputs("causal+kpm", "bool2d+kpm", gen, batch_first))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("kind,memory_kind", [("none", "none"), ("causal", "kpm_float"),
                                              ("bool3d", "float2d"), ("kpm_bool", "float3d+kpm"),
                                              ("float2d", "bool3d")])
def test_decoder_layer_masks_train_and_eval(kind, memory_kind, train):
    gen = torch.Generator().manual_seed(14)
    t, m = layer_pair("TransformerDecoderLayer", dropout=0.0 if train else 0.3)
    t.train(train), m.train(train)
    assert_same(t, m, decoder_inputs(kind, memory_kind, gen, False))


def test_decoder_layer_unbatched_and_float32():
    gen = torch.Generator().manual_seed(15)
    t, m = layer_pair("TransformerDecoderLayer", dropout=0.0, norm_first=True)
    assert_same(t, m, decoder_inputs("causal", "kpm_bool", gen, False, batched=False))
    t, m = layer_pair("TransformerDecoderLayer", dtype=torch.float32, dropout=0.0,
                      batch_first=True, activation="gelu")
    assert_same(t, m, decoder_inputs("bool2d+kpm", "kpm_bool", gen, True, dtype=torch.float32))
    t, m = layer_pair("TransformerEncoderLayer", dtype=torch.float32, dropout=0.0)
    x = seq(L, E, False, dtype=torch.float32, gen=gen)
    assert_same(t, m, dict(src=x, **layer_masks("bool2d+kpm", torch.float32, gen, L)))


def test_layer_gradcheck_and_gradgradcheck():
    enc = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, activation="gelu").double()
    dec = nn.TransformerDecoderLayer(4, 2, 6, dropout=0.0, norm_first=True).double()
    x = mt.tensor(np.random.randn(3, 2, 4), requires_grad=True)
    mem = mt.tensor(np.random.randn(2, 2, 4), requires_grad=True)
    kpm = mt.tensor(np.array([[False, False, True], [False, False, False]]))
    causal = nn.Transformer.generate_square_subsequent_mask(3, dtype=mt.float64)
    enc_params, dec_params = list(enc.parameters()), list(dec.parameters())
    f_enc = lambda x, *ps: enc(x, src_key_padding_mask=kpm)                   # noqa: E731
    f_dec = lambda x, mem, *ps: dec(x, mem, tgt_mask=causal, tgt_is_causal=True)  # noqa: E731
    assert mt.gradcheck(f_enc, (x, *enc_params))
    assert mt.gradcheck(f_dec, (x, mem, *dec_params))
    assert mt.gradgradcheck(f_enc, (x, *enc_params))
    assert mt.gradgradcheck(f_dec, (x, mem, *dec_params), fast_mode=True)   # 8 directions


# ---- stacks and the whole Transformer ---------------------------------------------------------

@pytest.mark.parametrize("mask", ["none", "causal_detected", "causal_hint", "bool+kpm"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_encoder_and_decoder_stacks(batch_first, mask):
    gen = torch.Generator().manual_seed(16)
    t_layer, m_layer = layer_pair("TransformerEncoderLayer", dropout=0.0, batch_first=batch_first)
    t = torch.nn.TransformerEncoder(t_layer, 2, norm=torch.nn.LayerNorm(E).double(),
                                    enable_nested_tensor=False)
    m = port(t, nn.TransformerEncoder(m_layer, 2, norm=nn.LayerNorm(E).double()))
    x = seq(L, E, batch_first, gen=gen)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    kw = {"none": {}, "causal_detected": dict(mask=causal),
          "causal_hint": dict(mask=causal, is_causal=True),
          "bool+kpm": dict(mask=bool_mask(L, L, gen=gen),
                           src_key_padding_mask=bool_mask(B, L, gen=gen))}[mask]
    assert_same(t, m, dict(src=x, **kw))

    t_layer, m_layer = layer_pair("TransformerDecoderLayer", dropout=0.0, batch_first=batch_first)
    t = torch.nn.TransformerDecoder(t_layer, 2)
    m = port(t, nn.TransformerDecoder(m_layer, 2))
    memory = seq(S, E, batch_first, gen=gen)
    tgt = seq(L, E, batch_first, gen=gen)
    kw = {"none": {}, "causal_detected": dict(tgt_mask=causal),
          "causal_hint": dict(tgt_mask=causal, tgt_is_causal=True),
          "bool+kpm": dict(tgt_mask=bool_mask(L, L, gen=gen),
                           memory_key_padding_mask=bool_mask(B, S, gen=gen))}[mask]
    assert_same(t, m, dict(tgt=tgt, memory=memory, **kw))


def test_layers_are_deep_copies():
    layer = nn.TransformerEncoderLayer(E, NH, 16)
    enc = nn.TransformerEncoder(layer, 3)
    ws = [enc.layers[i].linear1.weight for i in range(3)]
    assert len({id(w) for w in ws + [layer.linear1.weight]}) == 4
    assert all(np.array_equal(w.numpy(), layer.linear1.weight.numpy()) for w in ws)
    ws[0]._data[...] = 0
    assert np.any(ws[1].numpy())                   # no shared memory
    assert len(list(enc.parameters())) == 3 * len(list(layer.parameters()))


@pytest.mark.parametrize("batch_first,norm_first", [(False, False), (True, True)])
def test_transformer(batch_first, norm_first):
    gen = torch.Generator().manual_seed(17)
    kw = dict(d_model=E, nhead=NH, num_encoder_layers=2, num_decoder_layers=1,
              dim_feedforward=16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    t = torch.nn.Transformer(**kw).double()
    m = port(t, nn.Transformer(**kw).double())
    src, tgt = seq(S, E, batch_first, gen=gen), seq(L, E, batch_first, gen=gen)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=mt.float64)
    t_tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    np.testing.assert_array_equal(tgt_mask.numpy(), t_tgt_mask.numpy())
    assert_same(t, m, dict(src=src, tgt=tgt, tgt_mask=t_tgt_mask,
                           src_key_padding_mask=bool_mask(B, S, gen=gen),
                           memory_key_padding_mask=bool_mask(B, S, gen=gen)))
    # unbatched
    src, tgt = seq(S, E, batch_first, gen=gen, batched=False), seq(L, E, batch_first, gen=gen,
                                                                   batched=False)
    assert_same(t, m, dict(src=src, tgt=tgt, tgt_mask=t_tgt_mask, tgt_is_causal=True))


def test_transformer_init_and_names():
    t = torch.nn.Transformer(16, 2, 1, 1, 32)
    m = nn.Transformer(16, 2, 1, 1, 32)
    assert list(m.state_dict()) == list(t.state_dict())
    for name, p in m.named_parameters():
        if p.ndim > 1:                                # every matrix: xavier_uniform_
            bound = np.sqrt(6.0 / sum(p.shape[:2]))
            assert np.abs(p.numpy()).max() <= bound, name
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    assert mask.dtype == mt.float32
    np.testing.assert_array_equal(mask.numpy(), torch.nn.Transformer.generate_square_subsequent_mask(4).numpy())
    assert (m.d_model, m.nhead, m.batch_first) == (16, 2, False)
    custom = nn.Transformer(16, 2, custom_encoder=nn.Identity(), custom_decoder=nn.Identity())
    assert isinstance(custom.encoder, nn.Identity)


# ---- errors --------------------------------------------------------------------------------------

def test_errors():
    with pytest.raises(mt.ShapeError, match="divisible"):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="greater than 0"):
        nn.MultiheadAttention(0, 1)
    with pytest.raises(ValueError, match="activation should be relu/gelu"):
        nn.TransformerEncoderLayer(E, NH, activation="tanh")
    m = nn.MultiheadAttention(E, NH)
    x = mt.randn(L, B, E)
    bad = [
        (dict(query=mt.randn(L, B, 1, E)), "2-D or batched 3-D"),
        (dict(key=mt.randn(L, E), value=mt.randn(L, E)), "must be 3-D"),
        (dict(query=mt.randn(L, B, E + 1)), "embedding dimension"),
        (dict(key=mt.randn(L + 1, B, E)), "sequence and batch dims"),
        (dict(key=mt.randn(L, B + 1, E), value=mt.randn(L, B + 1, E)), "batch sizes"),
        (dict(attn_mask=mt.zeros(L, L + 1)), r"2-D attn_mask is \(5, 6\), but should be \(5, 5\)"),
        (dict(attn_mask=mt.zeros(B, L, L)), r"should be \(6, 5, 5\)"),
        (dict(attn_mask=mt.zeros(1, 1, L, L)), "2-D or 3-D"),
        (dict(key_padding_mask=mt.zeros(B, L + 1)), r"should be \(3, 5\)"),
        (dict(key_padding_mask=mt.zeros(L)), "must be None or 2-D"),
    ]
    for kw, message in bad:
        args = dict(query=x, key=x, value=x)
        args.update(kw)
        with pytest.raises(mt.ShapeError, match=message):
            m(**args)
    with pytest.raises(TypeError, match="only bool and floating"):
        m(x, x, x, attn_mask=mt.zeros(L, L, dtype=mt.int64))
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        m(x, x, x, is_causal=True)
    with pytest.raises(mt.ShapeError, match=r"should be \(2, 5, 5\)"):         # unbatched
        m(x[:, 0], x[:, 0], x[:, 0], attn_mask=mt.zeros(NH, L, L + 1))
    tr = nn.Transformer(E, NH, 1, 1, 16)
    with pytest.raises(mt.ShapeError, match="batch number"):
        tr(mt.randn(S, B, E), mt.randn(L, B + 1, E))
    with pytest.raises(mt.ShapeError, match="d_model"):
        tr(mt.randn(S, B, E), mt.randn(L, B, E + 2))
