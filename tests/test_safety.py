"""Safety at the edges of nn.functional, the fused kernels and the optimizers.

Each test here reproduces one way the engine could be broken from Python (a crash, a
silently wrong gradient, a NaN turned into a number) and checks that it now raises a
clear error or matches PyTorch. Reproducers that used to kill the interpreter run in a
child process, so that a regression fails one test instead of ending the whole run.
Where PyTorch defines the behaviour, the test says so and compares with it.
"""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.kernels import _blas
from microtensor.optim import _adamw

rng = np.random.default_rng(0)


def child(code, timeout=120):
    """Run `code` in a fresh interpreter; a signal (segfault, abort) fails the test.
    Returns the child's stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode >= 0, (f"the child process was killed by signal "
                                  f"{-proc.returncode}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Reproducers that used to crash the interpreter (segfault), run together in one child
# process (one interpreter start for all of them); each test reads its own output. A
# crash fails the test whose reproducer was running, and those after it.
CRASHERS = {}


def crasher(code):
    """Register a reproducer under the test's name; the test receives its output."""
    def register(test):
        CRASHERS[test.__name__] = textwrap.dedent(code)
        return test
    return register


@pytest.fixture(scope="module")
def crash_outputs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("crashers"))
    script = ["import sys"]
    for name, code in CRASHERS.items():
        script.append(f"print('@@BEGIN {name}', flush=True)")
        script.append(f"exec({code.replace('{tmp}', tmp)!r}, {{}})")
        script.append(f"print('@@END {name}', flush=True)")
    proc = subprocess.run([sys.executable, "-c", "\n".join(script)], capture_output=True,
                          text=True, timeout=300)
    outputs = {}
    for block in proc.stdout.split("@@BEGIN ")[1:]:
        name, _, rest = block.partition("\n")
        body, ended, _ = rest.partition(f"@@END {name}")
        outputs[name] = body if ended else None
    return outputs, proc


@pytest.fixture
def crash_output(request, crash_outputs):
    """The output of this test's reproducer (it must have run to its end)."""
    outputs, proc = crash_outputs
    name = request.node.originalname
    out = outputs.get(name)
    if out is None:
        how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        pytest.fail(f"the reproducer {name} did not finish ({how}):\n{proc.stderr[-3000:]}")
    return out


def t64(shape, requires_grad=True, low=None):
    a = rng.standard_normal(shape) if low is None else rng.uniform(low, 1.0, shape)
    return mt.tensor(a, requires_grad=requires_grad)


# ---- index arrays are private to the node that saved them ----------------------------

@crasher("""
        import numpy as np, microtensor as mt, microtensor.nn.functional as F
        W = mt.randn(5, 3, requires_grad=True)
        ids = mt.tensor([0, 2, 2, 4])
        y = F.embedding(ids, W)
        ids.fill_(10**9)
        ids.numpy()[...] = 10**9           # also behind the version counter's back
        y.backward(mt.ones(4, 3))
        print(W.grad.numpy()[:, 0].tolist())
    """)
def test_embedding_indices_changed_after_forward_cannot_reach_the_kernel(crash_output):
    # used to write out of bounds in backward (segfault), or give the gradient of the
    # new indices
    assert crash_output.split() == ["[1.0,", "0.0,", "2.0,", "0.0,", "1.0]"]


def test_embedding_gradient_follows_the_indices_of_the_forward():
    W = mt.randn(6, 2, requires_grad=True)
    ids = mt.tensor([[1, 5], [5, 0]])
    y = F.embedding(ids, W)
    ids.numpy()[...] = 3
    g = rng.standard_normal((2, 2, 2)).astype(np.float32)
    y.backward(mt.tensor(g))
    expected = np.zeros((6, 2), np.float32)
    np.add.at(expected, np.array([1, 5, 5, 0]), g.reshape(4, 2))
    np.testing.assert_allclose(W.grad.numpy(), expected, rtol=1e-6)


@crasher("""
        import microtensor as mt, microtensor.nn.functional as F
        x = mt.randn(3, 4, requires_grad=True)
        t = mt.tensor([0, 3, 1])
        loss = F.cross_entropy(x, t)
        t.numpy()[...] = -10**12
        loss.backward()
        print(bool(abs(float(x.grad.numpy().sum())) < 1e-5))
    """)
def test_cross_entropy_target_changed_after_forward_cannot_reach_the_kernel(crash_output):
    assert crash_output.strip() == "True"


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "nll_loss"])
def test_loss_gradient_follows_the_targets_of_the_forward(loss_fn):
    x = t64((4, 5))
    target = mt.tensor([0, 4, 2, 4])
    inp = F.log_softmax(x, -1) if loss_fn == "nll_loss" else x
    loss = getattr(F, loss_fn)(inp, target)
    target.numpy()[...] = 3
    loss.backward()
    reference = x.detach().requires_grad_()
    inp2 = F.log_softmax(reference, -1) if loss_fn == "nll_loss" else reference
    getattr(F, loss_fn)(inp2, mt.tensor([0, 4, 2, 4])).backward()
    np.testing.assert_allclose(x.grad.numpy(), reference.grad.numpy(), rtol=1e-12)


def test_nll_loss_refuses_float_targets():
    # torch: "expected scalar type Long"; a float target used to be truncated silently
    with pytest.raises(TypeError, match="integer"):
        F.nll_loss(F.log_softmax(mt.randn(2, 3), -1), mt.tensor([0.9, 1.7]))


# ---- optimizers: state and gradients are checked before a kernel sees them ----------

def make_opt(kind, p, **kw):
    return {"sgd": lambda: mt.optim.SGD([p], lr=0.1, **kw),
            "sgd_momentum": lambda: mt.optim.SGD([p], lr=0.1, momentum=0.9, **kw),
            "adam": lambda: mt.optim.Adam([p], lr=0.1, **kw),
            "adamw": lambda: mt.optim.AdamW([p], lr=0.1, **kw),
            "amsgrad": lambda: mt.optim.Adam([p], lr=0.1, amsgrad=True, **kw)}[kind]()


OPTIMIZERS = ["sgd", "sgd_momentum", "adam", "adamw", "amsgrad"]


@crasher("""
        import numpy as np, microtensor as mt
        p = mt.zeros(1000, requires_grad=True)
        opt = mt.optim.Adam([p], lr=0.1)
        p.grad = mt.ones(1000); opt.step()
        arrays, meta = mt.optim.flatten_state_dict(opt.state_dict())
        arrays = dict(arrays)
        arrays["optimizer.state.0.exp_avg"] = np.zeros(1, np.int64)
        mt.save(arrays, r"{tmp}/ckpt.safetensors", metadata={"optimizer": meta})
        tensors, md = mt.load(r"{tmp}/ckpt.safetensors", with_metadata=True)
        try:
            opt.load_state_dict(mt.optim.unflatten_state_dict(tensors, md["optimizer"]))
        except (TypeError, ValueError) as e:
            print("refused:", e)
        opt.step()
        print("stepped")
    """)
def test_tampered_checkpoint_state_is_refused_by_load_state_dict(crash_output):
    # the crash: a 1-element int64 exp_avg reached adam_step through mt.load
    assert "refused:" in crash_output and "exp_avg" in crash_output and "stepped" in crash_output


@pytest.mark.parametrize("bad, error, words", [
    (np.zeros(1, np.int64), TypeError, "floating point"),
    (np.zeros(7, np.float32), ValueError, "shape"),
    (np.zeros((2, 5), np.float64), ValueError, "shape"),
    ("zeros", TypeError, "tensor"),
    (3.0, TypeError, "tensor"),
])
def test_load_state_dict_checks_every_buffer(bad, error, words):
    p = mt.zeros(10, requires_grad=True)
    opt = mt.optim.Adam([p], lr=0.1)
    p.grad = mt.ones(10)
    opt.step()
    sd = opt.state_dict()
    sd = {"state": {0: dict(sd["state"][0], exp_avg=bad)}, "param_groups": sd["param_groups"]}
    before = {k: (v.numpy().copy() if isinstance(v, mt.Tensor) else v)
              for k, v in opt.state[p].items()}
    with pytest.raises(error, match=words):
        opt.load_state_dict(sd)
    # nothing was changed by the refused load
    for k, v in opt.state[p].items():
        np.testing.assert_array_equal(v.numpy() if isinstance(v, mt.Tensor) else v, before[k])


