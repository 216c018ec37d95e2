"""nn.Module registration, state dicts, modes and casts; the layers against numpy and
float64 gradchecks; nn.init; nn.utils.clip_grad_norm_."""
import math

import numpy as np
import pytest
from scipy.special import erf

import microtensor as mt
from microtensor import nn


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = nn.LayerNorm(n)
        self.fc = nn.Linear(n, n)
        self.register_buffer("mask", mt.ones(n))
        self.register_buffer("scratch", mt.zeros(n), persistent=False)

    def forward(self, x):
        return self.fc(self.ln(x)) * self.mask


class TinyLM(nn.Module):
    """nanoGPT's layout in miniature, with a tied embedding / output weight."""

    def __init__(self, vocab=11, n=6, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n),
            h=nn.ModuleList([Block(n) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n),
        ))
        self.lm_head = nn.Linear(n, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight      # weight tying

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = x + block(x)
        return self.lm_head(self.transformer.ln_f(x))


# -- registration ---------------------------------------------------------------------

def test_attribute_assignment_registers():
    m = Block(4)
    assert list(m._parameters) == [] and list(m._modules) == ["ln", "fc"]
    assert [n for n, _ in m.named_parameters()] == ["ln.weight", "ln.bias", "fc.weight", "fc.bias"]
    assert [n for n, _ in m.named_buffers()] == ["mask", "scratch"]
    assert list(m.state_dict()) == ["mask", "ln.weight", "ln.bias", "fc.weight", "fc.bias"]
    assert [n for n, _ in m.named_children()] == ["ln", "fc"]
    assert [n for n, _ in m.named_modules()] == ["", "ln", "fc"]
    assert m.fc.weight is m._modules["fc"]._parameters["weight"]
    m.extra = nn.Parameter(mt.zeros(2))
    assert "extra" in m._parameters and "extra" not in m.__dict__
    m.plain = mt.zeros(2)                     # a plain tensor is just an attribute
    assert "plain" not in m._parameters and "plain" not in m._buffers
    with pytest.raises(TypeError, match="extra"):
        m.extra = mt.zeros(2)                 # a parameter slot takes Parameters only
    m.extra = None
    assert m.extra is None and "extra" not in dict(m.named_parameters())
    del m.fc
    assert "fc" not in m._modules
    with pytest.raises(AttributeError, match="fc"):
        m.fc
    with pytest.raises(TypeError, match="buffer"):
        m.mask = np.ones(4)
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("ln", mt.zeros(1))
    with pytest.raises(KeyError, match=r"\."):
        m.register_parameter("a.b", None)


def test_assignment_before_init_is_an_error():
    class Broken(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(2, 2)

    with pytest.raises(AttributeError, match="__init__"):
        Broken()


def test_containers():
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert len(seq) == 3 and isinstance(seq[1], nn.ReLU) and seq[-1] is seq[2]
    assert [type(m).__name__ for m in seq] == ["Linear", "ReLU", "Linear"]
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(seq[:2]) == 2
    x = mt.randn(5, 3)
    np.testing.assert_allclose(seq(x).numpy(), seq[2](seq[1](seq[0](x))).numpy())
    with pytest.raises(IndexError):
        seq[3]

    ml = nn.ModuleList([nn.Linear(2, 2)])
    ml.append(nn.Tanh())
    ml.extend([nn.Linear(2, 3), nn.Identity()])
    assert len(ml) == 4 and isinstance(ml[-1], nn.Identity)
    assert list(ml.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    del ml[1]
    assert [type(m).__name__ for m in ml] == ["Linear", "Linear", "Identity"]
    assert list(ml.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]

    md = nn.ModuleDict({"a": nn.Linear(2, 2)})
    md["b"] = nn.Linear(2, 1, bias=False)
    assert list(md) == ["a", "b"] and "b" in md and len(md) == 2
    assert list(md.state_dict()) == ["a.weight", "a.bias", "b.weight"]
    assert md.b is md["b"]


def test_tied_parameter_counted_once_but_saved_under_both_names():
    model = TinyLM()
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    params = list(model.parameters())
    assert len(params) == len({id(p) for p in params}) == len(names)
    assert sum(p.numel() for p in params) == 11 * 6 + 2 * (2 * 6 + 6 * 6 + 6) + 2 * 6
    sd = model.state_dict()
    assert "transformer.wte.weight" in sd and "lm_head.weight" in sd
    assert np.shares_memory(sd["transformer.wte.weight"].numpy(), sd["lm_head.weight"].numpy())
    assert "transformer.h.1.mask" in sd and "transformer.h.1.scratch" not in sd
    assert "transformer.h.0.fc.bias" in sd
    # detached views of the live values
    for value in sd.values():
        assert not value.requires_grad and value.grad_fn is None
    assert np.shares_memory(sd["transformer.ln_f.weight"].numpy(), model.transformer.ln_f.weight.numpy())


def test_shared_submodule_walked_once():
    shared = nn.Linear(2, 2)
    seq = nn.Sequential(shared, nn.ReLU(), shared)
    assert len(list(seq.modules())) == 3            # seq, shared, relu
    assert len(list(seq.parameters())) == 2
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


# -- load_state_dict ----------------------------------------------------------------------

def test_load_state_dict_round_trip_in_place():
    a, b = TinyLM(), TinyLM()
    idx = mt.randint(0, 11, (2, 5))
    b_params = {n: (p, p.numpy()) for n, p in b.named_parameters()}
    result = b.load_state_dict(a.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for n, p in b.named_parameters():
        assert p is b_params[n][0] and p.numpy() is b_params[n][1]    # copied in place
    np.testing.assert_array_equal(a(idx).numpy(), b(idx).numpy())
    assert b.lm_head.weight is b.transformer.wte.weight               # still tied


def test_load_state_dict_accepts_numpy_and_casts():
    layer = nn.Linear(3, 2)
    w = np.arange(6, dtype=np.float64).reshape(2, 3)
    layer.load_state_dict({"weight": w, "bias": mt.tensor([1.0, 2.0])})
    assert layer.weight.dtype == mt.float32
    np.testing.assert_array_equal(layer.weight.numpy(), w)
    w[0, 0] = 100.0                           # the module holds a copy, not the caller's array
    assert layer.weight.numpy()[0, 0] == 0.0


def test_strict_loading_names_every_problem():
    model = Block(4)
    sd = dict(model.state_dict())
    del sd["fc.bias"]
    sd["fc.extra"] = mt.zeros(1)
    sd["ln.weight"] = mt.zeros(5)
    before = model.ln.weight.numpy().copy()
    with pytest.raises(ValueError) as info:
        model.load_state_dict(sd)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert '"fc.bias"' in message and "Missing" in message
    assert '"fc.extra"' in message and "Unexpected" in message
    assert "ln.weight" in message and "(5,)" in message and "(4,)" in message
    np.testing.assert_array_equal(model.ln.weight.numpy(), before)    # nothing was loaded

    del sd["ln.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert missing == ["ln.weight", "fc.bias"] and unexpected == ["fc.extra"]
    sd["ln.weight"] = mt.zeros(5)
    with pytest.raises(ValueError, match="size mismatch for ln.weight"):
        model.load_state_dict(sd, strict=False)                       # shapes always count


# -- modes, casts, grads ----------------------------------------------------------------

def test_train_eval_propagate():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.ReLU()))
    assert all(m.training for m in model.modules())
    assert model.eval() is model
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    model[1].train(False)
    assert model.training and model[0].training and not model[1][0].training
    with pytest.raises(ValueError):
        model.train("no")


def test_double_and_float_cast_in_place():
    model = TinyLM()
    model.register_buffer("steps", mt.zeros(3, dtype=mt.int64))
    before = {n: p for n, p in model.named_parameters()}
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    model(mt.randint(0, 11, (1, 3))).sum().backward()
    assert model.double() is model
    for n, p in model.named_parameters():
        assert p is before[n] and p.dtype == mt.float64 and p.requires_grad and p.is_leaf
        assert p.grad.dtype == mt.float64
    assert model.transformer.h[0].mask.dtype == mt.float64
    assert model.steps.dtype == mt.int64                      # integer buffers stay
    assert model.lm_head.weight is model.transformer.wte.weight
    assert opt.param_groups[0]["params"][0] is model.transformer.wte.weight
    opt.step()
    model.to(mt.float32)
    assert {p.dtype for p in model.parameters()} == {mt.float32}
    model.to(dtype=mt.float64)
    assert {p.dtype for p in model.parameters()} == {mt.float64}
    model.float()
    assert {p.dtype for p in model.parameters()} == {mt.float32}
    with pytest.raises(TypeError, match="floating"):
        model.to(mt.int64)


def test_zero_grad_apply_requires_grad():
    model = Block(3)
    model(mt.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=False)
    assert all(np.all(p.grad.numpy() == 0) for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    seen = []
    model.apply(lambda m: seen.append(type(m).__name__))
    assert seen == ["LayerNorm", "Linear", "Block"]
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())


def test_forward_hooks():
    layer = nn.Linear(2, 2)
    calls = []
    handle = layer.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    layer(mt.randn(3, 2))
    handle.remove()
    layer(mt.randn(3, 2))
    assert calls == [(3, 2)]


def test_missing_forward():
    with pytest.raises(NotImplementedError, match="forward"):
        nn.Module()(1)


def test_repr_is_a_tree():
    text = repr(TinyLM(n_layer=3))
    assert text.startswith("TinyLM(\n  (transformer): ModuleDict(\n    (wte): Embedding(11, 6)")
    assert "(h): ModuleList(\n      (0-2): 3 x Block(" in text
    assert "(lm_head): Linear(in_features=6, out_features=11, bias=False)" in text
    assert repr(nn.LayerNorm(4)) == "LayerNorm((4,), eps=1e-05, elementwise_affine=True)"
    assert repr(nn.Dropout(0.1)) == "Dropout(p=0.1, inplace=False)"
    assert repr(nn.GELU("tanh")) == "GELU(approximate='tanh')"


# -- layers -------------------------------------------------------------------------

def test_layer_defaults():
    mt.manual_seed(0)
    lin = nn.Linear(100, 50)
    assert lin.weight.shape == (50, 100) and lin.bias.shape == (50,)
    for p in (lin.weight, lin.bias):
        assert p.dtype == mt.float32 and p.requires_grad and p.is_leaf and isinstance(p, nn.Parameter)
        assert np.abs(p.numpy()).max() <= 0.1 and np.abs(p.numpy()).max() > 0.09
    assert nn.Linear(3, 2, bias=False).bias is None
    emb = nn.Embedding(300, 40)
    assert emb.weight.shape == (300, 40)
    assert abs(emb.weight.numpy().std() - 1.0) < 0.05 and abs(emb.weight.numpy().mean()) < 0.05
    ln = nn.LayerNorm(5)
    np.testing.assert_array_equal(ln.weight.numpy(), 1.0)
    np.testing.assert_array_equal(ln.bias.numpy(), 0.0)
    assert nn.LayerNorm(5, bias=False).bias is None
    assert list(nn.LayerNorm(5, elementwise_affine=False).parameters()) == []
    np.testing.assert_array_equal(nn.RMSNorm(5).weight.numpy(), 1.0)
    assert nn.Linear(2, 3, dtype=mt.float64).weight.dtype == mt.float64
    with pytest.raises(ValueError):
        nn.Dropout(1.5)


def _np_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def test_layers_forward_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5))
    xt = mt.from_numpy(x)

    lin = nn.Linear(5, 4).double()
    np.testing.assert_allclose(lin(xt).numpy(), x @ lin.weight.numpy().T + lin.bias.numpy(), rtol=1e-12)

    ln = nn.LayerNorm(5, eps=1e-3).double()
    with mt.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    np.testing.assert_allclose(ln(xt).numpy(), _np_layer_norm(x, ln.weight.numpy(), ln.bias.numpy(), 1e-3), rtol=1e-10)

    rms = nn.RMSNorm(5).double()
    with mt.no_grad():
        rms.weight.normal_()
    expected = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(np.float64).eps) * rms.weight.numpy()
    np.testing.assert_allclose(rms(xt).numpy(), expected, rtol=1e-10)

    emb = nn.Embedding(7, 3)
    idx = rng.integers(0, 7, (2, 4))
    np.testing.assert_array_equal(emb(mt.from_numpy(idx)).numpy(), emb.weight.numpy()[idx])

    np.testing.assert_allclose(nn.ReLU()(xt).numpy(), np.maximum(x, 0))
    np.testing.assert_allclose(nn.Tanh()(xt).numpy(), np.tanh(x), rtol=1e-12)
    np.testing.assert_allclose(nn.SiLU()(xt).numpy(), x / (1 + np.exp(-x)), rtol=1e-12)
    np.testing.assert_allclose(nn.GELU()(xt).numpy(), 0.5 * x * (1 + erf(x / math.sqrt(2))), rtol=1e-10, atol=1e-15)
    tanh_gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(nn.GELU("tanh")(xt).numpy(), tanh_gelu, rtol=1e-10, atol=1e-15)
    assert nn.Identity(3, foo=1)(xt) is xt


