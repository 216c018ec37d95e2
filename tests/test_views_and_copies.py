"""Views and copies exactly as torch's: every registry row says what its result is to its
input's memory (row.aliasing: view, copy, view_or_copy, inplace, none), and this file
calls every row beside torch's same op, writes into the input and through the result,
and compares: memory shared or not, what each write reaches, strides, is_contiguous,
whether .view(-1) is allowed. No tensor a user can get has a negative stride.

A view made here shares its base's version counter (core/versions.pxi): a write through
either is seen by a graph that saved the other (tests/test_write_versions.py)."""
import numpy as np
import pytest

import microtensor as mt

torch = pytest.importorskip("torch")

A = np.linspace(0.1, 0.9, 12).reshape(3, 4)       # distinct, inside every op's domain
B = np.linspace(0.85, 0.15, 12).reshape(3, 4)
V = np.linspace(0.2, 0.6, 4)                       # a vector of A's row length
CUBE = np.linspace(0.1, 0.9, 24).reshape(2, 3, 4)
COUNTS = np.array([0, 2, 1, 2, 4], dtype=np.int64)  # non-negative ints (bincount)


def F(L):
    return L.nn.functional


def T(L, a):
    return L.tensor(np.asarray(a))


def I(L, a):
    return L.tensor(np.asarray(a, dtype=np.int64))


def M(L, a):
    return L.tensor(np.asarray(a, dtype=bool))


MASK = [[True, False, True, False]] * 3

