"""mt.autograd.Function as torch defines it: ctx is the user's namespace, keyword
arguments bind to forward, non-tensor outputs get None gradients, and
ctx.set_materialize_grads(False) hands backward None for an output that got no gradient.
Each class of program is written once and run in both libraries (`lib` is torch or mt)."""
import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")
LIBS = [mt, torch]


def make(lib, name, forward, backward, **extra):
    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    body.update({k: staticmethod(v) for k, v in extra.items()})
    return type(name, (lib.autograd.Function,), body)


def data(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def leaf(lib, a):
    return lib.tensor(a, dtype=lib.float64, requires_grad=True)


def npy(t):
    return None if t is None else t.detach().numpy()


# ---- item 5: any attribute name is the user's ----------------------------------------

# every name the engine kept on ctx before, names torch's own ctx lets a user set, and
# the names of the node's methods; each set in forward and read back in backward
USER_NAMES = ["fn", "inputs", "release", "freed", "name", "backward", "create_graph",
              "_saved", "_args", "_outputs", "_to_save", "_saved_at", "_non_differentiable",
              "_split", "_call_backward", "_reduce", "_call", "_ctx", "_engine_call",
              "saved_mask", "_hooks", "_retained", "_trace", "register_hook", "outputs",
              "args", "saved", "arrived", "cls", "materialize"]


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("name", USER_NAMES)
def test_every_attribute_name_is_the_users(name, several):
    grads, seconds, values = [], [], []
    for lib in LIBS:
        def forward(ctx, x, k):
            setattr(ctx, name, ("mine", name))
            ctx.k = k
            ctx.save_for_backward(x)
            y = x.sin() * k
            return (y, x.cos()) if several else y

        def backward(ctx, g, *more):
            assert getattr(ctx, name) == ("mine", name)
            (x,) = ctx.saved_tensors
            gx = g * x.cos() * ctx.k
            if several:
                gx = gx - more[0] * x.sin()
            return gx, None
        F = make(lib, "Tagged", forward, backward)
        x = leaf(lib, data((3, 2), 1))
        out = F.apply(x, 1.5)
        y = out[0] + 2 * out[1] if several else out
        values.append(npy(y))
        w = lib.tensor(data((3, 2), 2))
        (g,) = lib.autograd.grad((y * w).sum(), x, create_graph=True, retain_graph=True)
        grads.append(npy(g))
        (h,) = lib.autograd.grad((g * g).sum(), x)              # through backward again
        seconds.append(npy(h))
        (y * w).sum().backward()                                   # and once more, freeing
        assert getattr(out[0] if several else out, "grad_fn") is not None
    for a, b in (values, grads, seconds):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_checkpoint_style_ctx_fn_and_ctx_inputs():
    """torch.utils.checkpoint's pattern: ctx.fn, ctx.inputs, recompute in backward."""
    grads = []
    for lib in LIBS:
        def forward(ctx, fn, *inputs):
            ctx.fn, ctx.inputs = fn, list(inputs)
            ctx.release, ctx.freed = "user release", "user freed"
            return fn(*inputs)

        def backward(ctx, g):
            assert ctx.release == "user release" and ctx.freed == "user freed"
            with lib.enable_grad():
                xs = [t.detach().requires_grad_(True) for t in ctx.inputs]
                out = ctx.fn(*xs)
            return (None,) + tuple(lib.autograd.grad(out, xs, g))
        F = make(lib, "Checkpoint", forward, backward)
        a, b = leaf(lib, data((4,), 3)), leaf(lib, data((4,), 4))
        y = F.apply(lambda p, q: (p * q).exp() + p, a, b)
        (y * lib.tensor(data((4,), 5))).sum().backward()
        grads.append((npy(a.grad), npy(b.grad)))
    for m, t in zip(*grads):
        np.testing.assert_allclose(m, t, rtol=1e-12)


def test_saved_tensors_is_read_only_and_needs_input_grad_is_writable_as_in_torch():
    seen = {}
    for lib in LIBS:
        def forward(ctx, x, k):
            with pytest.raises(AttributeError):
                ctx.saved_tensors = (x,)
            ctx.needs_input_grad = ("user", "value")
            ctx.save_for_backward(x)
            return x * k

        def backward(ctx, g):
            seen[lib.__name__] = ctx.needs_input_grad
            (x,) = ctx.saved_tensors
            return g * 2.0, None
        x = leaf(lib, data((2,), 6))
        make(lib, "RO", forward, backward).apply(x, 2.0).sum().backward()
        np.testing.assert_array_equal(npy(x.grad), [2.0, 2.0])
    assert seen["microtensor"] == seen["torch"] == ("user", "value")


def test_grad_fn_reads_the_ctx_through():
    def forward(ctx, x):
        ctx.note = "kept"
        ctx.save_for_backward(x)
        return x * 3

    def backward(ctx, g):
        return g * 3
    for lib in LIBS:
        x = leaf(lib, data((2,), 7))
        y = make(lib, "Through", forward, backward).apply(x)
        assert y.grad_fn.note == "kept"
        assert y.grad_fn.saved_tensors[0] is x
        assert y.grad_fn.needs_input_grad == (True,)
        y.sum().backward()
        with pytest.raises(RuntimeError, match="freed"):
            y.grad_fn.saved_tensors


# ---- item 6: keyword arguments bind to forward ----------------------------------------

def scaled(lib):
    def forward(ctx, x, scale=2.0, shift=0.0):
        ctx.scale, ctx.seen = scale, (scale, shift, ctx.needs_input_grad)
        return x * scale + shift

    def backward(ctx, g):
        return (g * ctx.scale,) + (None,) * (len(ctx.needs_input_grad) - 1)
    return make(lib, "Scaled", forward, backward)


CALLS = [((), {}), ((), {"scale": 3.0}), ((3.0,), {"shift": 1.0}),
         ((), {"shift": 1.0, "scale": 4.0}), ((5.0, -1.0), {})]


@pytest.mark.parametrize("args,kwargs", CALLS)
@pytest.mark.parametrize("x_by_name", [False, True])
def test_keyword_arguments_bind_to_forward_as_in_torch(args, kwargs, x_by_name):
    got = []
    for lib in LIBS:
        x = leaf(lib, data((3,), 8))
        F = scaled(lib)
        y = F.apply(*args, x=x, **kwargs) if x_by_name and not args else F.apply(x, *args, **kwargs)
        seen = y.grad_fn.seen
        (y * lib.tensor([1.0, -2.0, 0.5])).sum().backward()
        got.append((npy(y), npy(x.grad), seen))
    np.testing.assert_allclose(got[0][0], got[1][0], rtol=1e-12)
    np.testing.assert_allclose(got[0][1], got[1][1], rtol=1e-12)
    assert got[0][2] == got[1][2]


def test_a_tensor_given_by_keyword_is_an_input_with_its_gradient():
    got = []
    for lib in LIBS:
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b.exp()

        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b.exp(), g * a * b.exp()
        F = make(lib, "KwTensor", forward, backward)
        a, b = leaf(lib, data((3,), 9)), leaf(lib, data((3,), 10))
        F.apply(a, b=b).sum().backward()
        F.apply(b=b, a=a).sum().backward()
        got.append((npy(a.grad), npy(b.grad)))
    for m, t in zip(*got):
        np.testing.assert_allclose(m, t, rtol=1e-12)


def test_a_skipped_default_is_filled_in_and_keyword_only_parameters_work():
    seen = []

    def forward(ctx, a, b=1.5, c=2.0, *, d=10.0, **more):
        seen.append((b, c, d, more, ctx.needs_input_grad))
        return a * b * c + d

    def backward(ctx, g):
        return (g * 3.0,) + (None,) * (len(ctx.needs_input_grad) - 1)
    F = make(mt, "Gap", forward, backward)
    x = mt.ones(2, requires_grad=True, dtype=mt.float64)
    np.testing.assert_allclose(F.apply(x, c=4.0).numpy(), [16.0, 16.0])
    np.testing.assert_allclose(F.apply(x, d=0.0, e=1).numpy(), [3.0, 3.0])
    F.apply(x, 2.0, d=1.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])
    assert seen == [(1.5, 4.0, 10.0, {}, (True, False, False)),
                    (1.5, 2.0, 0.0, {"e": 1}, (True,)),
                    (2.0, 2.0, 1.0, {}, (True, False))]