@pytest.mark.parametrize("step, ok", [
    (3, True), (np.float32(4.0), True), (mt.tensor(5.0), True), (np.array([6]), True),
    (-1, False), (1.5, False), (float("nan"), False), (float("inf"), False), ("2", False),
    (True, False), (np.zeros(2), False), (None, False),
])
def test_load_state_dict_checks_the_step_count(step, ok):
    # torch saves `step` as a 0-d float tensor: a whole number >= 0 is accepted in any form
    p = mt.zeros(3, requires_grad=True)
    opt = mt.optim.Adam([p], lr=0.1)
    p.grad = mt.ones(3)
    opt.step()
    sd = opt.state_dict()
    sd = {"state": {0: dict(sd["state"][0], step=step)}, "param_groups": sd["param_groups"]}
    if ok:
        opt.load_state_dict(sd)
        assert isinstance(opt.state[p]["step"], int)
        opt.step()
    else:
        with pytest.raises((TypeError, ValueError), match="step"):
            opt.load_state_dict(sd)


@crasher("""
        import microtensor as mt
        for make in (lambda p: mt.optim.Adam([p]), lambda p: mt.optim.SGD([p], lr=0.1, momentum=0.9)):
            p = mt.zeros(10, requires_grad=True)
            opt = make(p)
            p.grad = mt.ones(10); opt.step()
            p.data = mt.zeros(1_000_000)
            p.grad = mt.ones(1_000_000)
            try:
                opt.step()
            except RuntimeError as e:
                print("refused:", "shape" in str(e))
    """)
def test_replaced_data_after_a_step_raises_instead_of_crashing(crash_output):
    assert crash_output.split().count("True") == 2


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_step_checks_the_gradient_shape_and_dtype(kind):
    # the engine checks hook results and .grad assignments; the optimizer checks again
    # (its kernels index the gradient with the parameter's elements)
    p = mt.zeros(4, requires_grad=True)
    opt = make_opt(kind, p)
    p._grad = mt.ones(2)
    with pytest.raises(mt.ShapeError, match=r"gradient of parameter 0.*\(2,\).*\(4,\)"):
        opt.step()
    p._grad = mt.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match="floating point"):
        opt.step()
    np.testing.assert_array_equal(p.numpy(), 0)    # untouched


@crasher("""
        import microtensor as mt
        p = mt.zeros(8, requires_grad=True)
        opt = mt.optim.Adam([p])
        p.register_hook(lambda g: mt.ones(1_000_000))
        try:
            (p * 2).sum().backward()
            opt.step()
        except RuntimeError as e:
            print("refused")
    """)
def test_a_leaf_hook_returning_a_wrong_shape_never_reaches_the_kernel(crash_output):
    assert crash_output.strip() == "refused"


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_every_step_bumps_the_version_of_each_updated_parameter(kind):
    p, q = mt.zeros(3, requires_grad=True), mt.zeros(2, requires_grad=True)
    opt = make_opt(kind, p)
    opt.add_param_group({"params": [q]})
    p.grad = mt.ones(3)
    v0, w0 = p._version, q._version
    opt.step()
    opt.step()
    assert p._version == v0 + 2
    assert q._version == w0                     # no gradient: not updated, not bumped


def test_a_step_between_forward_and_backward_is_detected():
    # PyTorch raises "modified by an inplace operation" for the same program
    torch = pytest.importorskip("torch")
    w0 = rng.standard_normal((3, 2))
    x0 = rng.standard_normal((4, 3))
    for lib, opt_cls in ((mt, mt.optim.SGD), (torch, torch.optim.SGD)):
        w = lib.tensor(w0, requires_grad=True)
        loss = (lib.tensor(x0, requires_grad=True) @ w).tanh().sum()   # so torch saves w
        w.grad = lib.ones(3, 2, dtype=lib.float64)
        opt_cls([w], lr=0.1).step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_refuse_buffers_shorter_than_the_parameter(dtype):
    n = 64
    p, g = np.zeros(n, dtype), np.ones(n, dtype)
    short = np.zeros(n - 1, dtype)
    with pytest.raises(ValueError, match="exp_avg has 63"):
        _adamw.adam_step(p, g, short, np.zeros(n, dtype), np.zeros(n, dtype), 0.1, 0.9, 0.999,
                         1e-8, 0.0, 1.0, False, False, 1)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        _adamw.adam_step(p, g, np.zeros(n, dtype), np.zeros(n, dtype), short, 0.1, 0.9, 0.999,
                         1e-8, 0.0, 1.0, False, True, 1)
    with pytest.raises(ValueError, match="grad has 63"):
        _adamw.sgd_step(p, short, np.zeros(n, dtype), 0.1, 0.0, 0.0, 0.0, False, True, 1)
    with pytest.raises(ValueError, match="momentum_buffer"):
        _adamw.sgd_step(p, g, short, 0.1, 0.9, 0.0, 0.0, False, False, 1)
    np.testing.assert_array_equal(p, 0)


# ---- scaled_dot_product_attention -----------------------------------------------------

def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q k^T * scale + mask) v in float64 numpy, a fully masked row giving 0."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
    if mask is not None:
        s = s + mask
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    return e / np.where(e.sum(-1, keepdims=True) == 0, 1, e.sum(-1, keepdims=True)) @ v


@pytest.fixture
def alloc_limit():
    """Set a scratch-allocation limit in every kernel module; restored afterwards."""
    modules = [F._kernels.fused, F._kernels.attention]
    def set_limit(n):
        for m in modules:
            m._set_alloc_limit(n)
    yield set_limit
    set_limit(None)


def test_attention_scratch_is_one_row_per_thread_for_one_query(alloc_limit):
    # a (1 query, 2**21 keys) attention needs one row of scores per thread, not a block of
    # 128 rows (at 2**26 keys that block was 32 GiB, whose malloc failed: a segfault)
    Tk, threads = 2 ** 21, mt.get_num_threads()
    q = rng.standard_normal((1, 1, 2)).astype(np.float32)
    k = rng.standard_normal((1, Tk, 2)).astype(np.float32)
    v = rng.standard_normal((1, Tk, 2)).astype(np.float32)
    alloc_limit(3 * Tk * 4 * threads)          # forward: 1 row; backward: 2 rows per thread
    qt = mt.tensor(q, requires_grad=True)
    out = F.scaled_dot_product_attention(qt, mt.tensor(k), mt.tensor(v))
    np.testing.assert_allclose(out.numpy(), ref_attention(q.astype(np.float64), k, v),
                               rtol=1e-4, atol=1e-6)
    out.sum().backward()
    assert np.isfinite(qt.grad.numpy()).all()


@pytest.mark.slow
def test_attention_with_2_26_keys_does_not_crash():
    # the reproducer (about 1.5 GB): q of 1 token, k and v of 2**26 tokens
    out = child("""
        import numpy as np, microtensor as mt, microtensor.nn.functional as F
        q = mt.randn(1, 1, 1); k = mt.randn(1, 2 ** 26, 1); v = mt.randn(1, 2 ** 26, 1)
        try:
            o = F.scaled_dot_product_attention(q, k, v)
            print("ok", bool(np.isfinite(o.numpy()).all()))
        except MemoryError:
            print("ok MemoryError")
    """, timeout=600)
    assert out.startswith("ok")