# label -> calls (L is mt or torch; x the input, A unless the entry gives another array).
# A row not named here is called as L.<name>(x), F.<name>(x), L.linalg.<name>(x), or
# x.<name>() for a method-only row.
CALLS = {
    "add": lambda L, x: L.add(x, T(L, B)), "sub": lambda L, x: L.sub(x, T(L, B)),
    "mul": lambda L, x: L.mul(x, T(L, B)), "div": lambda L, x: L.div(x, T(L, B)),
    "pow": lambda L, x: L.pow(x, T(L, B)),
    "floor_divide": lambda L, x: L.floor_divide(x, T(L, B)),
    "remainder": lambda L, x: L.remainder(x, T(L, B)),
    "masked_fill": lambda L, x: L.masked_fill(x, M(L, MASK), 2.0),
    "clamp": lambda L, x: L.clamp(x, 0.2, 0.7), "clip": lambda L, x: L.clip(x, 0.2, 0.7),
    "lt": lambda L, x: L.lt(x, T(L, B)), "le": lambda L, x: L.le(x, T(L, B)),
    "gt": lambda L, x: L.gt(x, T(L, B)), "ge": lambda L, x: L.ge(x, T(L, B)),
    "eq": lambda L, x: L.eq(x, T(L, B)), "ne": lambda L, x: L.ne(x, T(L, B)),
    "logical_and": lambda L, x: L.logical_and(x > 0.3, x < 0.7),
    "logical_or": lambda L, x: L.logical_or(x > 0.7, x < 0.3),
    "logical_xor": lambda L, x: L.logical_xor(x > 0.7, x < 0.3),
    "maximum": lambda L, x: L.maximum(x, T(L, B)), "minimum": lambda L, x: L.minimum(x, T(L, B)),
    "fmax": lambda L, x: L.fmax(x, T(L, B)), "fmin": lambda L, x: L.fmin(x, T(L, B)),
    "logsumexp": lambda L, x: L.logsumexp(x, 1),
    "reshape": [lambda L, x: L.reshape(x, (4, 3)),            # a view of a contiguous input
                lambda L, x: L.reshape(x.t(), (12,))],        # a copy of a transposed one
    "view": lambda L, x: x.view(2, 6),
    "flatten": [lambda L, x: L.flatten(x), lambda L, x: L.flatten(x.t())],
    "unflatten": [lambda L, x: L.unflatten(x, 1, (2, 2)), lambda L, x: x.t().unflatten(0, (2, -1)),
                  lambda L, x: L.unflatten(x[:, 1:3], -1, (1, 2))],
    "unsqueeze": [lambda L, x: L.unsqueeze(x, 1), lambda L, x: L.unsqueeze(x.t(), 2),
                  lambda L, x: L.unsqueeze(x[:, 1:3], 0)],
    "squeeze": [lambda L, x: L.squeeze(x[:1]), lambda L, x: L.squeeze(x.t()[:, :1], 1)],
    "permute": lambda L, x: L.permute(x, (1, 0)),
    "transpose": lambda L, x: L.transpose(x, 0, 1),
    "expand": [lambda L, x: x[:1].expand(3, 4), lambda L, x: x.expand(1, 3, 4),
               lambda L, x: x[:, None].expand(3, 2, 4), lambda L, x: x.expand(2, 1, 3, 4)],
    "contiguous": [lambda L, x: x.contiguous(), lambda L, x: x.t().contiguous()],
    "split": [lambda L, x: L.split(x, 2, 1), lambda L, x: L.split(x, [1, 2])],
    "chunk": lambda L, x: L.chunk(x, 2, 1),
    "cat": lambda L, x: L.cat([x, x]), "stack": lambda L, x: L.stack([x, x], 1),
    "tril": lambda L, x: L.tril(x), "triu": lambda L, x: L.triu(x, 1),
    "getitem": [lambda L, x: x[1:, ::2], lambda L, x: x[1], lambda L, x: x[:, 2],
                lambda L, x: x[..., 1:3], lambda L, x: x[:, None], lambda L, x: x[None, 1],
                lambda L, x: x[1, None], lambda L, x: x[..., None], lambda L, x: x.t()[:, None],
                lambda L, x: x[I(L, [0, 2])], lambda L, x: x[:, I(L, [1, 1, 3])],
                lambda L, x: x[M(L, MASK)], lambda L, x: x[I(L, [2, 0]), None]],
    "index_select": lambda L, x: L.index_select(x, 1, I(L, [0, 3])),
    "view_as": lambda L, x: x.view_as(L.zeros(2, 6)),
    "reshape_as": [lambda L, x: x.reshape_as(L.zeros(2, 6)),
                   lambda L, x: x.t().reshape_as(L.zeros(12))],
    "expand_as": lambda L, x: x[:1].expand_as(x),
    "matmul": lambda L, x: L.matmul(x, T(L, B).t()),
    "eye": lambda L, x: L.eye(3), "logspace": lambda L, x: L.logspace(0, 1, 5),
    "randint_like": lambda L, x: L.randint_like(x, 5),
    "tril_indices": lambda L, x: L.tril_indices(3, 4),
    "triu_indices": lambda L, x: L.triu_indices(3, 4),
    "as_tensor": [lambda L, x: L.as_tensor(x), lambda L, x: L.as_tensor(x, dtype=L.float32)],
    "broadcast_to": lambda L, x: L.broadcast_to(x, (2, 3, 4)),
    "broadcast_tensors": lambda L, x: L.broadcast_tensors(x, x[0]),
    "meshgrid": lambda L, x: L.meshgrid(x[0], x[1], indexing="ij"),
    "atleast_1d": [lambda L, x: L.atleast_1d(x), lambda L, x: L.atleast_1d(x[0, 0])],
    "atleast_2d": [lambda L, x: L.atleast_2d(x), lambda L, x: L.atleast_2d(x[0])],
    "hstack": lambda L, x: L.hstack([x, x]), "vstack": lambda L, x: L.vstack([x, x]),
    "column_stack": lambda L, x: L.column_stack([x, x]),
    "broadcast_shapes": lambda L, x: L.broadcast_shapes((3, 1), (1, 4)),
    "new_zeros": lambda L, x: x.new_zeros(2, 3), "new_ones": lambda L, x: x.new_ones(2, 3),
    "new_empty": lambda L, x: x.new_empty(2, 3), "new_full": lambda L, x: x.new_full((2, 3), 7.0),
    "new_tensor": lambda L, x: x.new_tensor([1.0, 2.0]),
    "type_as": [lambda L, x: x.type_as(T(L, B)), lambda L, x: x.type_as(I(L, [1]))],
    "half": lambda L, x: x.half(),
    "softmax": lambda L, x: L.softmax(x, 1), "log_softmax": lambda L, x: L.log_softmax(x, 0),
    "F.softmin": lambda L, x: F(L).softmin(x, 1),
    "F.layer_norm": lambda L, x: F(L).layer_norm(x, (4,)),
    "F.rms_norm": lambda L, x: F(L).rms_norm(x, (4,)),
    "F.cross_entropy": lambda L, x: F(L).cross_entropy(x, I(L, [0, 3, 1])),
    "F.nll_loss": lambda L, x: F(L).nll_loss(x, I(L, [0, 3, 1])),
    "F.mse_loss": lambda L, x: F(L).mse_loss(x, T(L, B)),
    "F.scaled_dot_product_attention": lambda L, x: F(L).scaled_dot_product_attention(x, x, x),
    "clamp_min": lambda L, x: L.clamp_min(x, 0.3), "clamp_max": lambda L, x: L.clamp_max(x, 0.3),
    "float_power": lambda L, x: L.float_power(x, 2.0),
    "xlogy": lambda L, x: L.xlogy(x, T(L, B)), "lerp": lambda L, x: L.lerp(x, T(L, B), 0.3),
    "atan2": lambda L, x: L.atan2(x, T(L, B)), "arctan2": lambda L, x: L.arctan2(x, T(L, B)),
    "fmod": lambda L, x: L.fmod(x, 0.3),
    "addmm": lambda L, x: L.addmm(T(L, np.ones((3, 3))), x, T(L, B).t()),
    "cumsum": lambda L, x: L.cumsum(x, 1), "cumprod": lambda L, x: L.cumprod(x, 0),
    "logcumsumexp": lambda L, x: L.logcumsumexp(x, 1),
    "cummax": lambda L, x: L.cummax(x, 1), "cummin": lambda L, x: L.cummin(x, 0),
    "mm": lambda L, x: L.mm(x, T(L, B).t()),
    "bmm": (lambda L, x: L.bmm(x, x.transpose(1, 2)), CUBE),
    "mv": lambda L, x: L.mv(x, T(L, V)), "dot": lambda L, x: L.dot(x[0], T(L, V)),
    "vdot": lambda L, x: L.vdot(x[0], T(L, V)), "inner": lambda L, x: L.inner(x, T(L, B)),
    "outer": lambda L, x: L.outer(x[0], T(L, V)), "ger": lambda L, x: L.ger(x[0], T(L, V)),
    "baddbmm": (lambda L, x: L.baddbmm(L.ones(2, 3, 3, dtype=x.dtype), x, x.transpose(1, 2)),
                CUBE),
    "kron": lambda L, x: L.kron(x, x[:2, :2]),
    "einsum": [lambda L, x: L.einsum("ij,kj->ik", x, T(L, B)),
               lambda L, x: L.einsum("ij->ji", x)],
    "tensordot": lambda L, x: L.tensordot(x, T(L, B), dims=([1], [1])),
    "dist": lambda L, x: L.dist(x, T(L, B)), "cdist": lambda L, x: L.cdist(x, T(L, B)),
    "cross": lambda L, x: L.cross(x[:, :3], T(L, B)[:, :3], dim=1),
    "F.batch_norm": lambda L, x: F(L).batch_norm(x, L.zeros(4, dtype=x.dtype),
                                                   L.ones(4, dtype=x.dtype)),
    "F.binary_cross_entropy": lambda L, x: F(L).binary_cross_entropy(x, T(L, B)),
    "F.binary_cross_entropy_with_logits":
        lambda L, x: F(L).binary_cross_entropy_with_logits(x, T(L, B)),
    "F.cosine_similarity": lambda L, x: F(L).cosine_similarity(x, T(L, B)),
    "F.huber_loss": lambda L, x: F(L).huber_loss(x, T(L, B)),
    "F.kl_div": lambda L, x: F(L).kl_div(x, T(L, B), reduction="batchmean"),
    "F.l1_loss": lambda L, x: F(L).l1_loss(x, T(L, B)),
    "F.pairwise_distance": lambda L, x: F(L).pairwise_distance(x, T(L, B)),
    "F.smooth_l1_loss": lambda L, x: F(L).smooth_l1_loss(x, T(L, B)),
    "F.one_hot": (lambda L, x: F(L).one_hot(x, 5), COUNTS),
    "F.pad": lambda L, x: F(L).pad(x, (1, 1)),
    "F.linear": lambda L, x: F(L).linear(x, T(L, B)),
    "F.embedding": lambda L, x: F(L).embedding(I(L, [2, 0]), x),
    "F.dropout": [lambda L, x: F(L).dropout(x, 0.5), lambda L, x: F(L).dropout(x, 0.5, training=False),
                  lambda L, x: F(L).dropout(x, 0.0)],
    "isclose": lambda L, x: L.isclose(x, T(L, B)),
    "bincount": (lambda L, x: L.bincount(x), COUNTS),
    "allclose": lambda L, x: L.allclose(x, T(L, B)), "equal": lambda L, x: L.equal(x, T(L, B)),
    "is_nonzero": lambda L, x: L.is_nonzero(x[:1, :1]),
    "gather": lambda L, x: L.gather(x, 1, I(L, [[0, 1], [2, 3], [1, 1]])),
    "take_along_dim": lambda L, x: L.take_along_dim(x, I(L, [[0], [2], [1]]), 1),
    "take": lambda L, x: L.take(x, I(L, [0, 5, 11])),
    "scatter": lambda L, x: L.scatter(x, 1, I(L, [[0], [2], [1]]), T(L, B)),
    "scatter_add": lambda L, x: L.scatter_add(x, 1, I(L, [[0], [2], [1]]), T(L, B)),
    "index_add": lambda L, x: L.index_add(x, 0, I(L, [2, 0]), T(L, B[:2])),
    "index_fill": lambda L, x: L.index_fill(x, 1, I(L, [0, 2]), 5.0),
    "masked_select": lambda L, x: L.masked_select(x, M(L, MASK)),
    "topk": lambda L, x: L.topk(x, 2), "kthvalue": lambda L, x: L.kthvalue(x, 2),
    "sort": lambda L, x: L.sort(x, 1, descending=True),
    "diagonal": [lambda L, x: L.diagonal(x), lambda L, x: L.diagonal(x, 1),
                 lambda L, x: L.diagonal(x, -1), lambda L, x: L.diagonal(x, 0, 1, 0),
                 lambda L, x: L.diagonal(x, 7),
                 (lambda L, x: L.diagonal(x, 1, 2, 0), CUBE),
                 (lambda L, x: L.diagonal(x, 0, -1, -2), CUBE)],
    "diag": [lambda L, x: L.diag(x), lambda L, x: L.diag(x[0], 1)],
    "flip": [lambda L, x: L.flip(x, [0]), lambda L, x: L.flip(x, [0, 1]),
             lambda L, x: L.flip(x, []), lambda L, x: L.flip(x[:1], [0]),
             lambda L, x: L.flip(x.t(), [0])],
    "fliplr": lambda L, x: L.fliplr(x), "flipud": lambda L, x: L.flipud(x),
    "rot90": [lambda L, x: L.rot90(x, k, (0, 1)) for k in range(4)] + [
        lambda L, x: L.rot90(x.t(), 1, (0, 1))],
    "roll": [lambda L, x: L.roll(x, 0, 0), lambda L, x: L.roll(x, 1, 1),
             lambda L, x: L.roll(x, 0), lambda L, x: L.roll(x.t(), 0, 0),
             lambda L, x: L.roll(x, (4, 3), (1, 0))],
    "tile": [lambda L, x: L.tile(x, (1, 1)), lambda L, x: L.tile(x, (2, 1)),
             lambda L, x: L.tile(x.t(), (1,))],
    "repeat": [lambda L, x: x.repeat(1, 1), lambda L, x: x.repeat(2, 1, 1),
               lambda L, x: x.t().repeat(1, 1)],
    "repeat_interleave": [lambda L, x: L.repeat_interleave(x, 2, 0),
                          (lambda L, x: L.repeat_interleave(x), COUNTS)],
    "tensor_split": lambda L, x: L.tensor_split(x, 3, 1),
    "narrow": lambda L, x: L.narrow(x, 1, 1, 2), "select": lambda L, x: L.select(x, 1, 2),
    "unbind": lambda L, x: L.unbind(x, 1),
    "movedim": (lambda L, x: L.movedim(x, 0, 2), CUBE),
    "moveaxis": (lambda L, x: L.moveaxis(x, (0, 1), (2, 0)), CUBE),
    "swapaxes": lambda L, x: L.swapaxes(x, 0, 1), "swapdims": lambda L, x: L.swapdims(x, 1, 0),
    "t": [lambda L, x: L.t(x), lambda L, x: L.t(x[0])],
    "masked_fill_": lambda L, x: x.masked_fill_(M(L, MASK), 2.0),
    "scatter_": lambda L, x: x.scatter_(1, I(L, [[0], [2], [1]]), T(L, B)),
    "scatter_add_": lambda L, x: x.scatter_add_(1, I(L, [[0], [2], [1]]), T(L, B)),
    "index_fill_": lambda L, x: x.index_fill_(1, I(L, [0, 2]), 5.0),
    "index_add_": lambda L, x: x.index_add_(0, I(L, [2, 0]), T(L, B[:2])),
    "pow_": lambda L, x: x.pow_(2), "clamp_min_": lambda L, x: x.clamp_min_(0.3),
    "clamp_max_": lambda L, x: x.clamp_max_(0.3), "cumsum_": lambda L, x: x.cumsum_(1),
    "lerp_": lambda L, x: x.lerp_(T(L, B), 0.3),
    "fill_diagonal_": lambda L, x: x.fill_diagonal_(5.0),
    "apply_": lambda L, x: x.apply_(lambda v: 2 * v),
    "stride": lambda L, x: x.stride(), "data_ptr": lambda L, x: x.data_ptr(),
    "is_contiguous": lambda L, x: x.is_contiguous(),
    "F.gumbel_softmax": lambda L, x: F(L).gumbel_softmax(x, tau=1.0),
}