def test_a_keyword_only_tensor_that_requires_grad_is_refused():
    def forward(ctx, a, *, w):
        return a * w

    def backward(ctx, g):
        return g
    F = make(mt, "KwOnly", forward, backward)
    x = mt.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="keyword-only argument 'w' requires grad"):
        F.apply(x, w=mt.ones(2, requires_grad=True))
    np.testing.assert_array_equal(F.apply(x, w=mt.ones(2) * 3).detach().numpy(), [3.0, 3.0])


@pytest.mark.parametrize("call", ["unknown", "twice", "missing"])
def test_a_wrong_keyword_raises_a_type_error_naming_it(call):
    for lib in LIBS:
        def forward(ctx, x, y):
            return x * y

        def backward(ctx, g):
            return g, g
        F = make(lib, "Two", forward, backward)
        x = leaf(lib, data((2,), 11))
        with pytest.raises(TypeError, match={"unknown": "'z'", "twice": "'x'",
                                             "missing": "'y'"}[call]):
            if call == "unknown":
                F.apply(x, x, z=1)
            elif call == "twice":
                F.apply(x, x=x)
            else:
                F.apply(x=x)


def test_setup_context_form():
    got = []
    for lib in LIBS:
        def forward(x, k=2.0):
            return x.exp() * k

        def setup_context(ctx, inputs, output):
            ctx.k = inputs[1]
            ctx.save_for_backward(output)

        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y, None
        F = make(lib, "Setup", forward, backward, setup_context=setup_context)
        x = leaf(lib, data((3,), 12))
        (F.apply(x) + F.apply(x, k=3.0)).sum().backward()
        got.append(npy(x.grad))
    np.testing.assert_allclose(got[0], got[1], rtol=1e-12)