def test_failed_scratch_allocations_raise_memory_error(alloc_limit):
    q, k, v = t64((2, 8, 4)), t64((2, 8, 4)), t64((2, 8, 4))
    out = F.scaled_dot_product_attention(q, k, v)
    x = t64((6, 16))
    ln = F.layer_norm(x, (16,), t64((16,)), t64((16,)))
    rms = F.rms_norm(x, (16,), t64((16,)))
    alloc_limit(64)
    with pytest.raises(MemoryError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(MemoryError):
        out.sum().backward()
    with pytest.raises(MemoryError):
        ln.sum().backward()
    with pytest.raises(MemoryError):
        rms.sum().backward()
    with pytest.raises(MemoryError):
        F.cross_entropy(t64((3, 100)), mt.tensor([0, 1, 2]))
    alloc_limit(None)                              # and everything works again
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert q.grad is not None


def test_attention_causal_with_a_mask_raises_runtime_error():
    # torch: RuntimeError "Explicit attn_mask should not be set when is_causal=True"
    q = mt.randn(1, 3, 4)
    with pytest.raises(RuntimeError, match="is_causal"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mt.zeros(3, 3), is_causal=True)


@pytest.mark.parametrize("mask_shape", [(3, 5), (1, 5), (2, 1, 5), (5,), (2, 3, 5)])
def test_float_attention_mask_gets_a_gradient(mask_shape):
    q, k, v = t64((2, 3, 4)), t64((2, 5, 4)), t64((2, 5, 3))
    mask = t64(mask_shape)
    assert mt.gradcheck(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                        [q, k, v, mask])


def test_float_attention_mask_gradient_equals_torch():
    torch = pytest.importorskip("torch")
    arrays = [rng.standard_normal(s) for s in ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), (2, 1, 3, 5))]
    arrays[3][0, 0, 1, 2] = -np.inf                  # a masked score: its gradient is 0
    ours = [mt.tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = F.scaled_dot_product_attention(*ours[:3], attn_mask=ours[3])
    tout = torch.nn.functional.scaled_dot_product_attention(*theirs[:3], attn_mask=theirs[3])
    up = rng.standard_normal(out.shape)
    out.backward(mt.tensor(up))
    tout.backward(torch.tensor(up))
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_attention_mask_changed_in_place_after_forward_is_detected():
    q = t64((1, 3, 4))
    mask = mt.zeros(3, 3, dtype=mt.float64)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    mask.fill_(-1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_attention_with_head_dim_zero_equals_torch():
    # torch: every score of an empty dot product is 0, so the output is the mean of v
    torch = pytest.importorskip("torch")
    v0 = rng.standard_normal((1, 3, 4))
    for causal in (False, True):
        q, k, v = mt.zeros(1, 2, 0, dtype=mt.float64), mt.zeros(1, 3, 0, dtype=mt.float64), mt.tensor(v0, requires_grad=True)
        tv = torch.tensor(v0, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        tout = torch.nn.functional.scaled_dot_product_attention(
            torch.zeros(1, 2, 0, dtype=torch.float64), torch.zeros(1, 3, 0, dtype=torch.float64),
            tv, is_causal=causal)
        np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-12)
        out.sum().backward()
        tout.sum().backward()
        np.testing.assert_allclose(v.grad.numpy(), tv.grad.numpy(), rtol=1e-12)


# ---- NaN and Inf propagate as in PyTorch ---------------------------------------------

NAN, INF = float("nan"), float("inf")
SPECIAL = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 30.0, -30.0, 100.0, -100.0]
# rows: normal, one NaN, +inf, -inf, all -inf, two +inf, +inf and -inf, all NaN, huge
ROWS = np.array([[1, 2, 3, 4], [NAN, 1, 2, 3], [INF, 1, 2, 3], [-INF, 1, 2, 3],
                 [-INF, -INF, -INF, -INF], [INF, INF, 1, 2], [INF, -INF, 0, 0], [NAN] * 4,
                 [1e30, -1e30, 0, 1]])


def compare_with_torch(fn, tfn, arrays, dtype, rtol=1e-5, atol=1e-6, upstream=None,
                       math_forward=None):
    """Values and gradients (random upstream) of fn and torch's tfn, NaN where torch
    has NaN, inf where torch has inf.

    math_forward maps an output index to the mathematical value expected there, for the
    few points where PyTorch's own answer depends on the CPU's vector code: there the
    test compares with the mathematics, not with whatever this CPU's PyTorch gives."""
    torch = pytest.importorskip("torch")
    ours = [mt.tensor(a.astype(dtype) if a.dtype.kind == "f" else a, requires_grad=a.dtype.kind == "f")
            for a in arrays]
    theirs = [torch.tensor(a.astype(dtype) if a.dtype.kind == "f" else a, requires_grad=a.dtype.kind == "f")
              for a in arrays]
    out, tout = fn(*ours), tfn(*theirs)
    expected = tout.detach().numpy().copy()
    for index, value in (math_forward or {}).items():
        expected[index] = value
    np.testing.assert_allclose(out.numpy(), expected, rtol=rtol, atol=atol,
                               equal_nan=True, err_msg="forward")
    up = np.asarray(rng.standard_normal(out.shape) if upstream is None else upstream, dtype=dtype)
    out.backward(mt.tensor(up))
    tout.backward(torch.tensor(up))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a.requires_grad:
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=f"gradient of input {i}")


def _torch_fns():
    torch = pytest.importorskip("torch")
    TF = torch.nn.functional
    return torch, TF


ELEMENTWISE = ["gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_nan_and_inf_as_torch(name, dtype):
    torch, TF = _torch_fns()
    fns = {"gelu": (F.gelu, TF.gelu),
           "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                         lambda x: TF.gelu(x, approximate="tanh")),
           "silu": (F.silu, TF.silu), "sigmoid": (F.sigmoid, torch.sigmoid),
           "tanh": (F.tanh, torch.tanh)}
    # GELU(+inf) is +inf (x * Phi(x), Phi(inf) = 1). PyTorch's float32 GELU gives NaN
    # there on CPUs where its AVX-512 code runs (a Sapphire Rapids Xeon) and +inf on
    # others (AVX2, and every float64 path), so +inf is checked against the mathematics.
    math_forward = {SPECIAL.index(INF): INF} if name in ("gelu", "gelu_tanh") else None
    compare_with_torch(*fns[name], [np.array(SPECIAL)], dtype, math_forward=math_forward)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm",
                                  "cross_entropy", "cross_entropy_ignored", "cross_entropy_smooth"])
def test_row_kernels_nan_and_inf_as_torch(name, dtype):
    torch, TF = _torch_fns()
    target = np.array([0, 1, 0, 0, 1, 2, 3, 0, 0])
    ignored = np.array([0, -100, 0, 1, -100, 2, -100, -100, 0])
    fns = {"softmax": (lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1), [ROWS]),
           "log_softmax": (lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1), [ROWS]),
           "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b),
                          lambda x, w, b: TF.layer_norm(x, (4,), w, b),
                          [ROWS, rng.standard_normal(4), rng.standard_normal(4)]),
           "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), lambda x, w: TF.rms_norm(x, (4,), w),
                        [ROWS, rng.standard_normal(4)]),
           "cross_entropy": (lambda x, t: F.cross_entropy(x, t, reduction="none"),
                             lambda x, t: TF.cross_entropy(x, t, reduction="none"), [ROWS, target]),
           # an ignored row's gradient is 0 * softmax: NaN where its softmax is NaN (torch)
           "cross_entropy_ignored": (F.cross_entropy, TF.cross_entropy, [ROWS, ignored]),
           "cross_entropy_smooth": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2),
                                    lambda x, t: TF.cross_entropy(x, t, label_smoothing=0.2),
                                    [ROWS[[0, 1, 3, 8]], target[:4]])}
    fn, tfn, arrays = fns[name]
    compare_with_torch(fn, tfn, arrays, dtype, rtol=1e-4, atol=1e-5)


def attention_inputs(case):
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((2, 5, 4))
    v = rng.standard_normal((2, 5, 4))
    if case == "nan_query_row":
        q[0, 1, 2] = NAN                       # used to give a row of zeros
    elif case == "inf_query_row":
        q[1, 0, :] = INF
    elif case == "nan_key":
        k[1, 3, 1] = NAN
    elif case == "inf_value":
        v[0, 2, 1] = INF
    elif case == "last_key_nan":             # causal: torch's -inf mask makes NaN + -inf
        k[0, 4, 0] = NAN
    elif case == "huge":                     # float32 scores overflow to +inf
        q[0] = np.abs(q[0]) * 1e20
        k[0] = np.abs(k[0]) * 1e20
    return [q, k, v]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["nan_query_row", "inf_query_row", "nan_key", "inf_value",
                                  "last_key_nan", "huge"])
def test_attention_nan_and_inf_as_torch(case, causal, dtype):
    torch, TF = _torch_fns()
    compare_with_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                       lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=causal),
                       attention_inputs(case), dtype, rtol=1e-4, atol=1e-5)


# The causal kernels skip the masked keys of a (b, h) only after a guard has scanned all
# of its q, k, v (and dout in backward) for values that would make torch's masked entries
# NaN (NaN, inf, or an overflow). Every element of each array matters, the last above all
# (a scan that stops one short misses it): one such value at the first, a middle and the
# last element of a (b, h)'s slab, and at the very last element of the array. T = 67 is
# past one causal block of query rows (64), so the trimming is really used.
GUARDED = ["q", "k", "v", "dout"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["first", "middle", "slab_last", "array_last"])
@pytest.mark.parametrize("tensor", GUARDED)
def test_attention_guard_sees_every_element(tensor, where, value, dtype):
    torch, TF = _torch_fns()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    BH, T, hs = 3, 67, 5
    arrays = {n: rng.standard_normal((BH, T, hs)) for n in GUARDED}
    bh = BH - 1 if where == "array_last" else 1
    flat = {"first": 0, "middle": (T * hs) // 2, "slab_last": T * hs - 1,
            "array_last": T * hs - 1}[where]
    big = {"nan": NAN, "inf": INF, "-inf": -INF}[value]
    arrays[tensor][bh].reshape(-1)[flat] = big
    q, k, v, up = (arrays[n] for n in GUARDED)

    def theirs(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    with np.errstate(all="ignore"):
        compare_with_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           theirs, [q, k, v], dtype, rtol=1e-4, atol=1e-5, upstream=up)