# Rows with no torch function of that name and signature: checked against the row's
# own word only (memory shared or not, no negative stride).
NO_TORCH = {
    "F.rotary_embedding": "torch has no rotary embedding function (torchtune's is a module)",
}
ROTARY = lambda L, x: F(L).rotary_embedding(x, L.ones(3, 4, dtype=x.dtype),  # noqa: E731
                                            L.zeros(3, 4, dtype=x.dtype))
CALLS["F.rotary_embedding"] = ROTARY


def _default(row):
    if row.scope == "F":
        return lambda L, x: getattr(F(L), row.name)(x)
    if row.scope == "linalg":
        return lambda L, x: getattr(L.linalg, row.name)(x)
    if row.export:
        return lambda L, x: getattr(L, row.name)(x)
    return lambda L, x: getattr(x, row.name)()


def cases():
    out = []
    for row in mt.ops.registry():
        calls = CALLS.get(row.label, _default(row))
        calls = calls if isinstance(calls, list) else [calls]
        for i, call in enumerate(calls):
            fn, array = call if isinstance(call, tuple) else (call, A)
            out.append(pytest.param(row, fn, array, id=f"{row.label}-{i}"))
    return out


def _tensors(result):
    """The tensors an op returned (one, or a tuple/list of them, a (values, indices))."""
    if isinstance(result, (tuple, list)) and not isinstance(result, torch.Size):
        return [r for r in result if isinstance(r, (mt.Tensor, torch.Tensor))]
    return [result] if isinstance(result, (mt.Tensor, torch.Tensor)) else []