def test_dropout_modes():
    drop = nn.Dropout(0.5)
    x = mt.ones(4000)
    mt.manual_seed(1)
    y = drop(x).numpy()
    assert set(np.unique(y)) <= {0.0, 2.0} and 0.4 < (y == 0).mean() < 0.6
    drop.eval()
    np.testing.assert_array_equal(drop(x).numpy(), x.numpy())


LAYERS = [
    ("Linear", lambda: nn.Linear(4, 3), (2, 4)),
    ("Linear-nobias", lambda: nn.Linear(4, 3, bias=False), (3, 4)),
    ("LayerNorm", lambda: nn.LayerNorm(4), (2, 3, 4)),
    ("LayerNorm-2d", lambda: nn.LayerNorm((2, 3), bias=False), (2, 2, 3)),
    ("RMSNorm", lambda: nn.RMSNorm(4, eps=1e-6), (3, 4)),
    ("ReLU", nn.ReLU, (3, 4)),
    ("GELU", nn.GELU, (3, 4)),
    ("GELU-tanh", lambda: nn.GELU("tanh"), (3, 4)),
    ("SiLU", nn.SiLU, (3, 4)),
    ("Tanh", nn.Tanh, (3, 4)),
    ("Dropout-eval", lambda: nn.Dropout(0.3).eval(), (3, 4)),
    ("MLP", lambda: nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 2)), (2, 4)),
    ("Block", lambda: Block(4), (2, 4)),
]


