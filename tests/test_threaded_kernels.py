"""Every threaded kernel at sizes that do not divide by the thread count.

A kernel that splits its rows (or elements, columns, matrices) over threads by hand can
drop the remainder: `rows_per = R // P` instead of `(R + P - 1) // P` leaves the last
rows unwritten, and at a row count that divides by the thread count nothing shows. So
every threaded path runs here with 2 and with 3 threads, above its threading threshold,
at sizes that are neither even nor a multiple of 3 (prime row counts), and its result
(forward and backward) must equal the one-thread result and torch's (in float64).

The kernels: kernels/_fused.pyx (norms, softmax, cross-entropy, GELU, SiLU, embedding, dropout),
kernels/_fused_attention.pyx (threads over batch x heads), kernels/core_kernels.pxi (elementwise backward
pairs, relu, sigmoid, max along a dim, sum of squares), kernels/_blas.pyx (gemm splits output
rows, batched_gemm takes whole matrices), optim/_adamw.pyx (AdamW, Adam, SGD steps).
Whether a fused kernel was handed the thread count is recorded; the core's kernels and
the optimizers read the count themselves above 2**15 elements, which every size here
exceeds.
"""
import math

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

CORE_PARALLEL_MIN = 1 << 15                               # kernels/core_kernels.pxi's _PARALLEL_MIN
N_ELEMENTS = CORE_PARALLEL_MIN + 7                        # odd, not a multiple of 3
ROWS = 1031                                               # prime


class _Recorder:
    """Stands in for a kernel module: forwards every call, keeps (name, num_threads)."""

    def __init__(self, module, position):
        self._module, self._position, self.calls = module, position, []

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def recorded(*args, **kwargs):
            self.calls.append((name, args[self._position.get(name, -1)]))
            return fn(*args, **kwargs)
        return recorded


@pytest.fixture
def recorded(monkeypatch):
    before = mt.get_num_threads()
    fused = _Recorder(F._kernels.fused, {})
    attention = _Recorder(F._kernels.attention, {"attention_backward": 17})
    monkeypatch.setattr(F._kernels, "fused", fused)
    monkeypatch.setattr(F._kernels, "attention", attention)
    yield fused, attention
    mt.set_num_threads(before)


def _rng():
    return np.random.default_rng(7)


# ---- the table: inputs, microtensor op, torch op, the fused kernels it must thread ------
# make(rng) -> list of arrays (float arrays take gradients); ops take tensors in order.

def _rows(n_cols):
    return lambda r: [r.standard_normal((ROWS, n_cols))]


def _flat(low=None):
    if low is None:
        return lambda r: [r.standard_normal(N_ELEMENTS) * 3]
    return lambda r: [r.uniform(low, 4.0, N_ELEMENTS)]


_TARGETS = _rng().integers(0, 37, ROWS)
_TARGETS[::5] = -100                                      # some rows ignored
_IDS = _rng().integers(0, 50, ROWS)