def _shares(out, x):
    if isinstance(out, mt.Tensor):
        return out.numel() > 0 and np.shares_memory(out.numpy(), x.numpy())
    return out.numel() > 0 and \
        out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _bump(t):
    """A write into t that changes every element (or an exception, for a tensor that
    cannot be written: an expanded one)."""
    if t.dtype in (mt.bool, torch.bool):
        t.copy_(~t)
    else:
        t.add_(1)


def _view_allowed(t):
    try:
        t.view(-1)
        return True
    except RuntimeError:
        return False


def _run(L, fn, array):
    x = L.tensor(array.copy())
    with (mt.no_grad() if L is mt else torch.no_grad()):
        result = fn(L, x)
    return x, result


def _write_and_compare(x, outs, L):
    """Write into x, then through each output: which outputs changed, which writes raised,
    and whether x changed (all as tuples of bools, to compare across the libraries)."""
    before = [o.detach().clone() for o in outs]
    with (mt.no_grad() if L is mt else torch.no_grad()):
        _bump(x)
    seen = tuple(not bool((o == b).all()) for o, b in zip(outs, before))
    raised, reached = [], []
    for o in outs:
        base = x.detach().clone()
        try:
            with (mt.no_grad() if L is mt else torch.no_grad()):
                _bump(o)
            raised.append(False)
        except (RuntimeError, ValueError):
            raised.append(True)
        reached.append(not bool((x == base).all()))
    return seen, tuple(raised), tuple(reached)


