"""mt.inspect.explore on every kind of graph the engine builds (Python scalar operands,
constants, integer tensors, no-grad leaves, custom Functions, views, one tensor used
several times), and the residual split where the branch reads the stream twice or
several additions share one stream, each checked against the engine's own gradients."""
import numpy as np
import pytest

import microtensor as mt
from microtensor import inspect as mti
from microtensor import nn
from microtensor.nn import functional as F

pytestmark = pytest.mark.usefixtures("one_thread")


def norm(a):
    a = np.asarray(a.numpy() if isinstance(a, mt.Tensor) else a, dtype=np.float64)
    return float(np.linalg.norm(a))


class Cube(mt.autograd.Function):
    """y = k x^3 (k a Python number: no gradient for it)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * x * x * k

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * 3 * x * x * ctx.k, None


class SplitTwo(mt.autograd.Function):
    """(2x, 3x): two outputs, each with a node of its own in front of the Function's."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2 * 3


def _graphs():
    """name -> fn(x, w) building a loss from a leaf x (4, 5) and a parameter w (5, 5)."""
    const = mt.from_numpy(np.linspace(-1, 1, 20).reshape(4, 5))
    idx = mt.tensor([0, 3, 1, 1])
    return {
        "plus_eps": lambda x, w: ((x @ w) + 0.001).sum(),
        "one_minus": lambda x, w: (1 - x @ w).sum(),
        "two_over": lambda x, w: (2 / (x @ w + 10.0)).sum(),
        "rpow_and_pow": lambda x, w: (2.0 ** (x @ w).tanh() + (x @ w) ** 2).sum(),
        "clamp_where": lambda x, w: mt.where(x > 0, x @ w, 0.0).clamp(min=-0.5).sum(),
        "constant_tensor": lambda x, w: ((x @ w) * const).sum(),
        "integer_index": lambda x, w: (x @ w)[idx].sum(),
        "gather": lambda x, w: (x @ w).gather(1, mt.tensor([[0], [4], [2], [2]])).sum(),
        "embedding": lambda x, w: F.embedding(idx, w).sum() * x.sum(),
        "no_grad_leaf": lambda x, w: (x @ w * mt.ones(5, dtype=mt.float64)).sum(),
        "detached": lambda x, w: (x.detach() @ w + x).sum(),
        "custom_function": lambda x, w: Cube.apply(x @ w, 0.5).sum(),
        "custom_two_outputs": lambda x, w: (lambda a, b: (a * b).sum())(*SplitTwo.apply(x @ w)),
        "slices": lambda x, w: ((x[1:, ::2] @ w[::2, 1:]) * 2).sum(),
        "transpose_view": lambda x, w: (x.t() @ x @ w.t()).sum(),
        "expand_view": lambda x, w: (x[:, :1].expand(4, 5) * (x @ w)).sum(),
        "reshape_split": lambda x, w: sum(c.sum() for c in (x @ w).reshape(20).split(7)),
        "reused": lambda x, w: (x * x + x @ w + x).sum(),
        "doubling": lambda x, w: ((x @ w) + (x @ w)).sum(),
        "softmax_ce": lambda x, w: F.cross_entropy(x @ w, mt.tensor([0, 1, 4, 2])),
        "layer_norm_eps": lambda x, w: F.layer_norm(x @ w, (5,), eps=1e-5).pow(2).mean(),
        "leaf_is_loss_input": lambda x, w: (w * 3.0).sum(),
    }


GRAPHS = sorted(_graphs())


def walk(loss):
    """The graph behind `loss`, walked here: (op nodes, leaf tensors by id, edges)."""
    nodes, leaves, edges, work = set(), {}, set(), [loss]
    while work:
        t = work.pop()
        if t._node is None:
            leaves[id(t)] = t
            continue
        if t._node in nodes:
            continue
        nodes.add(t._node)
        for inp in t._node.inputs:
            if inp is not None and inp._requires_grad:
                edges.add((("n", id(inp._node)) if inp._node is not None else ("l", id(inp)),
                           id(t._node)))
                work.append(inp)
    return nodes, leaves, edges


@pytest.mark.parametrize("name", GRAPHS)
def test_explore_any_graph_against_the_engine(name):
    fn = _graphs()[name]
    mt.manual_seed(7)
    model = nn.Linear(5, 5, bias=False).double()
    x = mt.randn(4, 5, dtype=mt.float64, requires_grad=True)
    # the engine's own gradients, from a plain backward of the same graph
    loss_ref = fn(x, model.weight)
    loss_ref.backward()
    w_grad, x_grad = model.weight.grad.numpy().copy(), (None if x.grad is None
                                                        else x.grad.numpy().copy())
    model.weight.grad, x.grad = None, None

    loss = fn(x, model.weight)
    nodes, leaves, _ = walk(loss)
    ex = mti.explore(loss, model=model, names={"x": x})
    data = ex.data
    assert len(data["nodes"]) == data["meta"]["nodes"] == len(nodes) + len(leaves), name
    assert data["meta"]["ops"] == len(nodes) == len(data["order"])
    np.testing.assert_array_equal(model.weight.grad.numpy(), w_grad)
    (row,) = data["params"]
    assert row["name"] == "weight"
    assert row["grad_norm"] == pytest.approx(norm(w_grad), rel=1e-12)
    if x_grad is not None:
        shown = next(n for n in data["nodes"] if n["label"] == "x")
        assert shown["grad"]["norm"] == pytest.approx(norm(x_grad), rel=1e-12)
    assert data["meta"]["loss"] == pytest.approx(loss_ref.item(), rel=1e-12)
    root = next(n for n in data["nodes"] if n["step"] == 0)
    assert root["grad"]["values"] == [1.0]                  # dL/dL
    assert "<script" in ex.html


