"""mt.autograd.Function against torch.autograd.Function: the same class body, written
once per library (`lib` is torch or microtensor), must give the same values, gradients,
second derivatives and errors."""
import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")


def make(lib, name, forward, backward):
    return type(name, (lib.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def both(shape, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape)
    return (mt.tensor(a, dtype=mt.float64, requires_grad=True),
            torch.tensor(a, dtype=torch.float64, requires_grad=True))


def close(a, b):
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-10, atol=1e-12)


# ---- classes written once, for either library ---------------------------------------

def clamp_ste(lib):
    """A straight-through clamp: tensor methods in forward and backward (a port of a torch
    Function: with numpy arrays it failed on .clamp)."""
    def forward(ctx, x, lo, hi):
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.clamp(lo, hi)

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        inside = ((x >= ctx.lo) & (x <= ctx.hi)).to(g.dtype)
        return g * (0.5 + 0.5 * inside), None, None
    return make(lib, "ClampSTE", forward, backward)


def mul_exp(lib):
    """a * exp(b): two inputs, an input and the output saved, a backward differentiable again."""
    def forward(ctx, a, b):
        y = a * b.exp()
        ctx.save_for_backward(a, b, y)
        return y

    def backward(ctx, g):
        a, b, y = ctx.saved_tensors
        return g * b.exp(), g * y
    return make(lib, "MulExp", forward, backward)


def split_two(lib):
    """Two outputs of different shapes, and a non-differentiable integer one."""
    def forward(ctx, x):
        s, c = x.sin(), x.cos().sum(0)
        idx = x.argmax()
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return s, idx, c

    def backward(ctx, gs, gidx, gc):
        (x,) = ctx.saved_tensors
        ctx.seen = (tuple(gidx.shape), float(gidx.sum()))
        return gs * x.cos() - gc * x.sin()
    return make(lib, "SplitTwo", forward, backward)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_torch_function_ports_unchanged(seed):
    xm, xt = both((4, 5), seed)
    ym = clamp_ste(mt).apply(xm, -0.5, 0.7)
    yt = clamp_ste(torch).apply(xt, -0.5, 0.7)
    close(ym, yt)
    w = np.random.default_rng(9).standard_normal((4, 5))
    (ym * mt.tensor(w)).sum().backward()
    (yt * torch.tensor(w)).sum().backward()
    close(xm.grad, xt.grad)
    assert ym.grad_fn.name() == "ClampSTEBackward"


def test_forward_and_backward_see_tensors():
    seen = []

    def forward(ctx, x, k):
        seen.append((type(x), type(k)))
        return x * k

    def backward(ctx, g):
        seen.append(type(g))
        return g * 2.0, None
    F = make(mt, "Scale", forward, backward)
    x = mt.ones(3, requires_grad=True)
    F.apply(x, 2.0).sum().backward()
    assert seen == [(mt.Tensor, float), mt.Tensor]
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0, 2.0])


def test_two_inputs_and_second_order_match_torch():
    am, at = both((3, 4), 1)
    bm, bt = both((3, 4), 2)
    ym = mul_exp(mt).apply(am, bm)
    yt = mul_exp(torch).apply(at, bt)
    close(ym, yt)
    gm = mt.autograd.grad(ym.sum(), (am, bm), create_graph=True)
    gt = torch.autograd.grad(yt.sum(), (at, bt), create_graph=True)
    for a, b in zip(gm, gt):
        close(a, b)
        assert a.requires_grad
    hm = mt.autograd.grad((gm[0] * gm[1]).sum(), (am, bm))
    ht = torch.autograd.grad((gt[0] * gt[1]).sum(), (at, bt))
    for a, b in zip(hm, ht):
        close(a, b)
    assert mt.gradcheck(mul_exp(mt).apply, [am, bm])
    assert mt.gradgradcheck(mul_exp(mt).apply, [am, bm])