@pytest.mark.parametrize("row, fn, array", cases())
def test_a_rows_result_shares_memory_exactly_as_torch(row, fn, array):
    mt.manual_seed(0)
    x, result = _run(mt, fn, array)
    outs = _tensors(result)
    if row.aliasing == "none":
        assert not outs, f"{row.label} is said to return no tensor, but returned {result!r}"
        return
    assert outs, f"{row.label} returned no tensor: {result!r}"
    for o in outs:
        assert min(o.stride(), default=0) >= 0 and min(o.numpy().strides, default=0) >= 0, \
            f"{row.label}: a negative stride leaves the engine: {o.stride()}"
    shared = [_shares(o, x) for o in outs]
    if row.aliasing == "view":
        assert all(s or o.numel() == 0 for s, o in zip(shared, outs)), \
            f"{row.label} is a view, but its result is a copy"
    elif row.aliasing == "copy":
        assert not any(shared), f"{row.label} is a copy, but its result shares the input"
    elif row.aliasing == "inplace":
        assert result is x, f"{row.label} works in place, but returned another tensor"
    if row.label in NO_TORCH:
        return
    tx, tresult = _run(torch, fn, array)
    touts = _tensors(tresult)
    assert len(touts) == len(outs)
    assert [_shares(o, tx) for o in touts] == shared, f"{row.label}: memory shared {shared}"
    for o, t in zip(outs, touts):
        assert tuple(o.shape) == tuple(t.shape)
        if row.kind != "random" and o.numel() > 0:
            assert o.stride() == t.stride(), f"{row.label}: strides {o.stride()} vs {t.stride()}"
        assert o.is_contiguous() == t.is_contiguous(), f"{row.label}: is_contiguous"
        assert _view_allowed(o) == _view_allowed(t), f"{row.label}: view(-1) allowed"
    ours = _write_and_compare(x, outs, mt)
    theirs = _write_and_compare(tx, touts, torch)
    assert ours[0] == theirs[0], f"{row.label}: a write into the input reaches {ours[0]}"
    assert ours[1] == theirs[1], f"{row.label}: a write through the result raises {ours[1]}"
    assert ours[2] == theirs[2], f"{row.label}: a write through the result reaches {ours[2]}"


