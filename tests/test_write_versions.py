"""Every write to a tensor counts, on every backward path.

A graph that saved a tensor must not run backward with values written into it later:
backward raises PyTorch's "modified by an inplace operation" error instead. These tests
walk the whole write surface (every in-place Tensor method, nn.init, load_state_dict,
the optimizers, index assignment), and every op of the op tables on both backward paths
(first order, and create_graph, whose rules are differentiable tensor ops)."""
import numpy as np
import pytest

import microtensor as mt
from microtensor import nn

from test_higher_order import FUSED
from test_ops import OPS, make_inputs

rng = np.random.default_rng(7)
INPLACE = "modified by an inplace operation"


# ---- the write surface: each entry writes into w (float64, shape (3, 4)) --------------

def _index(shape):
    return mt.tensor(np.array([0, 2]))


TENSOR_WRITES = {
    "abs_": lambda w: w.abs_(), "add_": lambda w: w.add_(1.0),
    "apply_": lambda w: w.apply_(lambda v: v + 1),
    "bernoulli_": lambda w: w.bernoulli_(0.5), "ceil_": lambda w: w.ceil_(),
    "clamp_": lambda w: w.clamp_(-0.1, 0.1), "clamp_max_": lambda w: w.clamp_max_(0.1),
    "clamp_min_": lambda w: w.clamp_min_(-0.1), "copy_": lambda w: w.copy_(mt.ones(3, 4)),
    "cos_": lambda w: w.cos_(), "cumsum_": lambda w: w.cumsum_(0),
    "div_": lambda w: w.div_(2.0), "exp_": lambda w: w.exp_(), "expm1_": lambda w: w.expm1_(),
    "exponential_": lambda w: w.exponential_(), "fill_": lambda w: w.fill_(2.0),
    "fill_diagonal_": lambda w: w.fill_diagonal_(5.0), "floor_": lambda w: w.floor_(),
    "index_add_": lambda w: w.index_add_(0, _index(w.shape), mt.ones(2, 4, dtype=mt.float64)),
    "index_fill_": lambda w: w.index_fill_(0, _index(w.shape), 3.0),
    "lerp_": lambda w: w.lerp_(mt.ones(3, 4, dtype=mt.float64), 0.5),
    "log1p_": lambda w: w.abs_().log1p_(), "log_": lambda w: w.abs_().log_(),
    "masked_fill_": lambda w: w.masked_fill_(mt.ones(3, 4, dtype=mt.bool), 1.0),
    "mul_": lambda w: w.mul_(2.0), "neg_": lambda w: w.neg_(),
    "normal_": lambda w: w.normal_(), "pow_": lambda w: w.pow_(2),
    "random_": lambda w: w.random_(0, 5), "reciprocal_": lambda w: w.reciprocal_(),
    "relu_": lambda w: w.relu_(), "round_": lambda w: w.round_(),
    "rsqrt_": lambda w: w.abs_().rsqrt_(),
    "scatter_": lambda w: w.scatter_(0, mt.zeros(1, 4, dtype=mt.int64), 1.0),
    "scatter_add_": lambda w: w.scatter_add_(0, mt.zeros(1, 4, dtype=mt.int64),
                                             mt.ones(1, 4, dtype=mt.float64)),
    "sigmoid_": lambda w: w.sigmoid_(), "sign_": lambda w: w.sign_(), "sin_": lambda w: w.sin_(),
    "sqrt_": lambda w: w.abs_().sqrt_(), "square_": lambda w: w.square_(),
    "sub_": lambda w: w.sub_(1.0), "tanh_": lambda w: w.tanh_(), "trunc_": lambda w: w.trunc_(),
    "uniform_": lambda w: w.uniform_(), "zero_": lambda w: w.zero_(),
}
# in-place methods that change no value: nothing for a graph to miss
NOT_WRITES = {"detach_", "requires_grad_", "share_memory_"}


def _setitem(w):
    w[1] = 7.0


def _load_state_dict(w):
    lin = nn.Linear(4, 3, dtype=mt.float64)
    lin.weight = nn.Parameter(w) if not isinstance(w, nn.Parameter) else w
    lin.load_state_dict({"weight": mt.ones(3, 4, dtype=mt.float64), "bias": lin.bias.detach()})


def _optimizer_step(cls, **kwargs):
    def write(w):
        w.grad = mt.ones(3, 4, dtype=mt.float64)
        cls([w], lr=0.1, **kwargs).step()
    return write


OTHER_WRITES = {
    "t[i] = v": _setitem,
    "t.data = new": lambda w: _data_assignment(w),
    "Module.load_state_dict": _load_state_dict,
    "SGD.step": _optimizer_step(mt.optim.SGD, momentum=0.9),
    "Adam.step": _optimizer_step(mt.optim.Adam),
    "AdamW.step": _optimizer_step(mt.optim.AdamW),
}
INIT_ARGS = {"constant_": (0.5,)}