@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[c[0] for c in LAYERS])
def test_layer_gradcheck_float64(name, make, shape):
    mt.manual_seed(3)
    layer = make().double()
    with mt.no_grad():             # move norms' weights off 1 / biases off 0
        for p in layer.parameters():
            p.add_(mt.randn(*p.shape, dtype=mt.float64) * 0.3)
    x = mt.randn(*shape, dtype=mt.float64)
    if name == "ReLU":             # keep clear of the kink at 0
        x = mt.from_numpy(x.numpy() + np.sign(x.numpy()) * 0.1)
    x.requires_grad_()
    params = list(layer.parameters())
    assert all(p.dtype == mt.float64 for p in params)
    assert mt.gradcheck(lambda x, *ps: layer(x), (x, *params))


def test_embedding_gradcheck_float64():
    emb = nn.Embedding(5, 3).double()
    idx = mt.tensor([[0, 4, 4], [2, 0, 1]])
    assert mt.gradcheck(lambda w: emb(idx), (emb.weight,))


def test_gradcheck_catches_a_wrong_parameter():
    # negative control: a layer whose forward silently ignores part of its parameter
    class Broken(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight.detach() + 0 * self.weight, self.bias)

    layer = Broken(3, 2).double()
    x = mt.randn(2, 3, dtype=mt.float64)
    # the analytic gradient of weight is 0 while the numerical one is x-dependent
    assert not mt.gradcheck(lambda w: layer(x), (layer.weight,), raise_exception=False)