def test_every_row_says_view_or_copy():
    rows = mt.ops.registry()
    assert all(row.aliasing in mt.ops.ALIASINGS for row in rows)
    by = {a: {row.label for row in mt.ops.registry(aliasing=a)} for a in mt.ops.ALIASINGS}
    assert sum(len(v) for v in by.values()) == len(rows)
    for name in ("view", "transpose", "permute", "expand", "narrow", "select", "unsqueeze",
                 "squeeze", "diagonal", "split", "chunk", "unbind", "t", "movedim"):
        assert name in by["view"], name
    for name in ("flip", "fliplr", "flipud", "rot90", "roll", "repeat", "tile", "diag",
                 "cat", "exp", "index_select"):
        assert name in by["copy"], name
    assert {"reshape", "getitem", "contiguous", "flatten"} <= by["view_or_copy"]
    assert {"exp_", "masked_fill_", "bernoulli_"} <= by["inplace"]
    assert {"is_contiguous", "stride", "allclose"} <= by["none"]
    for label in NO_TORCH:
        assert label in {row.label for row in rows}, f"NO_TORCH names no row: {label}"
    stale = set(CALLS) - {row.label for row in rows}
    assert not stale, f"CALLS names no row: {sorted(stale)}"


def test_register_op_checks_aliasing():
    with pytest.raises(ValueError, match="aliasing must be one of"):
        mt.register_op("views_test_refused", lambda t: t, kind="shape", aliasing="alias")
    assert "views_test_refused" not in {row.label for row in mt.ops.registry()}
    with pytest.raises(ValueError, match="aliasing must be one of"):
        mt.ops.registry(aliasing="alias")


