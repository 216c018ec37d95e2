"""The engine at its edges: version counters, per-thread grad mode, locked accumulation,
checked hooks, and PyTorch's semantics at 0-d and 1-d. Each test is a reproducer of a
bug that once crashed the process or gave a silently wrong gradient; where PyTorch's
behaviour is the reference, the test says so and (when torch is installed) compares."""
import gc
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import microtensor as mt
from microtensor import nn
from microtensor.nn import functional as F


def f64(*shape, grad=True, seed=0):
    rng = np.random.default_rng(seed)
    return mt.tensor(rng.standard_normal(shape), dtype=mt.float64, requires_grad=grad)


# ---- version counters ------------------------------------------------------------------

def test_inplace_change_of_a_saved_output_raises():
    # the reproducer: this gave exp(a) + 1 as the gradient. With grad mode on the
    # in-place op itself is refused (the engine does not record in-place ops); under
    # no_grad it is counted, and backward raises torch's "one of the variables needed for
    # gradient computation has been modified by an inplace operation"
    a = f64(3)
    y = a.exp()
    with pytest.raises(RuntimeError, match="not recorded"):
        y.add_(1)
    with mt.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_leaf_stepped_between_forward_and_backward_raises():
    w = f64(3)
    x = f64(3, grad=False, seed=1)
    loss = (w * x).sum()
    with mt.no_grad():
        w.add_(1)                      # an optimizer step before backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_change_of_an_unsaved_input_is_allowed():
    # add's rule reads no values, so torch allows this and so do we
    b = f64(3)
    c = b * 1.0
    z = (c + 1).sum()
    with mt.no_grad():
        c.add_(1)
    z.backward()
    np.testing.assert_array_equal(b.grad.numpy(), np.ones(3))


def test_version_counts_inplace_ops_and_is_shared_by_views():
    t = mt.zeros(2, 3)
    assert t._version == 0
    t.add_(1)
    t.mul_(2)
    assert t._version == 2
    v = t[0]                           # a view shares its base's counter
    v.fill_(5)
    assert t._version == 3 and v._version == 3
    r = t.reshape(6)
    r.zero_()
    assert t._version == 4
    d = t.detach()
    d.add_(1)
    assert t._version == 5


def test_inplace_through_a_view_of_a_saved_tensor_raises():
    a = f64(2, 3)
    y = a.tanh()                       # tanh saves its output
    loss = y.sum()
    with mt.no_grad():
        y[0].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_setitem_bumps_the_version():
    a = f64(4)
    y = a.sigmoid()
    loss = (y * 2).sum()
    with mt.no_grad():
        y[1] = 0.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_optimizer_step_before_backward_raises():
    lin = nn.Linear(3, 2)
    opt = mt.optim.SGD(lin.parameters(), lr=0.1)
    loss = lin(mt.randn(4, 3)).pow(2).sum()
    for p in lin.parameters():
        p.grad = mt.zeros_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---- saved index arrays are private -------------------------------------------------------

def test_index_tensor_changed_after_gather_does_not_change_the_gradient():
    W = f64(4, 2)
    ids = mt.tensor([0, 1, 1])
    out = W[ids]
    ids.fill_(3)
    out.sum().backward()
    np.testing.assert_array_equal(W.grad.numpy()[:, 0], [1, 2, 0, 0])


def test_index_tensor_changed_to_out_of_range_is_harmless():
    W = f64(4, 2)
    ids = mt.tensor([0, 1, 1])
    out = W[ids]
    ids.fill_(10 ** 9)
    out.sum().backward()
    np.testing.assert_array_equal(W.grad.numpy()[:, 0], [1, 2, 0, 0])


def test_scatter_kernel_checks_its_indices():
    dst = np.zeros((3, 2))
    with pytest.raises(IndexError, match="out of range"):
        mt.core._core.scatter_add_rows(dst, np.array([0, 7]), np.ones((2, 2)))
    with pytest.raises(ValueError):
        mt.core._core.scatter_add_rows(dst, np.array([0, 1]), np.ones((3, 2)))


def test_elementwise_kernels_check_sizes():
    with pytest.raises(ValueError, match="must match"):
        mt.core._core.relu_backward(np.empty(10), np.ones(10), np.ones(3))
    with pytest.raises(ValueError, match="must match"):
        mt.core._core.relu_forward(np.empty(10), np.ones(3))


# ---- hooks and assignments are checked where they enter ---------------------------------------