# -- init and utils -------------------------------------------------------------------

def test_init_in_place_without_graph():
    w = nn.Parameter(mt.zeros(200, 300))
    data = w.numpy()
    mt.manual_seed(5)
    assert nn.init.normal_(w, mean=1.0, std=0.5) is w
    assert w.numpy() is data and w.grad_fn is None and w.is_leaf
    assert abs(data.mean() - 1.0) < 0.01 and abs(data.std() - 0.5) < 0.01
    first = data.copy()
    mt.manual_seed(5)
    nn.init.normal_(w, mean=1.0, std=0.5)
    np.testing.assert_array_equal(w.numpy(), first)       # reproducible

    nn.init.uniform_(w, -2.0, 3.0)
    assert data.min() >= -2.0 and data.max() <= 3.0 and abs(data.mean() - 0.5) < 0.02
    nn.init.zeros_(w)
    assert not data.any()
    nn.init.ones_(w)
    assert (data == 1).all()
    nn.init.xavier_uniform_(w, gain=2.0)
    bound = 2.0 * math.sqrt(6.0 / (200 + 300))
    assert np.abs(data).max() <= bound and np.abs(data).max() > 0.95 * bound
    with pytest.raises(ValueError, match="fewer than 2"):
        nn.init.xavier_uniform_(mt.zeros(3))