# ---- views outside the registry: attributes and operators -----------------------------

EXTRA_VIEWS = {
    "T": lambda L, x: x.T, "mT": lambda L, x: x.mT,
    "t()[1:]": lambda L, x: x.t()[1:], "unsqueeze(-1)": lambda L, x: x.unsqueeze(-1),
    "[None, None]": lambda L, x: x[None, None], "[..., None, 1]": lambda L, x: x[..., None, 1],
    "[None, :, None]": lambda L, x: x[None, :, None],
    "detach": lambda L, x: x.detach(), "expand 0-d": lambda L, x: x[0, 0].expand(3, 1),
    "diagonal of t()": lambda L, x: x.t().diagonal(),
    "unflatten-like view": lambda L, x: x.view(3, 2, 2),
}


@pytest.mark.parametrize("name", sorted(EXTRA_VIEWS))
def test_views_outside_the_registry_are_torchs(name):
    fn = EXTRA_VIEWS[name]
    x, out = _run(mt, fn, A)
    tx, tout = _run(torch, fn, A)
    assert _shares(out, x) and _shares(tout, tx)
    assert out.stride() == tout.stride(), (out.stride(), tout.stride())
    assert out.is_contiguous() == tout.is_contiguous()
    assert _write_and_compare(x, [out], mt) == _write_and_compare(tx, [tout], torch)


# ---- negative strides: never in a tensor ----------------------------------------------

def test_a_negative_step_gives_a_copy_and_from_numpy_refuses_negative_strides():
    x = mt.tensor(A.copy())
    y = x[::-1, 1::-1]
    assert y.stride() == (2, 1) and not np.shares_memory(y.numpy(), x.numpy())
    np.testing.assert_array_equal(y.numpy(), A[::-1, 1::-1])
    with pytest.raises(ValueError, match="negative"):
        mt.from_numpy(A[::-1])
    with pytest.raises(ValueError, match="negative"):
        mt.as_tensor(A[:, ::-2])
    assert mt.tensor(A[::-1]).stride() == (4, 1)          # mt.tensor copies