@pytest.mark.parametrize("size", [5, 1 << 20])
def test_nonleaf_hook_returning_wrong_shape_raises(size):
    h = mt.randn(3, requires_grad=True)
    q = h * 2
    q.register_hook(lambda g: mt.ones(size))
    with pytest.raises(RuntimeError, match="hook .* returned a gradient of shape"):
        q.sum().backward()


def test_leaf_hook_returning_wrong_shape_raises():
    p = mt.randn(3, 4, requires_grad=True)
    p.register_hook(lambda g: mt.ones(7))
    with pytest.raises(RuntimeError, match="returned a gradient of shape"):
        (p * 2).sum().backward()


def test_hook_result_is_cast_to_the_gradient_dtype():
    p = mt.randn(3, requires_grad=True)
    p.register_hook(lambda g: np.ones(3, dtype=np.float64))
    (p * 2).sum().backward()
    assert p.grad.dtype == mt.float32
    np.testing.assert_array_equal(p.grad.numpy(), np.ones(3))


def test_int_grad_assignment_is_refused():
    t = mt.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="dtype"):
        t.grad = mt.zeros(3, dtype=mt.int64)


def test_float16_cannot_require_grad():
    with pytest.raises(TypeError, match="float32 and float64"):
        mt.zeros(3, dtype=np.float16, requires_grad=True)


@pytest.mark.parametrize("n", [0, -1, 100_000, 2 ** 31 - 1])
def test_thread_count_is_bounded(n):
    before = mt.get_num_threads()
    with pytest.raises(ValueError, match="number of threads"):
        mt.set_num_threads(n)
    assert mt.get_num_threads() == before