def _sdpa_of_heads(qkv, sdpa, nh=3):
    """The GPT's attention on a (B, T, 3C) projection (same code for both engines)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in qkv.split(C, dim=2))
    return sdpa(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)


OPS = {
    # memory-bound kernels: above 2**18 elements (1031 x 300 = 309,300)
    "layer_norm": (lambda r: [r.standard_normal((ROWS, 300)), r.standard_normal(300),
                              r.standard_normal(300)],
                   lambda x, w, b: F.layer_norm(x, (300,), w, b),
                   lambda x, w, b: TF.layer_norm(x, (300,), w, b),
                   ["layernorm_forward", "layernorm_backward"]),
    "rms_norm": (lambda r: [r.standard_normal((ROWS, 300)), r.standard_normal(300)],
                 lambda x, w: F.rms_norm(x, (300,), w, eps=1e-5),
                 lambda x, w: TF.rms_norm(x, (300,), w, eps=1e-5),
                 ["rmsnorm_forward", "rmsnorm_backward"]),
    "embedding": (lambda r: [r.standard_normal((50, 257))],         # 1031 x 257 = 264,967
                  lambda w: F.embedding(mt.tensor(_IDS), w),
                  lambda w: TF.embedding(torch.from_numpy(_IDS), w),
                  ["embedding_forward", "embedding_backward"]),
    # compute-bound kernels: above 2**15 elements
    "softmax": (_rows(37), lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1),
                ["softmax_forward", "softmax_backward"]),
    "log_softmax": (_rows(37), lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1),
                    ["log_softmax_forward", "log_softmax_backward"]),
    "softmax_dim0": (lambda r: [r.standard_normal((37, ROWS))], lambda x: F.softmax(x, 0),
                     lambda x: TF.softmax(x, 0), ["softmax_forward", "softmax_backward"]),
    "cross_entropy": (_rows(37), lambda x: F.cross_entropy(x, mt.tensor(_TARGETS)),
                      lambda x: TF.cross_entropy(x, torch.from_numpy(_TARGETS)),
                      ["crossentropy_forward", "crossentropy_backward"]),
    "cross_entropy_smoothing": (
        _rows(37), lambda x: F.cross_entropy(x, mt.tensor(_TARGETS), label_smoothing=0.2),
        lambda x: TF.cross_entropy(x, torch.from_numpy(_TARGETS), label_smoothing=0.2),
        ["crossentropy_forward", "crossentropy_backward"]),
    "gelu": (_flat(), F.gelu, TF.gelu, ["gelu_forward", "gelu_backward"]),
    "gelu_tanh": (_flat(), lambda x: F.gelu(x, approximate="tanh"),
                  lambda x: TF.gelu(x, approximate="tanh"),
                  ["gelu_tanh_forward", "gelu_tanh_backward"]),
    "silu": (_flat(), F.silu, TF.silu, ["silu_forward", "silu_backward"]),
    # threads over batch x heads: 5 (b, h) pairs, 5 x 70 x 60 x 16 multiply-adds
    "attention": (lambda r: [r.standard_normal((5, 70, 16)), r.standard_normal((5, 60, 16)),
                             r.standard_normal((5, 60, 8))],
                  F.scaled_dot_product_attention, TF.scaled_dot_product_attention,
                  ["attention_forward", "attention_backward"]),
    "attention_causal": (lambda r: [r.standard_normal((5, 70, 16)),
                                    r.standard_normal((5, 70, 16)),
                                    r.standard_normal((5, 70, 8))],
                         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True),
                         ["attention_forward", "attention_backward"]),
    # the GPT's heads, read where a (B, T, 3C) projection wrote them: 5 x 3 = 15 (b, h)
    # pairs over 2 or 3 threads, rows 3C apart, the output written as (B, T, nh, hs)
    "attention_projection_heads": (lambda r: [r.standard_normal((5, 70, 3 * 48))],
                                   lambda x: _sdpa_of_heads(x, F.scaled_dot_product_attention),
                                   lambda x: _sdpa_of_heads(x, TF.scaled_dot_product_attention),
                                   ["attention_forward", "attention_backward"]),
    # the core's kernels (kernels/core_kernels.pxi)
    "relu": (_flat(), mt.relu, torch.relu, []),
    "sigmoid": (_flat(), mt.sigmoid, torch.sigmoid, []),
    "tanh": (_flat(), mt.tanh, torch.tanh, []),
    "exp": (_flat(), mt.exp, torch.exp, []),
    "log": (_flat(0.1), mt.log, torch.log, []),
    "sqrt": (_flat(0.1), mt.sqrt, torch.sqrt, []),
    "abs": (_flat(), mt.abs, torch.abs, []),
    "clamp": (_flat(), lambda x: mt.clamp(x, -1.0, 2.0), lambda x: torch.clamp(x, -1.0, 2.0), []),
    "max_dim": (_rows(37), lambda x: mt.max(x, 1)[0], lambda x: torch.max(x, 1)[0], []),
    "amax_dim0": (lambda r: [r.standard_normal((37, ROWS))], lambda x: mt.amax(x, 0),
                  lambda x: torch.amax(x, 0), []),
    "index_rows": (lambda r: [r.standard_normal((53, 701))],         # backward: scatter-add
                   lambda x: x[mt.tensor(_IDS % 53)], lambda x: x[torch.from_numpy(_IDS % 53)], []),
    # kernels/_blas.pyx: gemm splits the output rows (1031 rows), batched_gemm whole matrices (5)
    "linear": (lambda r: [r.standard_normal((ROWS, 40)), r.standard_normal((53, 40)),
                          r.standard_normal(53)], F.linear, TF.linear, []),
    "matmul_2d": (lambda r: [r.standard_normal((ROWS, 40)), r.standard_normal((40, 29))],
                  mt.matmul, torch.matmul, []),
    "matmul_batched": (lambda r: [r.standard_normal((5, 67, 40)), r.standard_normal((5, 40, 59))],
                       mt.matmul, torch.matmul, []),
}


def _run(fn, arrays, upstream=None):
    ts = [mt.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*ts)
    if upstream is None:
        upstream = np.random.default_rng(1).standard_normal(out.shape).astype(out.numpy().dtype)
    out.backward(mt.tensor(upstream))
    return [out.numpy()] + [t.grad.numpy() for t in ts], upstream


def _torch_run(fn, arrays, upstream):
    ts = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in arrays]
    out = fn(*ts)
    out.backward(torch.from_numpy(upstream.astype(np.float64)))
    return [out.detach().numpy()] + [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("op", OPS)
def test_threaded_kernel_equals_one_thread_and_torch(op, dtype, threads, recorded):
    make, ours, theirs, kernels = OPS[op]
    arrays = [a.astype(dtype) for a in make(_rng())]
    fused, attention = recorded
    mt.set_num_threads(1)
    serial, up = _run(ours, arrays)
    mt.set_num_threads(threads)
    threaded, _ = _run(ours, arrays, up)
    used = {}
    for name, n in fused.calls + attention.calls:
        used.setdefault(name, set()).add(int(n))
    for kernel in kernels:
        assert used.get(kernel) == {1, threads}, f"{kernel} ran with threads {used.get(kernel)}"
    expected = _torch_run(theirs, arrays, up)
    f32 = dtype == np.float32
    for i, (a, b, e) in enumerate(zip(serial, threaded, expected)):
        assert b.dtype == dtype
        # rows go whole to one thread: the same bits, except where partial sums over
        # threads are added (norms' weight gradients, gemm's blocks), which round
        # differently in float32: tolerances relative to the output's largest entry
        scale = max(1.0, float(np.max(np.abs(e))) if e.size else 1.0)
        np.testing.assert_allclose(b, a, rtol=1e-5 if f32 else 1e-12,
                                   atol=(1e-5 if f32 else 1e-12) * scale,
                                   err_msg=f"{op}, output {i}: {threads} threads vs 1")
        np.testing.assert_allclose(b, e, rtol=2e-3 if f32 else 1e-8,
                                   atol=(1e-4 if f32 else 1e-10) * scale,
                                   err_msg=f"{op}, output {i}: {threads} threads vs torch")


@pytest.mark.parametrize("threads", [2, 3])
def test_dropout_threaded_keeps_every_element(threads, recorded):
    """dropout_forward over 2**18 + 3 elements: the same mask with 1 and n threads, every
    element either dropped or scaled by 1 / (1 - p), the gradient the same mask."""
    x = _rng().standard_normal((1 << 18) + 3) + 5         # no zeros: the ratio is the mask
    results = []
    for n in (1, threads):
        mt.set_num_threads(n)
        mt.manual_seed(11)
        results.append(_run(lambda t: F.dropout(t, 0.3), [x], np.ones_like(x))[0])
    fused, _ = recorded
    assert sorted({n for name, n in fused.calls if name == "dropout_forward"}) == [1, threads]
    (out1, grad1), (outn, gradn) = results
    np.testing.assert_array_equal(outn, out1)
    np.testing.assert_array_equal(gradn, grad1)
    mask = outn / x
    assert np.all(np.isclose(mask, 0) | np.isclose(mask, 1 / 0.7))
    np.testing.assert_allclose(gradn, mask, rtol=1e-12)
    assert 0.25 < np.mean(mask == 0) < 0.35


@pytest.mark.parametrize("threads", [2, 3])
def test_clip_grad_norm_sum_of_squares_threaded(threads):
    """sum_of_squares splits N_ELEMENTS over threads (a reduction): the total norm."""
    before = mt.get_num_threads()
    g = _rng().standard_normal(N_ELEMENTS)
    p = mt.tensor(np.zeros_like(g), requires_grad=True)
    p.grad = mt.tensor(g.copy())
    try:
        mt.set_num_threads(threads)
        total = float(mt.nn.utils.clip_grad_norm_([p], 1e9))
    finally:
        mt.set_num_threads(before)
    assert math.isclose(total, float(np.sqrt(np.sum(g * g))), rel_tol=1e-12)


# ---- optim/_adamw.pyx: the optimizer steps split the parameter's elements ---------------
OPTIMIZERS = {
    "adamw": (lambda p: mt.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad": (lambda p: mt.optim.Adam(p, lr=1e-2, amsgrad=True),
                     lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True)),
    "sgd_nesterov": (lambda p: mt.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True,
                                            weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True,
                                               weight_decay=0.01)),
}


def _optimizer_steps(make, threads, w0, grads):
    before = mt.get_num_threads()
    mt.set_num_threads(threads)
    try:
        p = mt.tensor(w0.copy(), requires_grad=True)
        opt = make([p])
        for g in grads:
            p.grad = mt.tensor(g)
            opt.step()
        return p.detach().numpy()
    finally:
        mt.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_step_threaded(name, threads):
    """Three steps on N_ELEMENTS parameters (above the optimizers' 2**15): n threads give
    the one-thread bits, and torch's parameters."""
    ours, theirs = OPTIMIZERS[name]
    r = _rng()
    w0 = r.standard_normal(N_ELEMENTS)
    grads = [r.standard_normal(N_ELEMENTS) for _ in range(3)]
    serial = _optimizer_steps(ours, 1, w0, grads)
    threaded = _optimizer_steps(ours, threads, w0, grads)
    np.testing.assert_array_equal(threaded, serial)
    tp = torch.tensor(w0.copy(), requires_grad=True)
    topt = theirs([tp])
    for g in grads:
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
    np.testing.assert_allclose(threaded, tp.detach().numpy(), rtol=1e-10, atol=1e-12)