def test_a_negative_step_keeps_its_gradient():
    x = mt.tensor(A.copy(), requires_grad=True)
    g = np.random.default_rng(0).standard_normal((3, 2))
    x[::-1, ::-2].backward(mt.tensor(g))
    tx = torch.tensor(A.copy(), requires_grad=True)
    tx.flip(0, 1)[:, ::2].backward(torch.tensor(g))
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy())
    assert min(x.grad.stride()) >= 0


# ---- the changed ops: gradients, against torch and by finite differences -------------

GRADS = {
    "flip": lambda L, x: L.flip(x, [0, 2]), "fliplr": lambda L, x: L.fliplr(x),
    "flipud": lambda L, x: L.flipud(x),
    "rot90_0": lambda L, x: L.rot90(x, 0, (0, 1)), "rot90_1": lambda L, x: L.rot90(x, 1, (1, 2)),
    "rot90_2": lambda L, x: L.rot90(x, 2, (0, 2)), "rot90_3": lambda L, x: L.rot90(x, 3, (0, 1)),
    "roll_0": lambda L, x: L.roll(x, 0, 1), "roll": lambda L, x: L.roll(x, (1, -2), (0, 2)),
    "repeat_1": lambda L, x: x.repeat(1, 1, 1), "repeat": lambda L, x: x.repeat(2, 1, 3),
    "tile_1": lambda L, x: L.tile(x, (1,)), "tile": lambda L, x: L.tile(x, (2, 1, 1, 2)),
    "diagonal": lambda L, x: L.diagonal(x), "diagonal_1_2_0": lambda L, x: L.diagonal(x, 1, 2, 0),
    "diagonal_-1_-1_1": lambda L, x: L.diagonal(x, -1, -1, 1),
    "diag": lambda L, x: L.diag(x[0], 1), "trace": lambda L, x: L.trace(x[1]),
    "unsqueeze": lambda L, x: x.transpose(0, 2).unsqueeze(3),
    "None": lambda L, x: x[None, 1, :, None],
    "expand": lambda L, x: x[:, :1].expand(1, 2, 4, 4),
}


@pytest.mark.parametrize("name", sorted(GRADS))
def test_changed_ops_keep_their_gradients(name):
    fn = GRADS[name]
    rng = np.random.default_rng(5)
    a = rng.standard_normal((2, 3, 4))
    x = mt.tensor(a, requires_grad=True)
    out = fn(mt, x)
    g = rng.standard_normal(tuple(out.shape))
    out.backward(mt.tensor(g))
    tx = torch.tensor(a, requires_grad=True)
    fn(torch, tx).backward(torch.tensor(g))
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert min(x.grad.stride()) >= 0
    assert mt.gradcheck(lambda t: fn(mt, t), [mt.tensor(a, requires_grad=True)])
    assert mt.gradgradcheck(lambda t: fn(mt, t), [mt.tensor(a, requires_grad=True)])


# ---- diagonal: a view that writes through, with versions ---------------------------------

def test_a_write_through_the_diagonal_reaches_its_base_and_back():
    x = mt.zeros(3, 4)
    d = x.diagonal(1)
    d.fill_(2.0)
    np.testing.assert_array_equal(x.numpy(), np.eye(3, 4, 1) * 2)
    x[0, 1] = 5.0
    assert d[0].item() == 5.0
    d += 1                                          # an in-place operator on the view
    assert x[1, 2].item() == 3.0


def test_a_write_through_the_diagonal_is_seen_by_a_graph_that_saved_its_base():
    w = mt.tensor(A.copy(), requires_grad=True)
    y = w * 1.0                                    # a non-leaf, written through its diagonal
    loss = (y * y).sum()                           # saves y
    with mt.no_grad():
        y.diagonal().add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    z = w * 1.0
    loss = (z.diagonal() * z.diagonal()).sum()    # saves the diagonal view
    with mt.no_grad():
        z.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