def test_huge_thread_count_does_not_crash_the_process():
    code = ("import microtensor as mt\n"
            "for n in (100_000, 2**31 - 1):\n"
            "    try: mt.set_num_threads(n)\n"
            "    except ValueError: pass\n"
            "print((mt.randn(300, 300) @ mt.randn(300, 300)).shape)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "(300, 300)" in r.stdout


# ---- grad mode per thread, accumulation under threads ----------------------------------------

def test_new_thread_starts_with_grad_enabled_inside_no_grad():
    seen = {}

    def worker():
        seen["enabled"] = mt.is_grad_enabled()
        x = mt.randn(2, requires_grad=True)
        seen["tracks"] = (x * 2).requires_grad

    with mt.no_grad():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert not mt.is_grad_enabled()
    assert seen == {"enabled": True, "tracks": True}
    assert mt.is_grad_enabled()


def test_no_grad_in_one_thread_does_not_affect_another():
    stop = threading.Event()
    errors = []

    def evaluator():
        while not stop.is_set():
            with mt.no_grad():
                (mt.randn(8, 8) @ mt.randn(8, 8)).sum()

    th = threading.Thread(target=evaluator)
    th.start()
    try:
        w = mt.randn(8, 8, requires_grad=True)
        for _ in range(200):
            loss = (w @ mt.randn(8, 8)).sum()
            if not loss.requires_grad:
                errors.append("graph missing")
                break
            loss.backward()
    finally:
        stop.set()
        th.join()
    assert not errors
    assert mt.is_grad_enabled()


def test_concurrent_backward_into_a_shared_parameter_loses_nothing():
    w = mt.zeros(64, 64, requires_grad=True)
    n_threads, steps = 4, 30

    def worker():
        for _ in range(steps):
            (w * 1.0).sum().backward()

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(w.grad.numpy(), np.full((64, 64), n_threads * steps))


# ---- post-accumulate hooks (what DistributedDataParallel starts its all-reduce from) -------------

def test_post_accumulate_hook_sees_the_full_gradient_before_backward_ends():
    a, b = f64(3), f64(3, seed=1)
    order = []
    a.register_post_accumulate_grad_hook(lambda t: order.append(("a", t.grad.numpy().copy())))
    b.register_post_accumulate_grad_hook(lambda t: order.append(("b", t.grad.numpy().copy())))
    y = (a * 2 + a * 3).exp()          # a is used twice: its hook runs once, with the sum
    loss = (y * b).sum()
    loss.backward()
    names = [n for n, _ in order]
    assert sorted(names) == ["a", "b"]
    got = dict(order)
    np.testing.assert_allclose(got["a"], 5 * y.detach().numpy() * b.detach().numpy())
    with pytest.raises(RuntimeError):
        (a * 2).register_post_accumulate_grad_hook(lambda t: None)


# ---- leaks -----------------------------------------------------------------------------

def test_retain_grad_makes_no_reference_cycle():
    gc.disable()
    try:
        k = mt.randn(3, requires_grad=True)
        m = k * 2
        m.retain_grad()
        (m * m).sum().backward()
        assert m.grad is not None and m.retains_grad
        ref = weakref.ref(m)
        del m
        assert ref() is None
    finally:
        gc.enable()


# ---- PyTorch semantics at 0-d and 1-d ---------------------------------------------------------

def test_dot_product_of_two_vectors_backward():
    u, v = f64(4), f64(4, seed=1)
    (u @ v).backward()
    np.testing.assert_allclose(u.grad.numpy(), v.detach().numpy())
    np.testing.assert_allclose(v.grad.numpy(), u.detach().numpy())
    assert mt.gradcheck(lambda a, b: a @ b, [f64(5), f64(5, seed=2)])


def test_softmax_of_a_0d_tensor():
    t = mt.tensor(2.0, requires_grad=True)
    assert t.softmax(0).item() == 1.0
    assert t.log_softmax(-1).item() == 0.0
    assert F.softmax(t, 0).item() == 1.0
    t.softmax(0).backward()
    assert t.grad.item() == 0.0
    with pytest.raises(IndexError):
        t.softmax(1)


@pytest.mark.parametrize("op", ["sum", "mean", "amax", "logsumexp"])
@pytest.mark.parametrize("dim", [0, -1])
def test_reductions_of_a_0d_tensor(op, dim):
    t = mt.tensor(3.0, dtype=mt.float64, requires_grad=True)
    out = getattr(t, op)(dim)
    assert out.shape == () and out.item() == pytest.approx(3.0)
    out.backward()
    assert t.grad.item() == pytest.approx(1.0)
    with pytest.raises(IndexError):
        getattr(t, op)(1)


def test_argmax_of_0d_and_of_empty_dims():
    assert mt.tensor(3.0).argmax(0).item() == 0
    with pytest.raises(IndexError):
        mt.zeros(0, 3).argmax(0)
    with pytest.raises(IndexError):
        mt.zeros(0).argmax()


def test_float64_scalar_graph_like_micrograd():
    a = mt.tensor(-4.0, dtype=mt.float64, requires_grad=True)
    b = mt.tensor(2.0, dtype=mt.float64, requires_grad=True)
    c = a + b
    d = a * b + b ** 3
    c = c + c + 1
    c = c + 1 + c + (-a)
    d = d + d * 2 + (b + a).relu()
    d = d + 3 * d + (b - a).relu()
    e = c - d
    f = e ** 2
    g = f / 2.0
    g = g + 10.0 / f
    g.backward()
    assert g.item() == pytest.approx(24.70408163265306)
    assert a.grad.item() == pytest.approx(138.83381924198252)
    assert b.grad.item() == pytest.approx(645.5772594752187)


def test_squeeze_dim_out_of_range_raises_index_error():
    with pytest.raises(IndexError):
        mt.tensor(2.0).squeeze(3)
    with pytest.raises(IndexError):
        mt.zeros(2, 1).squeeze(2)
    assert mt.tensor(2.0).squeeze(0).shape == ()


def test_split_with_negative_sizes_is_refused():
    with pytest.raises(ValueError, match="non-negative"):
        mt.randn(3).split([5, -2])


def test_view_of_a_non_contiguous_tensor_raises():
    t = mt.randn(3, 4).T
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        t.view(12)
    assert t.reshape(12).shape == (12,)
    assert mt.randn(3, 4).view(2, 6).shape == (2, 6)


# ---- NaN and Inf propagate ------------------------------------------------------------------

def test_relu_and_maximum_keep_nan():
    x = mt.tensor([np.nan, -1.0, 2.0])
    assert np.isnan(x.relu().numpy()[0])
    assert np.isnan(mt.maximum(x, mt.zeros(3)).numpy()[0])
    assert np.isnan(mt.minimum(x, mt.zeros(3)).numpy()[0])


def test_maximum_splits_the_gradient_at_ties_like_torch():
    a = mt.tensor([1.0, 2.0, 3.0], dtype=mt.float64, requires_grad=True)
    b = mt.tensor([1.0, 5.0, 0.0], dtype=mt.float64, requires_grad=True)
    mt.maximum(a, b).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [0.5, 0, 1])
    np.testing.assert_array_equal(b.grad.numpy(), [0.5, 1, 0])
    assert mt.gradcheck(mt.maximum, [f64(3, 4), f64(4, seed=3)])


def test_logsumexp_of_infinite_rows():
    x = mt.tensor([[-np.inf, -np.inf], [np.inf, 1.0], [0.0, 1.0]])
    out = mt.logsumexp(x, 1).numpy()
    assert out[0] == -np.inf and out[1] == np.inf
    assert out[2] == pytest.approx(np.log(np.exp(0) + np.exp(1)))