def test_gradgradcheck_catches_a_backward_that_is_right_only_to_first_order():
    def forward(ctx, a, b):
        y = a * b.exp()
        ctx.save_for_backward(a, b, y)
        return y

    def backward(ctx, g):
        a, b, y = ctx.saved_tensors
        return g * b.exp(), g * y.detach()       # detached: the second order loses a term
    F = make(mt, "Detached", forward, backward)
    a, b = both((3,), 3)[0], both((3,), 4)[0]
    assert mt.gradcheck(F.apply, [a, b])
    with pytest.raises(mt.autograd.GradcheckError):
        mt.gradgradcheck(F.apply, [a, b])


def test_several_outputs_and_a_non_differentiable_one():
    xm, xt = both((3, 4), 5)
    Fm, Ft = split_two(mt), split_two(torch)
    sm, im, cm = Fm.apply(xm)
    st, it, ct = Ft.apply(xt)
    close(sm, st)
    close(cm, ct)
    assert im.requires_grad is it.requires_grad is False
    assert int(im.item()) == int(it.item())
    assert sm.requires_grad and cm.requires_grad
    wm = np.random.default_rng(1).standard_normal((3, 4))
    (mt.tensor(wm) * sm).sum().add(cm.sum() * 3).backward()
    (torch.tensor(wm) * st).sum().add(ct.sum() * 3).backward()
    close(xm.grad, xt.grad)
    assert sm.grad_fn is not None and cm.grad_fn is not None
    # one output unused: it gets zeros, as torch's materialized gradients
    xm.grad, xt.grad = None, None
    Fm.apply(xm)[2].sum().backward()
    Ft.apply(xt)[2].sum().backward()
    close(xm.grad, xt.grad)


def test_several_outputs_second_order():
    xm, xt = both((2, 3), 6)
    w = np.random.default_rng(2).standard_normal(3)        # unequal weights per output
    sm, _, cm = split_two(mt).apply(xm)
    st, _, ct = split_two(torch).apply(xt)
    gm = mt.autograd.grad(sm.sum() + (cm * mt.tensor(w)).sum(), xm, create_graph=True)[0]
    gt = torch.autograd.grad(st.sum() + (ct * torch.tensor(w)).sum(), xt, create_graph=True)[0]
    close(gm, gt)
    close(mt.autograd.grad((gm * gm).sum(), xm)[0], torch.autograd.grad((gt * gt).sum(), xt)[0])


def test_needs_input_grad():
    for lib in (mt, torch):
        seen = []

        def forward(ctx, a, k, b):
            seen.append(ctx.needs_input_grad)
            return a * b * k

        def backward(ctx, g):
            return g, None, g
        F = make(lib, "Needs", forward, backward)
        a = lib.ones(2, requires_grad=True)
        b = lib.ones(2)
        F.apply(a, 3.0, b)
        with lib.no_grad():
            F.apply(a, 3.0, b)
        assert seen == [(True, False, False)] * 2, lib.__name__      # torch: also under no_grad


def test_no_graph_under_no_grad_or_without_inputs_that_require_grad():
    F = clamp_ste(mt)
    x = mt.ones(3, requires_grad=True)
    with mt.no_grad():
        assert F.apply(x, 0.0, 1.0).grad_fn is None
    assert F.apply(mt.ones(3), 0.0, 1.0).requires_grad is False


def test_a_saved_tensor_changed_in_place_raises_on_backward():
    for lib in (mt, torch):
        F = clamp_ste(lib)
        x = lib.ones(3, requires_grad=True)
        h = x * 1.0
        y = F.apply(h, 0.0, 2.0)
        with lib.no_grad():
            h.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*version 1; "
                                               "expected version 0"):
            y.sum().backward()


def test_only_what_was_saved_is_checked():
    # a tensor changed in place before the call (version 1 when saved) is fine, and so is
    # changing an input the Function did not save
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, None
    grads = []
    for lib in (mt, torch):
        x = lib.ones(3, requires_grad=True)
        h = x * 1.0
        w = lib.tensor([1.0, 2.0, 3.0])
        w.add_(1.0)
        y = make(lib, "Scale", forward, backward).apply(h, w)
        with lib.no_grad():
            h.mul_(5.0)
        y.sum().backward()
        grads.append(x.grad.numpy())
        y = make(lib, "Scale", forward, backward).apply(x, w)
        w.add_(1.0)
        with pytest.raises(RuntimeError, match="version 2; expected version 1"):
            y.sum().backward()
    np.testing.assert_array_equal(grads[0], grads[1])