# The same guard when q, k, v are heads of one (B, T, 3C) projection, as in the GPT (a
# head's rows lie 3C elements apart: the scan walks them as a column band), and dout a
# transposed view (rows nh * hs apart): head sizes under, at and past the scan's 16
# columns at a time, an odd T (the scan takes two rows a step), one bad value at a
# head's first or last row and column.
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("row", ["first", "last"])
@pytest.mark.parametrize("col", ["first", "last"])
@pytest.mark.parametrize("hs", [5, 16, 21, 40])
@pytest.mark.parametrize("tensor", GUARDED)
def test_attention_guard_sees_every_element_of_strided_heads(tensor, hs, col, row, value, dtype):
    torch, TF = _torch_fns()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, nh, T = 2, 2, 67
    C = nh * hs
    x = rng.standard_normal((B, T, 3 * C))
    up = rng.standard_normal((B, T, nh, hs))
    r, c = (0 if row == "first" else T - 1), (0 if col == "first" else hs - 1)
    big = NAN if value == "nan" else INF
    if tensor == "dout":
        up[1, r, 1, c] = big
    else:
        x[1, r, GUARDED.index(tensor) * C + hs + c] = big

    def attend(F_sdpa, x):
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(C, dim=2))
        return F_sdpa(q, k, v, is_causal=True).transpose(1, 2)

    def theirs(x):
        with sdpa_kernel(SDPBackend.MATH):
            return attend(TF.scaled_dot_product_attention, x)
    with np.errstate(all="ignore"):
        compare_with_torch(lambda x: attend(F.scaled_dot_product_attention, x), theirs, [x],
                           dtype, rtol=1e-4, atol=1e-5, upstream=up)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_inf_upstream_gradient_as_torch(dtype):
    torch, TF = _torch_fns()
    up = rng.standard_normal((2, 3, 4))
    up[0, 0, 1] = INF
    compare_with_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True),
                       attention_inputs("finite"), dtype, rtol=1e-4, atol=1e-5, upstream=up)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_masked_rows_and_nan_as_torch(dtype):
    # a fully masked row gives 0 (torch too); a NaN query in a fully masked row stays NaN
    torch, TF = _torch_fns()
    q, k, v = attention_inputs("nan_query_row")
    mask = np.ones((3, 5), bool)
    mask[1] = False
    mask[2, :3] = False
    compare_with_torch(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(mask)),
        lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(mask)),
        [q, k, v], dtype, rtol=1e-4, atol=1e-5)
    fmask = np.where(mask, 0.0, -np.inf)
    fmask[0, 0] = NAN
    compare_with_torch(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        lambda q, k, v, m: TF.scaled_dot_product_attention(q, k, v, attn_mask=m),
        [q, k, v, fmask], dtype, rtol=1e-4, atol=1e-5)


# ---- zero-size inputs behave as in PyTorch ------------------------------------------

ZERO_SIZE = [
    ("linear_in0", lambda x, w, b: F.linear(x, w, b), "linear", [(3, 0), (4, 0), (4,)]),
    ("linear_rows0", lambda x, w, b: F.linear(x, w, b), "linear", [(0, 5), (4, 5), (4,)]),
    ("linear_out0", lambda x, w: F.linear(x, w), "linear", [(2, 3, 5), (0, 5)]),
    ("layer_norm_n0", lambda x: F.layer_norm(x, (0,)), "layer_norm0", [(3, 0)]),
    ("layer_norm_rows0", lambda x, w, b: F.layer_norm(x, (5,), w, b), "layer_norm5", [(0, 5), (5,), (5,)]),
    ("rms_norm_n0", lambda x: F.rms_norm(x, (2, 0)), "rms_norm20", [(3, 2, 0)]),
    ("rms_norm_rows0", lambda x, w: F.rms_norm(x, (5,), w), "rms_norm5", [(2, 0, 5), (5,)]),
    ("softmax_dim0", lambda x: F.softmax(x, 1), "softmax1", [(3, 0)]),
    ("log_softmax_rows0", lambda x: F.log_softmax(x, -1), "log_softmax", [(0, 4)]),
    ("gelu", F.gelu, "gelu", [(0, 3)]),
    ("attention_tq0", F.scaled_dot_product_attention, "sdpa", [(2, 0, 4), (2, 5, 4), (2, 5, 3)]),
]


@pytest.mark.parametrize("name", [c[0] for c in ZERO_SIZE])
def test_zero_size_inputs_as_torch(name):
    torch, TF = _torch_fns()
    tfns = {"linear": TF.linear, "layer_norm0": lambda x: TF.layer_norm(x, (0,)),
            "layer_norm5": lambda x, w, b: TF.layer_norm(x, (5,), w, b),
            "rms_norm20": lambda x: TF.rms_norm(x, (2, 0)),
            "rms_norm5": lambda x, w: TF.rms_norm(x, (5,), w),
            "softmax1": lambda x: TF.softmax(x, 1), "log_softmax": lambda x: TF.log_softmax(x, -1),
            "gelu": TF.gelu, "sdpa": TF.scaled_dot_product_attention}
    _, fn, tname, shapes = next(c for c in ZERO_SIZE if c[0] == name)
    compare_with_torch(fn, tfns[tname], [rng.standard_normal(s) for s in shapes], np.float64,
                       rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ids_shape, dim", [((0,), 3), ((2, 0), 3), ((4,), 0), ((2, 3), 0)])
def test_zero_size_embedding_as_torch(ids_shape, dim):
    torch = pytest.importorskip("torch")
    ids = rng.integers(0, 5, ids_shape)
    w0 = rng.standard_normal((5, dim))
    W, tW = mt.tensor(w0, requires_grad=True), torch.tensor(w0, requires_grad=True)
    out, tout = F.embedding(mt.tensor(ids), W), torch.nn.functional.embedding(torch.tensor(ids), tW)
    assert out.shape == tuple(tout.shape)
    out.sum().backward()
    tout.sum().backward()
    np.testing.assert_array_equal(W.grad.numpy(), tW.grad.numpy())


# ---- clip_grad_norm_ as torch, every norm type ---------------------------------------

def clip_case(lib, grads):
    params = []
    for g in grads:
        p = lib.zeros(*g.shape, dtype=lib.float64, requires_grad=True)
        p.grad = lib.tensor(g)
        params.append(p)
    return params


CLIP_GRADS = [np.array([0.0, 2.0, -3.0]), np.zeros((2, 2)), np.array([1e-3, 0.0])]


@pytest.mark.parametrize("norm_type", [0, 0.5, 1, 2, 3.5, "inf", INF, -INF, -1, -2.0])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_every_norm_type_as_torch(norm_type, max_norm):
    torch = pytest.importorskip("torch")
    ours, theirs = clip_case(mt, CLIP_GRADS), clip_case(torch, CLIP_GRADS)
    total = mt.nn.utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    np.testing.assert_allclose(total.item(), ttotal.item(), rtol=1e-12)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("special", [NAN, INF])
def test_clip_grad_norm_with_nan_or_inf_gradients_as_torch(special):
    torch = pytest.importorskip("torch")
    grads = [g.copy() for g in CLIP_GRADS]
    grads[0][0] = special
    ours, theirs = clip_case(mt, grads), clip_case(torch, grads)
    total = mt.nn.utils.clip_grad_norm_(ours, 1.0)
    ttotal = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    np.testing.assert_allclose(total.item(), ttotal.item(), equal_nan=True)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), equal_nan=True)


def test_clip_grad_norm_refuses_norm_types_that_are_not_numbers():
    params = clip_case(mt, CLIP_GRADS)
    for bad in ("fro", NAN, None):
        with pytest.raises(ValueError, match="norm_type"):
            mt.nn.utils.clip_grad_norm_(params, 1.0, norm_type=bad)
    np.testing.assert_array_equal(params[0].grad.numpy(), CLIP_GRADS[0])


# ---- every threaded path: 2 threads above the threshold equal the serial result -------
# A kernel that switches to threads above a size is run above that size with 1 and with
# 2 threads, each compared with an independent float64 reference; a recording wrapper
# around the kernel module proves that the 2-thread run really took the threaded path.