# ---- items 7 and 8: one gradient per output; None where torch gives None -------------

def mixed(lib, materialize):
    """Tensors, non-tensors, an integer tensor and a non-differentiable one, mixed."""
    def forward(ctx, x):
        ctx.set_materialize_grads(materialize)
        nd = x * 5
        ctx.mark_non_differentiable(nd)
        ctx.save_for_backward(x)
        return x * 2, 5, "s", x.sin(), x.argmax(), None, nd, (1, 2), x.sum()

    def backward(ctx, *gs):
        ctx.shapes = [None if g is None else tuple(g.shape) for g in gs]
        ctx.zero = [None if g is None else bool((g == 0).all()) for g in gs]
        (x,) = ctx.saved_tensors
        total = x * 0
        for g, d in ((gs[0], 2.0), (gs[3], x.cos()), (gs[8], 1.0)):
            if g is not None:
                total = total + g * d
        return total
    return make(lib, "Mixed", forward, backward)


@pytest.mark.parametrize("materialize", [True, False])
@pytest.mark.parametrize("used", [(0,), (3,), (8,), (0, 3), (0, 3, 8), (3, 8)])
def test_non_tensor_outputs_and_materialize_grads_match_torch(materialize, used):
    got = []
    for lib in LIBS:
        x = leaf(lib, data((4,), 13))
        out = mixed(lib, materialize).apply(x)
        assert [type(o).__name__ for o in out] == ["Tensor", "int", "str", "Tensor", "Tensor",
                                                   "NoneType", "Tensor", "tuple", "Tensor"]
        assert [getattr(o, "requires_grad", None) for o in out] == \
            [True, None, None, True, False, None, False, None, True]
        loss = sum((out[i] * (i + 1.0)).sum() for i in used)
        loss.backward()
        node = out[used[0]].grad_fn
        got.append((node.shapes, node.zero, npy(x.grad)))
    assert got[0][0] == got[1][0]
    assert got[0][1] == got[1][1]
    np.testing.assert_allclose(got[0][2], got[1][2], rtol=1e-12)


@pytest.mark.parametrize("materialize", [True, False])
def test_materialize_grads_under_create_graph_and_retain_graph(materialize):
    got = []
    for lib in LIBS:
        x = leaf(lib, data((4,), 14))
        out = mixed(lib, materialize).apply(x)
        node = out[0].grad_fn
        record = []
        for i in (0, 3, 8, 3):                    # one graph, several passes, one output each
            (g,) = lib.autograd.grad(out[i].sum(), x, create_graph=True, retain_graph=True)
            record.append((list(node.shapes), npy(g)))
            (h,) = lib.autograd.grad((g * g).sum(), x, retain_graph=True)
            record.append(npy(h))
        got.append(record)
    for a, b in zip(*got):
        if isinstance(a, tuple):
            assert a[0] == b[0]
            np.testing.assert_allclose(a[1], b[1], rtol=1e-12)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("order", ["tensor_first", "value_first"])
def test_one_tensor_beside_a_value(order):
    got = []
    for lib in LIBS:
        def forward(ctx, x):
            return (x * 2, 5) if order == "tensor_first" else (7.5, x * 2)

        def backward(ctx, a, b):
            ctx.seen = (a is None, b is None)
            return (a if order == "tensor_first" else b) * 2
        x = leaf(lib, data((3,), 15))
        out = make(lib, "Pair", forward, backward).apply(x)
        t = out[0] if order == "tensor_first" else out[1]
        t.sum().backward()
        got.append((t.grad_fn.seen, npy(x.grad), out[1] if order == "tensor_first" else out[0]))
    assert got[0][0] == got[1][0]
    assert got[0][2] == got[1][2]
    np.testing.assert_allclose(got[0][1], got[1][1])


def test_a_list_is_one_output_that_is_not_a_tensor_as_in_torch():
    for lib in LIBS:
        def forward(ctx, x):
            return [x * 2, 3.0]

        def backward(ctx, g):
            return g
        r = make(lib, "Listed", forward, backward).apply(leaf(lib, data((2,), 16)))
        assert type(r) is list and r[1] == 3.0 and not r[0].requires_grad