def test_a_saved_output_changed_through_a_view_raises():
    # the output is saved; a view of it is changed in place (shares its version counter)
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y
    for lib in (mt, torch):
        x = lib.ones(3, requires_grad=True)
        y = make(lib, "Exp", forward, backward).apply(x)
        with lib.no_grad():
            y.detach()[0:1].mul_(2.0) if lib is torch else y[0:1].mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_saved_tensors_after_the_graph_is_freed():
    F = clamp_ste(mt)
    x = mt.ones(3, requires_grad=True)
    y = F.apply(x, 0.0, 1.0)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="freed"):
        y.grad_fn.saved_tensors
    assert y.grad_fn.name() == "ClampSTEBackward"           # still has its name


def test_save_for_backward_refuses_what_is_not_a_tensor():
    def forward(ctx, x):
        ctx.save_for_backward(x, 3)
        return x * 2

    def backward(ctx, g):
        return g
    for lib in (mt, torch):
        with pytest.raises(TypeError, match="save_for_backward can only save variables, but "
                                            "argument 1 is of type int"):
            make(lib, "Bad", forward, backward).apply(lib.ones(2, requires_grad=True))


@pytest.mark.parametrize("case", ["too_few", "too_many", "grad_for_a_number", "bad_shape"])
def test_wrong_gradients_raise_as_torch(case):
    def forward(ctx, x, k):
        return x * k

    def backward(ctx, g):
        lib = mt if isinstance(g, mt.Tensor) else torch
        if case == "too_few":
            return g * 2
        if case == "too_many":
            return g * 2, None, g
        if case == "grad_for_a_number":
            return g * 2, lib.ones(1)
        return lib.ones(2), None
    messages = []
    for lib in (mt, torch):
        x = lib.ones(3, requires_grad=True)
        with pytest.raises(RuntimeError) as info:
            make(lib, "Wrong", forward, backward).apply(x, 2.0).sum().backward()
        messages.append(str(info.value).split(". ")[0])
    assert messages[0] == messages[1]


def test_extra_none_gradients_are_allowed_and_broadcast_ones_are_summed():
    def forward(ctx, x, k):
        return x * k

    def backward(ctx, g):
        lib = mt if isinstance(g, mt.Tensor) else torch
        return lib.ones(4, 1, 3), None, None           # summed down to x's (1, 3)
    grads = []
    for lib in (mt, torch):
        x = lib.ones(1, 3, requires_grad=True)
        make(lib, "Extra", forward, backward).apply(x, 2.0).sum().backward()
        grads.append(x.grad.numpy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_returning_an_input_makes_a_new_output():
    for lib in (mt, torch):
        def forward(ctx, x):
            return x

        def backward(ctx, g):
            return g * 3
        x = lib.ones(2, requires_grad=True)
        y = make(lib, "Ident", forward, backward).apply(x)
        assert y is not x and x.grad_fn is None and y.grad_fn is not None
        y.sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])


def test_once_differentiable_matches_torch_to_first_order():
    for lib in (mt, torch):
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            assert not lib.is_grad_enabled()
            return 2 * x * g
        F = make(lib, "Sq", forward, lib.autograd.function.once_differentiable(backward))
        x = lib.tensor([1.0, -2.0], requires_grad=True)
        gy = lib.tensor([1.0, 1.0], requires_grad=True)
        (g,) = lib.autograd.grad(F.apply(x), x, gy, create_graph=True)
        np.testing.assert_array_equal(g.detach().numpy(), [2.0, -4.0])
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()


def test_set_materialize_grads_is_accepted():
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2

    def backward(ctx, g):
        return g * 2
    x = mt.ones(2, requires_grad=True)
    make(mt, "M", forward, backward).apply(x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0])