def test_pow_gradients_at_zero_match_torch():
    x = mt.tensor([0.0, 2.0], dtype=mt.float64, requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0])
    base = mt.tensor([0.0, 2.0], dtype=mt.float64, requires_grad=True)
    e = mt.tensor([0.0, 3.0], dtype=mt.float64, requires_grad=True)
    (base ** e).sum().backward()
    assert base.grad.numpy()[0] == 0.0
    assert e.grad.numpy()[0] == 0.0
    np.testing.assert_allclose(e.grad.numpy()[1], 8 * np.log(2))


def test_floor_divide_and_remainder_follow_python_signs():
    a = mt.tensor([7, -7, 7, -7])
    b = mt.tensor([2, 2, -2, -2])
    np.testing.assert_array_equal((a // b).numpy(), [3, -4, -4, 3])
    np.testing.assert_array_equal((a % b).numpy(), [1, 1, -1, -1])
    x = f64(5)
    assert mt.gradcheck(lambda t: t % 0.7, [x])


def test_gradcheck_runs_the_function_with_grad_enabled():
    seen = []

    def fn(t):
        y = t * 2
        y.register_hook(lambda g: seen.append(1))   # needs grad mode on
        return y.tanh()

    assert mt.gradcheck(fn, [f64(3)])
    assert seen


# ---- the reference behaviours, compared with torch ----------------------------------------------

def test_against_torch_for_the_edge_cases():
    torch = pytest.importorskip("torch")
    x = np.array([[-np.inf, -np.inf], [np.inf, 1.0]])
    np.testing.assert_array_equal(mt.logsumexp(mt.tensor(x), 1).numpy(),
                                  torch.logsumexp(torch.tensor(x), 1).numpy())
    v = np.array([np.nan, -1.0, 0.0, 2.0])
    np.testing.assert_array_equal(mt.tensor(v).relu().numpy(), torch.tensor(v).relu().numpy())
    a, b = np.array([7, -7, 7, -7]), np.array([2, 2, -2, -2])
    np.testing.assert_array_equal((mt.tensor(a) // mt.tensor(b)).numpy(),
                                  (torch.tensor(a) // torch.tensor(b)).numpy())
    np.testing.assert_array_equal((mt.tensor(a) % mt.tensor(b)).numpy(),
                                  (torch.tensor(a) % torch.tensor(b)).numpy())
    tx = torch.tensor([0.0, 2.0], dtype=torch.float64, requires_grad=True)
    (tx ** 0).sum().backward()
    mx = mt.tensor([0.0, 2.0], dtype=mt.float64, requires_grad=True)
    (mx ** 0).sum().backward()
    np.testing.assert_array_equal(mx.grad.numpy(), tx.grad.numpy())
    ta = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    torch.maximum(ta, torch.tensor([1.0, 0.0], dtype=torch.float64)).sum().backward()
    ma = mt.tensor([1.0, 2.0], dtype=mt.float64, requires_grad=True)
    mt.maximum(ma, mt.tensor([1.0, 0.0], dtype=mt.float64)).sum().backward()
    np.testing.assert_array_equal(ma.grad.numpy(), ta.grad.numpy())


def test_int_beside_an_index_tensor_orders_dims_like_torch():
    x = f64(3, 4, 5)
    idx = mt.tensor([0, 2, 2])
    out = x[1, :, idx]
    assert out.shape == (4, 3)             # numpy would give (3, 4)
    np.testing.assert_array_equal(out.numpy(), x.detach().numpy()[1][:, [0, 2, 2]])
    assert mt.gradcheck(lambda t: t[1, :, idx], [x])
    torch = pytest.importorskip("torch")
    tx = torch.tensor(x.detach().numpy())
    assert tuple(tx[1, :, torch.tensor([0, 2, 2])].shape) == out.shape


def test_format_of_a_0d_tensor_like_torch():
    loss = mt.tensor(1.23456)
    assert f"{loss:.3f}" == "1.235"
    assert f"{mt.tensor(7):d}" == "7"
    with pytest.raises(TypeError):
        f"{mt.zeros(3):.2f}"


def test_any_all_with_dim_and_keepdims_alias():
    m = mt.tensor([[True, False], [True, True]])
    np.testing.assert_array_equal(m.all(1).numpy(), [False, True])
    np.testing.assert_array_equal(m.any(0, keepdim=True).numpy(), [[True, True]])
    assert m.all().item() is False
    P = mt.tensor([[1.0, 3.0], [2.0, 2.0]])
    assert P.sum(1, keepdims=True).shape == (2, 1)          # makemore writes keepdims
    assert mt.sum(P, 1, keepdims=True).shape == (2, 1)
    assert P.max(1, keepdims=True).values.shape == (2, 1)


def test_inplace_with_a_python_float_keeps_float64_precision():
    t = mt.ones(1, dtype=mt.float64)
    t.mul_(0.9)
    assert t.item() == 0.9
    t.add_(0.1)
    assert t.item() == 0.9 + 0.1
    t.div_(3.0)
    assert t.item() == (0.9 + 0.1) / 3.0


def test_autograd_grad_runs_only_the_nodes_that_lead_to_its_inputs():
    # torch runs (and frees) only the part of the graph between outputs and inputs: the
    # rest stays usable for a later backward without retain_graph
    w = f64(3)
    h = (w * 2).tanh()                  # upstream of h: not needed for d loss / d h
    loss = (h * h).sum()
    (gh,) = mt.autograd.grad(loss, h)
    np.testing.assert_allclose(gh.numpy(), 2 * h.detach().numpy())
    assert h.grad_fn is not None and not h.grad_fn.freed
    calls = []

    class Spy(mt.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g

    a = f64(2)
    b = Spy.apply(a)
    c = b.exp()
    (gc,) = mt.autograd.grad(c.sum(), c)
    assert not calls                     # Spy sits upstream of c: never run
    np.testing.assert_array_equal(gc.numpy(), np.ones(2))


def test_inplace_on_a_tensor_that_requires_grad_is_refused_not_wrong():
    # torch records in-place ops; microtensor's engine does not, so it refuses them rather
    # than give x.grad = 1 for y = x * 1; y.mul_(2) (torch: 2)
    x = mt.ones(3, requires_grad=True)
    y = x * 1.0
    with pytest.raises(RuntimeError, match="out of place"):
        y.mul_(2.0)
    with pytest.raises(RuntimeError):
        x[::2].add_(1.0)                # a view of a leaf that requires grad (torch refuses too)
    (y * 2.0).sum().backward()          # the out-of-place form works
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0, 2.0])


def test_size_and_split_of_a_0d_tensor_raise_instead_of_crashing():
    code = ("import microtensor as mt\n"
            "t = mt.tensor(1.0)\n"
            "for f in (lambda: t.size(0), lambda: t.split(1, 0), lambda: t.chunk(1, 0),\n"
            "          lambda: mt.cat([mt.ones(1), t], -2), lambda: t.transpose(0, -2)):\n"
            "    try:\n"
            "        f()\n"
            "    except (IndexError, RuntimeError):\n"
            "        pass\n"
            "    else:\n"
            "        raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)


# ---- what Python assigns to the graph never reaches the engine unchecked ---------------

ASSIGNMENTS = {
    "node inputs: an int": "y.grad_fn.inputs = (5,)",
    "node inputs: an array": "y.grad_fn.inputs = (np.ones(2),)",
    "node saved versions": "y.grad_fn._saved_versions = (5, 1, 2)",
    "node retained output": "y.retain_grad(); y.grad_fn._retained = lambda: 5",
    "tensor grad": "x._grad = 5",
    "tensor version counter": "x._vc = 5",
    "tensor node": "y._node = 5",
    "attach: an array input": "attach(mt.ones(2), Node(), (np.ones(2),))",
    "attach: inputs not a tuple": "attach(mt.ones(2), Node(), [x])",
    "replace_inputs": "replace_inputs(y.grad_fn, (5,))",
}


@pytest.mark.parametrize("what", sorted(ASSIGNMENTS))
def test_assignments_to_the_graph_raise_instead_of_crashing(what):
    """Each assignment either raises where it is made, or the backward and next_functions
    after it raise: a Python exception in a child process, never a signal."""
    code = ("import numpy as np\nimport microtensor as mt\n"
            "from microtensor.core._core import attach, Node, replace_inputs\n"
            "x = mt.ones(2, requires_grad=True)\ny = x * 2\n"
            "try:\n"
            f"    {ASSIGNMENTS[what]}\n"
            "except (TypeError, AttributeError, ValueError) as e:\n"
            "    print('refused:', e)\n"
            "    raise SystemExit(0)\n"
            "y.grad_fn.next_functions\ny.sum().backward()\nprint('ran')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), (r.returncode, r.stderr)        # never a signal
    assert "refused:" in r.stdout or "Error" in r.stderr, (r.stdout, r.stderr)