class Recorder:
    """Stands in for a kernel module: forwards every call, records its arguments."""

    def __init__(self, module):
        self._module, self.calls = module, []

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def recorded(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return recorded

    def threads(self, name, position=-1):
        return [args[position] for n, args, _ in self.calls if n == name]


@pytest.fixture
def threads(monkeypatch):
    """run(fn, n): fn() with n kernel threads, the fused kernels recorded."""
    before = mt.get_num_threads()
    fused, attention = Recorder(F._kernels.fused), Recorder(F._kernels.attention)
    monkeypatch.setattr(F._kernels, "fused", fused)
    monkeypatch.setattr(F._kernels, "attention", attention)

    def run(fn, n):
        mt.set_num_threads(n)
        try:
            return fn()
        finally:
            mt.set_num_threads(before)
    run.fused, run.attention = fused, attention
    yield run
    mt.set_num_threads(before)


def forward_backward(fn, arrays, upstream_seed=1):
    """Values and input gradients of fn at these arrays (float64 tensors)."""
    ts = [mt.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out = fn(*ts)
    up = np.asarray(np.random.default_rng(upstream_seed).standard_normal(out.shape), np.float64)
    out.backward(mt.tensor(up))
    return [out.numpy()] + [t.grad.numpy() for t in ts if t.grad is not None], up


def layer_norm_ref(x, w, b, up, eps=1e-5, rms=False):
    mu = 0 if rms else x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) if rms else x.var(-1, keepdims=True)
    rstd = 1 / np.sqrt(var + eps)
    xhat = (x - mu) * rstd
    out = xhat * w + (0 if b is None else b)
    dnorm = up * w
    dx = rstd * (dnorm - (0 if rms else dnorm.mean(-1, keepdims=True))
                 - xhat * (dnorm * xhat).mean(-1, keepdims=True))
    grads = [out, dx, (up * xhat).sum(0)] + ([] if b is None else [up.sum(0)])
    return grads


def parallel_min(source, name):
    """A kernel's parallel threshold, `cdef double NAME = 1 << k` in microtensor/<source>:
    the threaded tests below take sizes above it, or they would test one thread twice."""
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "microtensor", source)
    with open(path) as f:
        (k,) = re.findall(rf"^cdef double {name} = 1 << (\d+)", f.read(), re.M)
    return 1 << int(k)


def check_threaded(threads, fn, arrays, reference, recorder, kernels, position=-1,
                   rtol=1e-10, dtype=np.float64):
    """fn with 1 and with 2 threads (the float inputs cast to dtype): equal to each other
    and to the float64 reference computed from the same (cast) inputs."""
    arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in arrays]
    serial, up = threads(lambda: forward_backward(fn, arrays), 1)
    threaded, _ = threads(lambda: forward_backward(fn, arrays), 2)
    for kernel in kernels:
        used = recorder.threads(kernel, position)
        assert 1 in used and 2 in used, f"{kernel} ran with threads {used}: path not taken"
    expected = reference(*[a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays], up)
    f32 = dtype == np.float32
    for i, (a, b, e) in enumerate(zip(serial, threaded, expected)):
        assert b.dtype == dtype
        # (float32: partial sums added in another order round differently)
        np.testing.assert_allclose(b, a, rtol=1e-4 if f32 else rtol, atol=1e-4 if f32 else 1e-12,
                                   err_msg=f"output {i}: 2 threads vs 1")
        np.testing.assert_allclose(b, e, rtol=2e-3 if f32 else 1e-8, atol=2e-4 if f32 else 1e-10,
                                   err_msg=f"output {i}: vs reference")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layer_norm_threaded_weight_gradient(threads, dtype):
    # above 2**18 elements (memory-bound threshold) backward keeps one partial dweight /
    # dbias per thread; a sum that kept only the first thread's partial went unseen once
    x = rng.standard_normal((1024, 300))                  # 307,200 elements
    w, b = rng.standard_normal(300), rng.standard_normal(300)
    assert x.size >= F._PARALLEL_MIN_MEMORY_BOUND
    check_threaded(threads, lambda x, w, b: F.layer_norm(x, (300,), w, b), [x, w, b],
                   lambda x, w, b, up: layer_norm_ref(x, w, b, up), threads.fused,
                   ["layernorm_forward", "layernorm_backward"], dtype=dtype)
    partials = [args[1].shape[0] for n, args, _ in threads.fused.calls if n == "layernorm_backward"]
    assert partials == [1, 2]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rms_norm_threaded_weight_gradient(threads, dtype):
    x = rng.standard_normal((700, 400))
    w = rng.standard_normal(400)
    check_threaded(threads, lambda x, w: F.rms_norm(x, (400,), w, eps=1e-5), [x, w],
                   lambda x, w, up: layer_norm_ref(x, w, None, up, rms=True), threads.fused,
                   ["rmsnorm_forward", "rmsnorm_backward"], dtype=dtype)