def test_clip_grad_norm():
    rng = np.random.default_rng(0)
    params = [nn.Parameter(mt.zeros(3, 4)), nn.Parameter(mt.zeros(5)), nn.Parameter(mt.zeros(2))]
    grads = [rng.standard_normal(p.shape).astype(np.float32) * 3 for p in params[:2]]
    for p, g in zip(params, grads):
        p.grad = mt.from_numpy(g.copy())
    total = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    norm = nn.utils.clip_grad_norm_(params, max_norm=1.0)
    assert isinstance(norm, mt.Tensor) and norm.dtype == mt.float32
    assert float(norm) == pytest.approx(total, rel=1e-6)
    scale = 1.0 / (total + 1e-6)
    for p, g in zip(params, grads):
        np.testing.assert_allclose(p.grad.numpy(), g * scale, rtol=1e-6)
    assert params[2].grad is None
    # below the threshold nothing changes
    before = [p.grad.numpy().copy() for p in params[:2]]
    nn.utils.clip_grad_norm_(params, max_norm=10.0)
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.grad.numpy(), b)
    # the infinity norm
    norm_inf = nn.utils.clip_grad_norm_(params, max_norm=100.0, norm_type=math.inf)
    assert float(norm_inf) == pytest.approx(max(np.abs(b).max() for b in before), rel=1e-6)


def test_clip_grad_norm_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(s) for s in [(4, 3), (7,)]]
    ours = [nn.Parameter(mt.zeros(*g.shape, dtype=mt.float64)) for g in grads]
    theirs = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads]
    for a, b, g in zip(ours, theirs, grads):
        a.grad = mt.from_numpy(g.copy())
        b.grad = torch.from_numpy(g.copy())
    for norm_type in (2.0, 1.0, math.inf):
        n1 = nn.utils.clip_grad_norm_(ours, 0.5, norm_type=norm_type)
        n2 = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
        assert float(n1) == pytest.approx(float(n2), rel=1e-12)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-12)


def test_forward_hooks_with_kwargs_and_always_call():
    class Scale(nn.Module):
        def forward(self, x, factor=1.0):
            if factor < 0:
                raise ValueError("negative factor")
            return x * factor

    m = Scale()
    seen = []
    m.register_forward_pre_hook(lambda mod, args, kwargs: (args, {"factor": kwargs["factor"] * 2}),
                                with_kwargs=True)
    m.register_forward_hook(lambda mod, args, kwargs, out: seen.append((kwargs, out)),
                            with_kwargs=True)
    done = []
    m.register_forward_hook(lambda mod, args, out: done.append(out), always_call=True)
    out = m(mt.ones(2), factor=1.5)
    np.testing.assert_array_equal(out.numpy(), [3.0, 3.0])
    assert seen[0][0] == {"factor": 3.0}
    with pytest.raises(ValueError):
        m(mt.ones(2), factor=-1.0)
    assert done[-1] is None and len(done) == 2
    order = []
    m2 = Scale()
    m2.register_forward_pre_hook(lambda mod, args: order.append("b"))
    m2.register_forward_pre_hook(lambda mod, args: order.append("a"), prepend=True)
    m2(mt.ones(1))
    assert order == ["a", "b"]


def test_more_init_functions():
    mt.manual_seed(0)
    w = mt.empty(400, 300)
    nn.init.kaiming_normal_(w, nonlinearity="relu")
    assert abs(w.numpy().std() - np.sqrt(2.0 / 300)) < 0.01 * np.sqrt(2.0 / 300) * 5
    nn.init.kaiming_uniform_(w, a=np.sqrt(5))          # nn.Linear's default in torch
    bound = np.sqrt(6.0 / ((1 + 5) * 300))
    assert np.abs(w.numpy()).max() <= bound + 1e-7 and np.abs(w.numpy()).max() > 0.95 * bound
    nn.init.trunc_normal_(w, std=0.02, a=-0.03, b=0.03)
    assert np.abs(w.numpy()).max() <= 0.03
    q = mt.empty(5, 8, dtype=mt.float64)
    nn.init.orthogonal_(q)
    np.testing.assert_allclose(q.numpy() @ q.numpy().T, np.eye(5), atol=1e-12)
    e = nn.init.eye_(mt.empty(3, 4))
    np.testing.assert_array_equal(e.numpy(), np.eye(3, 4))
    with pytest.raises(ValueError):
        nn.init.kaiming_normal_(mt.empty(3), mode="fan_in")