def _write_surface():
    cases = {f"Tensor.{n}": f for n, f in TENSOR_WRITES.items()}
    cases.update({f"nn.init.{n}": (lambda n: lambda w: getattr(nn.init, n)(w, *INIT_ARGS.get(n, ())))(n)
                  for n in _public_init_functions()})
    cases.update(OTHER_WRITES)
    return cases


def _public_init_functions():
    return sorted(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_"))


def _inplace_tensor_methods():
    return sorted(n for n in dir(mt.Tensor) if n.endswith("_") and not n.startswith("_"))


def test_the_write_table_covers_every_inplace_method():
    """A new in-place method must join TENSOR_WRITES (or NOT_WRITES, with a reason)."""
    missing = set(_inplace_tensor_methods()) - set(TENSOR_WRITES) - NOT_WRITES
    assert not missing, f"in-place Tensor methods with no entry in TENSOR_WRITES: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(_write_surface()))
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_write_into_a_saved_tensor_makes_backward_raise(name, create_graph):
    write = _write_surface()[name]
    w = nn.Parameter(mt.tensor(rng.uniform(0.5, 1.5, (3, 4))))
    x = mt.tensor(rng.standard_normal((2, 3)), requires_grad=True)
    y = (x @ w).sum()                                   # matmul saves w for dx
    version = w._version
    with mt.no_grad():
        write(w)
    assert w._version > version, f"{name} wrote into w without counting the change"
    with pytest.raises(RuntimeError, match=INPLACE):
        mt.autograd.grad(y, x, create_graph=create_graph)


def _data_assignment(w):
    w.data = mt.ones(3, 4, dtype=mt.float64)


def test_data_assignment_is_a_write_where_torch_mixes_old_and_new_values():
    """PyTorch's backward after `w.data = new` reads the new values through a saved w and
    the old ones through a saved view of w (Linear's transposed weight): either can be
    silently wrong. microtensor counts the assignment as a write and refuses."""
    torch = pytest.importorskip("torch")
    w0, x0 = rng.standard_normal((3, 4)), rng.standard_normal((2, 3))
    tx = torch.tensor(x0, requires_grad=True)
    tw = torch.nn.Parameter(torch.tensor(w0))
    ty = (tx @ tw).sum()
    tw.data = torch.ones(3, 4, dtype=torch.float64)
    ty.backward()
    assert np.allclose(tx.grad.numpy(), 4.0)            # torch: the new values, silently
    w, x = nn.Parameter(mt.tensor(w0)), mt.tensor(x0, requires_grad=True)
    y = (x @ w).sum()
    w.data = mt.ones(3, 4, dtype=mt.float64)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.backward()


# ---- both backward paths agree after an in-place change of an input -------------------

def _cases():
    cases = {f"op:{n}": (OPS[n][0], lambda n=n: [mt.tensor(a, requires_grad=True)
                                                 for a in make_inputs(n)]) for n in OPS}
    cases.update({f"fused:{n}": FUSED[n] for n in FUSED})
    return cases


def _grads_after_change(fn, originals, create_graph, change):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in originals]
    outs = fn(*inputs)
    outs = [outs] if isinstance(outs, mt.Tensor) else list(outs)
    up_rng = np.random.default_rng(1)
    upstream = [mt.tensor(up_rng.standard_normal(o.shape)) for o in outs]
    if change:
        with mt.no_grad():
            for t in inputs:
                if t.requires_grad:
                    t.mul_(1.5)               # keeps the sign: positive inputs stay positive
    try:
        grads = mt.autograd.grad(outs, [t for t in inputs if t.requires_grad], upstream,
                                 create_graph=create_graph, allow_unused=True)
    except RuntimeError as e:
        assert INPLACE in str(e), str(e)
        return "raised"
    return [None if g is None else g.detach().numpy() for g in grads]


@pytest.mark.parametrize("name", sorted(_cases()))
def test_after_an_inplace_change_both_paths_raise_or_give_the_forward_values_gradient(name):
    """Each path either raises, or gives the gradient at the values the forward pass saw
    (never a gradient mixed from the old graph and the new values)."""
    fn, make = _cases()[name]
    originals = make()
    state = mt.get_rng_state()
    before = _grads_after_change(fn, originals, False, change=False)
    for create_graph in (False, True):
        mt.set_rng_state(state)
        got = _grads_after_change(fn, originals, create_graph, change=True)
        if got == "raised":
            continue
        for g, ref in zip(got, before):
            assert (g is None) == (ref is None)
            if g is not None:
                np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-12,
                                           err_msg=f"{name}, create_graph={create_graph}")