def softmax_ref(x, up, log=False):
    e = np.exp(x - x.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)
    if log:
        return [np.log(y), up - y * up.sum(-1, keepdims=True)]
    return [y, y * (up - (up * y).sum(-1, keepdims=True))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_threaded(threads, log, dtype):
    x = rng.standard_normal((400, 200))                  # 80,000 >= 2**16
    assert x.size >= F._PARALLEL_MIN
    assert x.size >= parallel_min("kernels/_fused.pyx", "_SOFTMAX_BACKWARD_PARALLEL_MIN")
    name = "log_softmax" if log else "softmax"
    check_threaded(threads, lambda x: getattr(F, name)(x, -1), [x],
                   lambda x, up: softmax_ref(x, up, log), threads.fused,
                   [f"{name}_forward", f"{name}_backward"], dtype=dtype)


def elementwise_ref(name, x, up):
    from scipy.special import erf
    if name == "gelu":
        cdf = 0.5 * (1 + erf(x / math.sqrt(2)))
        return [x * cdf, up * (cdf + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi))]
    if name == "gelu_tanh":
        u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        t = np.tanh(u)
        du = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)
        return [0.5 * x * (1 + t), up * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du)]
    s = 1 / (1 + np.exp(-x))
    return [x * s, up * s * (1 + x * (1 - s))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_elementwise_threaded(threads, name, dtype):
    x = rng.standard_normal(50_000) * 3
    assert x.size >= parallel_min("kernels/_fused.pyx", "_GELU_PARALLEL_MIN")
    fn = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}[name]
    kernel = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu"}[name]
    check_threaded(threads, fn, [x], lambda x, up: elementwise_ref(name, x, up), threads.fused,
                   [f"{kernel}_forward", f"{kernel}_backward"], dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_threaded(threads, dtype):
    x = rng.standard_normal((400, 100))
    assert x.size >= parallel_min("kernels/_fused.pyx", "_CROSSENTROPY_PARALLEL_MIN")
    t = rng.integers(0, 100, 400)
    t[::7] = -100                                         # some rows ignored

    def ref(x, t, up):
        keep = t != -100
        logp = np.log(softmax_ref(x, np.zeros_like(x))[0])
        loss = -(logp[np.arange(len(t)), np.where(keep, t, 0)] * keep).sum() / keep.sum()
        d = np.exp(logp)
        d[np.arange(len(t)), np.where(keep, t, 0)] -= 1
        return [loss, d * keep[:, None] * up / keep.sum()]
    check_threaded(threads, F.cross_entropy, [x, t], ref, threads.fused,
                   ["crossentropy_forward", "crossentropy_backward"], dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_embedding_threaded(threads, dtype):
    # backward splits the columns over threads (repeated ids would race over rows)
    W = rng.standard_normal((50, 64))
    ids = rng.integers(0, 50, 5000)                       # 320,000 >= 2**18, many repeats
    assert ids.size * W.shape[1] >= parallel_min("kernels/_fused.pyx", "_COPY_PARALLEL_MIN")

    def ref(ids, W, up):
        dW = np.zeros_like(W)
        np.add.at(dW, ids, up)
        return [W[ids], dW]
    check_threaded(threads, lambda i, w: F.embedding(i, w), [ids, W], ref, threads.fused,
                   ["embedding_forward", "embedding_backward"], dtype=dtype)


def test_dropout_threaded(threads):
    x = rng.standard_normal(300_000)
    assert x.size >= parallel_min("kernels/_fused.pyx", "_COPY_PARALLEL_MIN")

    def run():
        mt.manual_seed(5)
        return forward_backward(lambda x: F.dropout(x, 0.3), [x])

    serial, up = threads(run, 1)
    threaded, _ = threads(run, 2)
    assert threads.fused.threads("dropout_forward") == [1, 2]
    mt.manual_seed(5)
    keep = (mt.core._core.default_generator().random(x.size, dtype=np.float32) >= np.float32(0.3)) / 0.7
    for a, b, e in zip(serial, threaded, [x * keep, up * keep]):
        np.testing.assert_array_equal(b, a)
        np.testing.assert_allclose(b, e, rtol=1e-12)


def attention_ref(q, k, v, up, causal=False):
    """Values and gradients of softmax(q k^T / sqrt(d) + causal mask) v, in float64."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ up
    dp = up @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return [p @ v, ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, dv]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_threaded(threads, causal, dtype):
    # threads take whole (b, h) pairs above _ATTENTION_PARALLEL_MIN (BH Tq Tk hs); 200
    # query rows make two row blocks (block = 128, or 64 when causal)
    q = rng.standard_normal((2, 2, 200, 16))
    k = rng.standard_normal((2, 2, 150, 16))
    assert 4 * 200 * 150 * 16 >= parallel_min("kernels/_fused_attention.pyx", "_ATTENTION_PARALLEL_MIN")
    v = rng.standard_normal((2, 2, 150, 8))
    check_threaded(threads,
                   lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                   [q, k, v], lambda q, k, v, up: attention_ref(q, k, v, up, causal),
                   threads.attention, ["attention_forward"], dtype=dtype)
    assert sorted(threads.attention.threads("attention_backward", 17)) == [1, 2]


@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M, K, N, nt", [(131, 128, 130, 2), (131, 128, 130, 3),
                                          (37, 128, 467, 2), (37, 128, 467, 3)])
def test_gemm_threaded(ta, tb, dtype, M, K, N, nt):
    # _blas.gemm splits C over threads from _PARALLEL_MIN_FLOPS multiply-adds: its rows
    # when M >= N, its columns (blocks of 16) when M < N; neither splits evenly here
    assert M * K * N >= parallel_min("kernels/_blas.pyx", "_PARALLEL_MIN_FLOPS")
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(dtype)
    a_op, b_op = (a.T if ta else a), (b.T if tb else b)
    serial = _blas.gemm(a_op, b_op, num_threads=1)
    threaded = _blas.gemm(a_op, b_op, num_threads=nt)
    expected = a_op.astype(np.float64) @ b_op.astype(np.float64)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(threaded, serial, rtol=tol, atol=tol)
    np.testing.assert_allclose(threaded, expected, rtol=tol, atol=tol)
    out = np.ones((M, N), dtype)                          # beta: out = a @ b + beta * out
    _blas.gemm(a_op, b_op, out=out, beta=0.5, num_threads=nt)
    np.testing.assert_allclose(out, expected + 0.5, rtol=tol, atol=tol)
    # the bias epilogue: each block adds it to what it wrote, the same bits as a second pass
    bias = rng.standard_normal(N).astype(dtype)
    with_bias = _blas.gemm(a_op, b_op, num_threads=nt, bias=bias)
    np.testing.assert_array_equal(with_bias, threaded + bias)
    out = np.ones((M, N), dtype)
    _blas.gemm(a_op, b_op, out=out, beta=0.5, num_threads=nt, bias=bias)
    np.testing.assert_allclose(out, expected + 0.5 + bias, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M, N, nt", [(1001, 131, 2), (1001, 131, 3), (3, 5, 2), (0, 7, 2),
                                      (513, 33, 3), (16, 64, 2), (48, 512, 3), (17, 1000, 2),
                                      (1, 40, 2)])
def test_column_sum_threaded_is_numpys_sum_over_rows(dtype, M, N, nt):
    # whole tiles and bands of the kernel (16 rows, 128 bytes of columns) and their rests;
    # magnitudes far apart, so an add out of order shows in the bits
    g = (rng.standard_normal((M, N)) * 10.0 ** rng.integers(-6, 7, (M, 1))).astype(dtype)
    for threads in (1, nt):
        np.testing.assert_array_equal(_blas.column_sum(g, num_threads=threads), g.sum(axis=0))
    # a transposed view is summed as the array it shows
    np.testing.assert_array_equal(_blas.column_sum(g.T.copy().T), g.sum(axis=0))


@pytest.mark.parametrize("bad, match", [
    (lambda N, dt: np.ones(N + 1, dt), "1-D"), (lambda N, dt: np.ones(N - 1, dt), "1-D"),
    (lambda N, dt: np.ones((1, N), dt), "1-D"), (lambda N, dt: np.ones(N, np.float64), "1-D"),
    (lambda N, dt: [0.0] * N, "1-D"), (lambda N, dt: np.ones(N, np.int64), "1-D")])
def test_gemm_refuses_a_bias_that_does_not_fit(bad, match):
    a, b = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    with pytest.raises(ValueError, match=match):
        _blas.gemm(a, b, bias=bad(5, np.float32))


@pytest.mark.parametrize("bad", [np.ones(5, np.float32), np.ones((2, 3), np.int64),
                                 np.ones((2, 3), np.float16), [[1.0]], np.ones((2, 2, 2), np.float32)])
def test_column_sum_refuses_what_it_cannot_sum(bad):
    with pytest.raises(TypeError, match="2-D float32 or float64"):
        _blas.column_sum(bad)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_linear_threaded(threads, dtype):
    x = rng.standard_normal((3, 131, 128))                # 393 rows: an odd split
    w = rng.standard_normal((130, 128))
    b = rng.standard_normal(130)
    assert 393 * 128 * 130 >= parallel_min("kernels/_blas.pyx", "_PARALLEL_MIN_FLOPS")
    check_threaded(threads, F.linear, [x, w, b],
                   lambda x, w, b, up: [x @ w.T + b, up @ w,
                                        up.reshape(-1, 130).T @ x.reshape(-1, 128),
                                        up.reshape(-1, 130).sum(0)],
                   threads.fused, [], rtol=1e-12, dtype=dtype)


@pytest.mark.parametrize("ta, tb", [(False, False), (True, True)])
def test_batched_gemm_threaded(ta, tb):
    L, M, K, N = 5, 30, 120, 150
    assert L * M * K * N >= parallel_min("kernels/_blas.pyx", "_PARALLEL_MIN_FLOPS")
    a = rng.standard_normal((L, K, M) if ta else (L, M, K))
    b = rng.standard_normal((L, N, K) if tb else (L, K, N))
    a_op = a.transpose(0, 2, 1) if ta else a
    b_op = b.transpose(0, 2, 1) if tb else b
    serial = _blas.batched_gemm(a_op, b_op, num_threads=1)
    threaded = _blas.batched_gemm(a_op, b_op, num_threads=2)
    np.testing.assert_array_equal(threaded, serial)
    # against numpy's product (another BLAS, another summation order): each element within
    # a few roundings of its K terms' magnitudes. A relative tolerance per element fails on
    # an element that cancels to near zero (1.7e-12 relative, once in 22,500).
    bound = 4 * K * np.finfo(np.float64).eps * (np.abs(a_op) @ np.abs(b_op))
    assert np.all(np.abs(threaded - a_op @ b_op) <= bound)


def test_batched_gemm_checks_out():
    a, b = np.ones((2, 3, 4)), np.ones((2, 4, 5))
    for out in (np.zeros((2, 3, 4)), np.zeros((1, 3, 5)), np.zeros((2, 3, 5), np.float32),
                np.zeros((2, 5, 3)).transpose(0, 2, 1)):
        with pytest.raises(ValueError, match="out"):
            _blas.batched_gemm(a, b, out=out)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_optimizer_threaded(kind):
    # the update kernels split the elements over threads above 2**15 elements
    n = 33_000                                           # >= 2**15
    assert n >= parallel_min("optim/_adamw.pyx", "_PARALLEL_MIN")
    p0, grads = rng.standard_normal(n), [rng.standard_normal(n) for _ in range(3)]
    results = []
    before = mt.get_num_threads()
    try:
        for nt in (1, 2):
            mt.set_num_threads(nt)
            p = mt.tensor(p0.copy(), requires_grad=True)
            opt = make_opt(kind, p, weight_decay=0.01)
            for g in grads:
                p.grad = mt.tensor(g)
                opt.step()
            results.append(p.numpy().copy())
    finally:
        mt.set_num_threads(before)
    np.testing.assert_array_equal(results[1], results[0])
    torch = pytest.importorskip("torch")
    tp = torch.tensor(p0.copy(), requires_grad=True)
    topt = {"sgd": lambda: torch.optim.SGD([tp], lr=0.1, weight_decay=0.01),
            "sgd_momentum": lambda: torch.optim.SGD([tp], lr=0.1, momentum=0.9, weight_decay=0.01),
            "adam": lambda: torch.optim.Adam([tp], lr=0.1, weight_decay=0.01),
            "adamw": lambda: torch.optim.AdamW([tp], lr=0.1, weight_decay=0.01),
            "amsgrad": lambda: torch.optim.Adam([tp], lr=0.1, amsgrad=True, weight_decay=0.01)}[kind]()
    for g in grads:                                     # torch's update rule is the reference
        tp.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(results[1], tp.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_clip_grad_norm_threaded():
    # the core's sum-of-squares kernel reduces over threads above its threshold
    g = rng.standard_normal(200_000).astype(np.float32)
    assert g.size >= parallel_min("kernels/core_kernels.pxi", "_PARALLEL_MIN")
    totals = []
    before = mt.get_num_threads()
    try:
        for nt in (1, 2):
            mt.set_num_threads(nt)
            p = mt.zeros(g.size, requires_grad=True)
            p.grad = mt.tensor(g.copy())
            totals.append(mt.nn.utils.clip_grad_norm_([p], 1.0).item())
    finally:
        mt.set_num_threads(before)
    expected = np.sqrt((g.astype(np.float64) ** 2).sum())
    np.testing.assert_allclose(totals, [expected, expected], rtol=1e-6)


# ---- kernels called directly check their arguments ----------------------------------

def test_fused_kernels_refuse_mismatched_sizes():
    K = F._kernels.fused
    x = np.zeros((3, 4))
    with pytest.raises(ValueError, match="out"):
        K.layernorm_forward(np.zeros((3, 5)), np.zeros(3), np.zeros(3), x, np.ones(4), np.zeros(4), 1e-5, 1)
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm_forward(np.zeros((3, 4)), np.zeros(3), x, np.ones(2), 1e-5, 1)
    with pytest.raises(ValueError, match="dout"):
        K.layernorm_backward(np.zeros((3, 4)), np.zeros((1, 4)), np.zeros((1, 4)), np.zeros((2, 4)),
                             x, np.ones(4), np.zeros(3), np.ones(3), 1)
    with pytest.raises(ValueError, match="out"):
        K.gelu_forward(np.zeros(2), np.zeros(5), 1)
    with pytest.raises(ValueError, match="dinp"):
        K.softmax_backward(np.zeros((1, 4)), x, x, 1)
    with pytest.raises(ValueError, match="targets"):
        K.crossentropy_forward(np.zeros(3), np.zeros(3), np.zeros(3), x, np.zeros(2, np.int64),
                               -100, 0.0, 1)
    with pytest.raises(ValueError, match="mask"):
        K.dropout_forward(np.zeros(5), np.zeros(4), np.zeros(5), np.zeros(5, np.float32), 0.5, 1)


def test_fused_kernels_refuse_out_of_range_indices():
    K = F._kernels.fused
    with pytest.raises(IndexError, match="out of range"):
        K.embedding_forward(np.zeros((2, 3)), np.array([0, 5]), np.zeros((5, 3)), 1)
    with pytest.raises(IndexError, match="out of range"):
        K.embedding_backward(np.zeros((5, 3)), np.zeros((2, 3)), np.array([-1, 0]), 1)
    with pytest.raises(IndexError, match="out of bounds"):
        K.crossentropy_forward(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros((2, 4)),
                               np.array([0, 4]), -100, 0.0, 1)
    with pytest.raises(IndexError, match="out of bounds"):
        K.crossentropy_backward(np.zeros((2, 4)), np.ones(2), np.zeros((2, 4)), np.zeros(2),
                                np.zeros(2), np.array([9, -100]), -100, 0.0, 1)


def test_attention_kernels_check_shapes_and_mask_index():
    A = F._kernels.attention
    q, k, v = np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 6))
    out, rowmax, logsum = np.zeros((1, 2, 3, 6)), np.zeros((2, 3)), np.zeros((2, 3))
    mask, index = np.zeros((1, 3, 5)), np.zeros(2, np.int64)
    args = (False, False, 0.5, 0.0, 0, 64, 1)
    A.attention_forward(out, rowmax, logsum, q, k, v, mask, index, *args)       # the good call
    with pytest.raises(ValueError, match="do not fit"):
        A.attention_forward(out, rowmax, logsum, q, np.zeros((1, 2, 6, 4)), v, mask, index, *args)
    with pytest.raises(ValueError, match="do not fit"):
        A.attention_forward(out, rowmax, logsum, q, np.zeros((2, 1, 5, 4)), v, mask, index, *args)
    with pytest.raises(ValueError, match="out"):
        A.attention_forward(np.zeros((1, 2, 3, 5)), rowmax, logsum, q, k, v, mask, index, *args)
    with pytest.raises(IndexError, match="mask_index"):
        A.attention_forward(out, rowmax, logsum, q, k, v, mask, np.array([0, 1]), True, *args[1:])
    with pytest.raises(ValueError, match="block"):
        A.attention_forward(out, rowmax, logsum, q, k, v, mask, index, *args[:5], 0, 1)
    with pytest.raises(ValueError, match="dmask"):
        A.attention_backward(np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), out, q, k, v,
                             rowmax, logsum, mask, index, *args, np.zeros((2, 3, 4)))


def _attention_operands():
    """The operands of a good attention_backward call, by name (float64, (1, 2, T, d))."""
    return dict(dq=np.zeros((1, 2, 3, 4)), dk=np.zeros((1, 2, 5, 4)), dv=np.zeros((1, 2, 5, 6)),
                dout=np.ones((1, 2, 3, 6)), q=np.ones((1, 2, 3, 4)), k=np.ones((1, 2, 5, 4)),
                v=np.ones((1, 2, 5, 6)))


def _bad_rows(a, how):
    """a's values in a layout the kernels must refuse: rows that overlap, run backwards,
    or elements that are not contiguous in a row."""
    B1, B2, T, d = a.shape
    if how == "overlap":          # each row starts one element after the last one
        base = np.zeros(B1 * B2 * T + d + 1)
        return np.lib.stride_tricks.as_strided(base, a.shape, (0, T * 8, 8, 8))
    if how == "reversed":
        return np.ascontiguousarray(a[:, :, ::-1])[:, :, ::-1]
    return np.repeat(a, 2, axis=3)[..., ::2]              # "strided": elements 2 apart


@pytest.mark.parametrize("how", ["overlap", "reversed", "strided"])
@pytest.mark.parametrize("name", ["dq", "dk", "dv", "dout", "q", "k", "v"])
def test_attention_kernels_refuse_rows_they_cannot_hand_to_blas(name, how):
    # the kernels read and write every (T, d) operand at its own strides (the heads of a
    # qkv projection, where they lie): a layout whose rows a gemm cannot walk is refused,
    # one operand at a time, in both kernels
    A = F._kernels.attention
    ops = _attention_operands()
    rowmax, logsum = np.zeros((2, 3)), np.zeros((2, 3))
    mask, index = np.zeros((1, 3, 5)), np.zeros(2, np.int64)
    args = (False, False, 0.5, 0.0, 0, 64, 1)
    fwd = lambda o: A.attention_forward(np.zeros((1, 2, 3, 6)), rowmax, logsum, o["q"], o["k"],
                                        o["v"], mask, index, *args)
    bwd = lambda o: A.attention_backward(o["dq"], o["dk"], o["dv"], o["dout"], o["q"], o["k"],
                                         o["v"], rowmax, logsum, mask, index, *args)
    fwd(ops)
    bwd(ops)                                             # the good calls
    ops[name] = _bad_rows(ops[name], how)
    with pytest.raises(ValueError, match=f"(rows|last dim) of {name} "):
        bwd(ops)
    if name in ("q", "k", "v"):
        with pytest.raises(ValueError, match=f"(rows|last dim) of {name} "):
            fwd(ops)


def test_attention_forward_refuses_an_output_whose_rows_overlap():
    A = F._kernels.attention
    q, k, v = np.ones((1, 2, 3, 4)), np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 6))
    out = np.lib.stride_tricks.as_strided(np.zeros(64), (1, 2, 3, 6), (0, 24, 8, 8))
    with pytest.raises(ValueError, match="rows of out"):
        A.attention_forward(out, np.zeros((2, 3)), np.zeros((2, 3)), q, k, v, np.zeros((1, 3, 5)),
                            np.zeros(2, np.int64), False, False, 0.5, 0.0, 0, 64, 1)


@pytest.mark.parametrize("n", [0, -5, 2 ** 31 - 1])
def test_fused_kernels_clamp_thread_counts(n):
    x = rng.standard_normal((4, 8))
    out = np.empty_like(x)
    F._kernels.fused.softmax_forward(out, x, n)
    np.testing.assert_allclose(out, softmax_ref(x, x)[0], rtol=1e-12)


# ---- generation: top_p at an exact boundary, each step's logits ----------------------

def nucleus_reference(logits, temperature, top_k, top_p):
    """The sampling distribution, written with torch's ops (sort, cumsum, scatter): the
    smallest set of likeliest tokens whose probability reaches top_p."""
    torch = pytest.importorskip("torch")
    x = torch.tensor(np.asarray(logits, np.float64)) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -float("inf"))
    probs = torch.softmax(x, -1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cat([torch.zeros_like(sorted_probs[:, :1]), torch.cumsum(sorted_probs, -1)[:, :-1]], -1)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.numpy()


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.5000001, 3),
                                         (0.4999999, 2), (1.0, 4)])
def test_top_p_at_an_exact_probability_boundary(top_p, kept):
    # four tokens of probability exactly 1/4: mass 0.5 is reached by two of them, so
    # top_p = 0.5 keeps two (keeping a third at the boundary was a bug once)
    from models.gpt import sampling_probs
    probs = sampling_probs(np.zeros((3, 4)), 1.0, None, top_p)
    assert (probs > 0).sum(-1).tolist() == [kept] * 3
    np.testing.assert_array_equal(probs[:, :kept], 1 / kept)     # ties: the lowest ids stay


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("top_k", [None, 3])
def test_sampling_probs_equal_a_torch_reference(top_p, top_k):
    from models.gpt import sampling_probs
    logits = rng.standard_normal((16, 10)) * 2
    np.testing.assert_allclose(sampling_probs(logits, 0.8, top_k, top_p),
                               nucleus_reference(logits, 0.8, top_k, top_p), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_every_generation_step_logits_and_distribution(monkeypatch, pos):
    # generate() runs a KV cache; each step's logits must equal a full recomputation of
    # the sequence so far, and the distribution drawn from must equal the reference
    import models.gpt as gpt
    from models import GPT, GPTConfig
    mt.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, pos=pos))
    model.eval()
    seen = []
    original = gpt.sample_next

    def recording(logits, temperature, top_k, top_p):
        seen.append(np.array(logits, copy=True))
        return original(logits, temperature, top_k, top_p)
    monkeypatch.setattr(gpt, "sample_next", recording)
    prompt = mt.randint(0, 11, (2, 3))
    tokens = model.generate(prompt, 7, temperature=0.9, top_k=8, top_p=0.8).numpy()
    assert len(seen) == 7
    with mt.no_grad():
        for step, logits in enumerate(seen):
            context = tokens[:, :3 + step][:, -model.config.block_size:]
            full, _ = model(mt.tensor(context))
            np.testing.assert_allclose(logits, full.numpy()[:, -1], rtol=1e-4, atol=1e-5,
                                       err_msg=f"step {step}")
            probs = gpt.sampling_probs(logits, 0.9, 8, 0.8)
            assert (probs[np.arange(2), tokens[:, 3 + step]] > 0).all()   # a kept token
            assert ((probs > 0).sum(-1) <= 8).all()
    pytest.importorskip("torch")
    for logits in seen:
        np.testing.assert_allclose(gpt.sampling_probs(logits, 0.9, 8, 0.8),
                                   nucleus_reference(logits, 0.9, 8, 0.8), rtol=1e-12, atol=1e-15)


# ---- found by the differential fuzzer (tests/test_fuzz_torch.py) ---------------------

def test_softmax_over_a_leading_dim_is_contiguous_as_torch():
    # torch's result is contiguous, so .view works on it; ours was a transposed view
    x = mt.randn(1, 2, 2, requires_grad=True)
    y = F.softmax(x, 1)
    assert y.is_contiguous()
    y.view(-1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 0, atol=1e-6)


def test_softmax_of_a_zero_dim_tensor_as_torch():
    # torch: softmax of a 0-d tensor is 1 (log_softmax 0), dim 0 or -1, in its dtype;
    # F.softmax and the core's t.softmax used to call each other forever
    for dtype in (mt.float32, mt.float64):
        x = mt.tensor(2.0, dtype=dtype, requires_grad=True)
        y = F.softmax(x, 0)
        assert y.shape == () and y.dtype == dtype and y.item() == 1.0
        assert F.log_softmax(x, -1).item() == 0.0
        y.backward()
        assert x.grad.item() == 0.0
        with pytest.raises(IndexError, match="Dimension out of range"):
            F.softmax(x, 1)


def test_mse_loss_of_empty_and_zero_dim_inputs_as_torch():
    torch = pytest.importorskip("torch")
    for shape in ((0,), (), (2, 0)):
        a0, b0 = rng.standard_normal(shape), rng.standard_normal(shape)
        a, b = mt.tensor(a0, requires_grad=True), mt.tensor(b0, requires_grad=True)
        ta, tb = torch.tensor(a0, requires_grad=True), torch.tensor(b0, requires_grad=True)
        for reduction in ("mean", "sum", "none"):
            out = F.mse_loss(a, b, reduction=reduction)
            tout = torch.nn.functional.mse_loss(ta, tb, reduction=reduction)
            np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), equal_nan=True)
            out.sum().backward()
            tout.sum().backward()
        np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-12)
        np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-12)


def test_dtype_errors_are_type_and_runtime_errors():
    # torch raises RuntimeError for mismatched or unsupported dtypes; Python code expects
    # TypeError: F's DtypeError is both (as mt.ShapeError is a ValueError and a RuntimeError)
    q = mt.randn(1, 2, 3)
    for call in (lambda: F.scaled_dot_product_attention(q, q, q.double()),
                 lambda: F.linear(mt.randn(2, 3), mt.randn(4, 3, dtype=mt.float64)),
                 lambda: F.gelu(mt.tensor([1, 2]))):
        with pytest.raises(RuntimeError) as info:
            call()
        assert isinstance(info.value, TypeError)


def test_gemm_takes_read_only_operands():
    # a broadcast view (np.broadcast_to) is read-only; backward of a matmul with an
    # expanded operand used to fail with "buffer source array is read-only"
    a = np.broadcast_to(rng.standard_normal((1, 4)), (3, 4))
    b = rng.standard_normal((4, 2))
    b.flags.writeable = False
    np.testing.assert_allclose(_blas.gemm(a, b), a @ b, rtol=1e-12)
    a3 = np.broadcast_to(rng.standard_normal((1, 3, 4)), (2, 3, 4))
    np.testing.assert_allclose(_blas.batched_gemm(a3, np.stack([b, b])), a3 @ b, rtol=1e-12)
    x = mt.ones(1, 1, 3, requires_grad=True)
    v = mt.ones(3, requires_grad=True)
    (x @ v.expand(3)).sum().backward()
    np.testing.assert_array_equal(v.grad.numpy(), 1)


def test_kernel_builds_agree_threaded(monkeypatch):
    # the kernels are compiled three times (baseline, AVX2+FMA, AVX-512; the widest the
    # CPU runs is chosen at import): every other build this CPU runs runs here too,
    # threaded, against the one that is
    from conftest import kernel_builds_here
    others = [b for b in kernel_builds_here() if b[1] is not F._kernels.fused]
    if not others:
        pytest.skip("this CPU runs one build of the kernels only (no AVX2+FMA)")
    x = rng.standard_normal((300, 257)).astype(np.float32)
    w, b = rng.standard_normal(257).astype(np.float32), rng.standard_normal(257).astype(np.float32)
    t = rng.integers(0, 257, 300)
    q = rng.standard_normal((2, 2, 70, 16)).astype(np.float32)
    programs = [lambda x, w, b: F.layer_norm(x, (257,), w, b), lambda x, w, b: F.rms_norm(x, (257,), w),
                lambda x, w, b: F.gelu(x), lambda x, w, b: F.gelu(x, approximate="tanh"),
                lambda x, w, b: F.silu(x), lambda x, w, b: F.softmax(x, -1),
                lambda x, w, b: F.log_softmax(x, 0), lambda x, w, b: F.cross_entropy(x, mt.tensor(t)),
                lambda x, w, b: F.embedding(mt.tensor(t), x)]
    attention = [lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                 lambda q: F.scaled_dot_product_attention(q, q * 0.5, q)]

    def run_all():
        outs = []
        for fn in programs:
            outs.append(forward_backward(fn, [x, w, b]))
        for fn in attention:
            outs.append(forward_backward(fn, [q]))
        return outs

    before = mt.get_num_threads()
    mt.set_num_threads(2)
    try:
        chosen = run_all()
        results = []
        for name, fused_build, attention_build in others:
            monkeypatch.setattr(F._kernels, "fused", fused_build)
            monkeypatch.setattr(F._kernels, "attention", attention_build)
            results.append((name, run_all()))
    finally:
        mt.set_num_threads(before)
    for name, other in results:
        for k, ((a, _), (c, _)) in enumerate(zip(chosen, other)):
            for i, (u, v) in enumerate(zip(a, c)):
                np.testing.assert_allclose(u, v, rtol=2e-4, atol=2e-5,
                                           err_msg=f"{name}: program {k}, output {i}")