def test_intermediate_gradients_through_scalars_and_views():
    """Every op node's gradient shown equals what retain_grad keeps for its output."""
    mt.manual_seed(2)
    w = mt.randn(6, 6, dtype=mt.float64, requires_grad=True)
    a = w[:, 1:4]                              # a view
    b = (a + 1e-3).t()                         # a scalar operand, then a view of it
    c = 1 - b * b                              # one tensor read twice by one op
    d = (2 / (c + 3.0)) @ a                    # read again far below
    loss = d.sum() * 0.5
    kept = [a, b, c, d]
    for t in kept:
        t.retain_grad()
    graph = mti.build_graph(loss, names={"w": w})
    ex = mti.explore(loss, names={"w": w})
    ids = {members[0]: nid for nid, members in graph.origin.items()
           if graph.nodes[nid].kind == "op"}
    for t in kept:
        shown = ex.node(ids[t._node])["grad"]
        assert shown["norm"] == pytest.approx(norm(t.grad), rel=1e-12)
        assert shown["numel"] == t.numel()


# ---- the residual split ---------------------------------------------------------------

class Twice(nn.Module):
    """z = x + f(x) * x: the branch reads the stream a second time."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(5, 5)
        self.g = nn.Linear(5, 5)

    def forward(self, x, shared=False):
        if shared:         # two additions on one stream: each counts the other as branch
            return (x + self.f(x).tanh()) * (x + self.g(x).sigmoid())
        return x + self.f(x).tanh() * x


def _residual_case(shared):
    mt.manual_seed(4)
    model = Twice().double()
    x = mt.randn(3, 5, dtype=mt.float64, requires_grad=True)
    h = x * 1.5                                     # the stream: a node, not a leaf
    r = mt.randn(3, 5, dtype=mt.float64)
    with mti.track_modules(model) as calls:
        out = model(h, shared)
    return model, x, h, r, out, calls


@pytest.mark.parametrize("shared", [False, True], ids=["branch_reads_stream_twice",
                                                        "two_adds_share_a_stream"])
def test_residual_split_against_retained_gradients(shared):
    """skip = dL/dz at each addition z = s + b, branch = dL/ds - dL/dz, with dL/dz and
    dL/ds from retain_grad."""
    model, x, h, r, out, calls = _residual_case(shared)
    loss = (out * r).sum()
    h.retain_grad()
    graph = mti.build_graph(loss, module=model, calls=calls)
    # the additions' outputs: every tensor an AddBackward node produced, reached from loss
    produced, work = {}, [loss]
    while work:
        t = work.pop()
        if t._node is None or t._node in produced:
            continue
        produced[t._node] = t
        work += [i for i in t._node.inputs if i is not None and i._requires_grad]
    zs = [t for node, t in produced.items() if node.name() == "AddBackward"]
    for z in zs:
        z.retain_grad()
    ex = mti.explore(loss, model=model, calls=calls)
    rows = ex.data["residuals"]
    assert len(rows) == (2 if shared else 1)
    ids = {members[0]: nid for nid, members in graph.origin.items()
           if graph.nodes[nid].kind == "op"}
    by_node = {ids[z._node]: z for z in zs}
    splits = set()
    for row in rows:
        z = by_node[row["node"]]
        assert row["stream"] == ids[h._node]
        assert row["skip"] == pytest.approx(norm(z.grad), rel=1e-12)
        assert row["branch"] == pytest.approx(norm(h.grad.numpy() - z.grad.numpy()), rel=1e-12)
        splits.add((row["skip"], row["branch"]))
    assert len(splits) == len(rows)            # shared stream: each addition its own split

    # the recorder's units split the same additions the same way
    model2, x2, h2, r2, _, _ = _residual_case(shared)
    rec = mti.GradientRecorder(model2)
    with rec:
        out2 = model2(h2, shared)
    (out2 * r2).sum().backward()
    units = rec[""].units
    got = [v for u in sorted(units, key=lambda u: u.skip_norm) for v in (u.skip_norm,
                                                                         u.branch_norm)]
    assert got == pytest.approx([v for pair in sorted(splits) for v in pair], rel=1e-12)


def test_gradient_flow_splits_like_explore():
    model, x, h, r, out, calls = _residual_case(False)
    loss = (out * r).sum()
    graph = mti.build_graph(loss, module=model, calls=calls)
    with mti.BackwardTrace(keep_grads=True) as trace:
        loss.backward()
    flow = mti.GradientFlow(graph, trace)
    model2, x2, h2, r2, out2, calls2 = _residual_case(False)
    ex = mti.explore((out2 * r2).sum(), model=model2, calls=calls2)
    (row,) = ex.data["residuals"]
    ((skip, branch, _),) = flow.splits.values()
    assert (skip, branch) == pytest.approx((row["skip"], row["branch"]), rel=1e-12)
