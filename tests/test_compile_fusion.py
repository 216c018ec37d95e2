"""mt.compile's rewrites (microtensor/capture/fuse.py, capture/rewrites.py) give eager's numbers,
bit for bit.

A differential fuzzer draws attention programs in the ways models write them (the heads
of one projection split by `split`, `chunk`, slicing or `unbind` of a 5-D permute; each
head arranged by view + transpose or reshape + permute; the output put back by
transpose + contiguous + view, by reshape, or left as it is), at sizes that divide
nothing, at 1 and 3 threads, with and without dropout and is_causal, and with the
things that must stop a rewrite: a view read outside the group, a hook on one, q and k
the same view, a mask, a source handed in with other strides. Each program runs eagerly
and compiled on the same seed; every result and gradient must be equal bit for bit, and
the rewrite must fire exactly where its group is closed.

    pytest tests/test_compile_fusion.py                                     # CI: 240 programs
    MT_FUZZ_FUSION_PROGRAMS=3000 pytest -m slow tests/test_compile_fusion.py   # long run
"""
import os
import warnings

import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F
from microtensor.capture import fuse as _fuse
from microtensor.ops.attention import attention_on_views

CI_PROGRAMS = 240
LONG_PROGRAMS = int(os.environ.get("MT_FUZZ_FUSION_PROGRAMS", "3000"))
CALLS = 4
SPLITS = ["split", "chunk", "slice", "unbind"]
HEADS = ["view_transpose", "reshape_permute"]
OUTS = ["transpose_contiguous_view", "transpose_reshape", "none"]
# what stops the rewrite: a view read outside the group, a hook on it, q and k one view,
# a mask, and (no stop) a source handed in whose strides change at the later calls
BREAKERS = [None, None, None, "return_q", "retain_grad", "same_qk", "mask", "strided_input"]
STOPS = {"return_q", "retain_grad", "same_qk", "mask"}


def draw(seed):
    rng = np.random.default_rng(seed)
    return dict(
        B=int(rng.integers(1, 4)), T=int(rng.choice([1, 3, 5, 7, 17, 33])),
        nh=int(rng.integers(1, 4)), hs=int(rng.choice([1, 2, 4, 5, 8])),
        dtype=[np.float32, np.float64][int(rng.integers(2))],
        split=SPLITS[rng.integers(len(SPLITS))], heads=HEADS[rng.integers(len(HEADS))],
        out=OUTS[rng.integers(len(OUTS))], breaker=BREAKERS[rng.integers(len(BREAKERS))],
        causal=bool(rng.integers(2)), dropout=float(rng.choice([0.0, 0.0, 0.25])),
        scale=[None, 0.3][int(rng.integers(2))], projection=bool(rng.integers(3)),
        threads=int(rng.choice([1, 3])), drop_after=float(rng.choice([0.0, 0.0, 0.3])),
        seed=int(rng.integers(2**31)), grad=bool(rng.integers(5)))


def build(p):
    """The program as a function of (x, W, u): loss and what the breaker returns."""
    B, T, nh, hs = p["B"], p["T"], p["nh"], p["hs"]
    C = nh * hs
    mask = mt.tensor(np.tril(np.ones((T, T), bool))) if p["breaker"] == "mask" else None

    def heads(t):                                   # (B, T, C) -> (B, nh, T, hs)
        if p["heads"] == "view_transpose":
            return t.view(B, T, nh, hs).transpose(1, 2)
        return t.reshape(B, T, nh, hs).permute(0, 2, 1, 3)

    def fn(x, W, u):
        if not p["grad"]:                           # inference: no graph, no backward
            with mt.no_grad():
                return attend(x, W, u)
        loss, y, extra = attend(x, W, u)
        loss.backward()
        return loss, y, extra

    def attend(x, W, u):
        qkv = F.linear(x, W) if p["projection"] else x
        if p["split"] == "split":
            q, k, v = (heads(t) for t in qkv.split(C, dim=2))
        elif p["split"] == "chunk":
            q, k, v = (heads(t) for t in qkv.chunk(3, dim=-1))
        elif p["split"] == "slice":
            q, k, v = (heads(qkv[:, :, i * C:(i + 1) * C]) for i in range(3))
        else:
            q, k, v = qkv.view(B, T, 3, nh, hs).permute(2, 0, 3, 1, 4).unbind(0)
        extra = None
        if p["breaker"] == "return_q":
            extra = q * 1.0
        elif p["breaker"] == "retain_grad" and p["grad"]:
            q.retain_grad()
        elif p["breaker"] == "same_qk":
            q = k
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p["dropout"],
                                           is_causal=p["causal"] and mask is None,
                                           scale=p["scale"])
        if p["out"] == "transpose_contiguous_view":
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        elif p["out"] == "transpose_reshape":
            y = y.transpose(1, 2).reshape(B, T, C)
        y = F.dropout(y, p["drop_after"], training=True)   # p = 0: the rewrite drops it
        return (y * u).sum(), y, extra
    return fn


def inputs(p, call, rng_seed):
    """x, W, u of one call (calls 0 and 1 the same); x is (B, T, 3C), or (B, T, C') fed
    to a projection; with "strided_input" the later calls get x with other strides."""
    B, T, C = p["B"], p["T"], p["nh"] * p["hs"]
    rng = np.random.default_rng(rng_seed + max(call, 1))
    width = 5 if p["projection"] else 3 * C
    xa = rng.standard_normal((B, T, width)).astype(p["dtype"])
    if p["breaker"] == "strided_input" and call >= 2:
        xa = np.ascontiguousarray(xa.transpose(1, 0, 2)).transpose(1, 0, 2)   # same values
    x = mt.from_numpy(xa).requires_grad_()
    W = mt.from_numpy(rng.standard_normal((3 * C, 5)).astype(p["dtype"])).requires_grad_()
    u = mt.from_numpy(rng.standard_normal((B, T, C) if p["out"] != "none"
                                          else (B, p["nh"], T, p["hs"])).astype(p["dtype"]))
    return x, W, u


def run(p, compiled):
    fn = build(p)
    if compiled:
        fn = mt.compile(fn)
    before = mt.get_num_threads()
    mt.set_num_threads(p["threads"])
    mt.manual_seed(p["seed"])
    outs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for call in range(CALLS):
                x, W, u = inputs(p, call, p["seed"])
                loss, y, extra = fn(x, W, u)
                grads = ([x.grad.numpy()] + ([W.grad.numpy()] if p["projection"] else [])
                         if p["grad"] else [])
                outs.append([loss.numpy(), y.numpy()] + ([] if extra is None else [extra.numpy()])
                            + grads)
    finally:
        mt.set_num_threads(before)
    return outs, fn


def check(seed):
    p = draw(seed)
    eager, _ = run(p, False)
    compiled, fn = run(p, True)
    for call, (a, b) in enumerate(zip(eager, compiled)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(x, y, equal_nan=True), (
                f"program {seed} {p}: call {call}, result {i} differs from eager "
                f"(max {np.nanmax(np.abs(x - y))})")
    assert fn.calls["replayed"] == CALLS - 2, (p, fn.eager_reasons)
    fused = [rec for rec in fn.plan.records if rec.fused and "attention" in rec.label]
    stopped = p["breaker"] in STOPS and not (p["breaker"] == "retain_grad" and not p["grad"])
    assert bool(fused) == (not stopped), (seed, p, str(fn.plan))
    if fused:       # an argument with other strides: the calls one by one, and the plan says so
        moved = (p["breaker"] == "strided_input" and not p["projection"]
                 and inputs(p, 2, 0)[0]._data.strides != inputs(p, 0, 0)[0]._data.strides)
        assert fused[0].fn.fallbacks == (CALLS - 2 if moved else 0)
        assert ("ran them one by one in 2 replays" in str(fn.plan)) == moved
    dropouts = [rec for rec in fn.plan.records if rec.fn is F.dropout]
    assert len(dropouts) == (p["drop_after"] > 0)          # dropped where it changes nothing


@pytest.mark.parametrize("block", range(4))
def test_fusion_fuzz_ci(block):
    for seed in range(block * CI_PROGRAMS // 4, (block + 1) * CI_PROGRAMS // 4):
        check(seed)


@pytest.mark.slow
def test_fusion_fuzz_long():
    for seed in range(CI_PROGRAMS, CI_PROGRAMS + LONG_PROGRAMS):
        check(seed)


# ---- the GPT's step, as the main job runs it ------------------------------------------------

def _gpt_step(compiled, threads, steps=4):
    from models.gpt import GPT
    from models.config import GPTConfig
    before = mt.get_num_threads()
    mt.set_num_threads(threads)
    try:
        mt.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=23, block_size=9, n_layer=2, n_head=3, n_embd=15))
        opt = mt.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            mt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss
        run_step = mt.compile(step) if compiled else step
        rng = np.random.default_rng(1)
        losses = []
        for _ in range(steps):
            x = mt.tensor(rng.integers(0, 23, (3, 9)))
            y = mt.tensor(rng.integers(0, 23, (3, 9)))
            losses.append(run_step(x, y).item())
        return losses, [p.numpy().copy() for p in model.parameters()], run_step
    finally:
        mt.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_gpt_step_fused_is_eager_bit_for_bit(threads):
    eager, eager_params, _ = _gpt_step(False, threads)
    fused, fused_params, step = _gpt_step(True, threads)
    assert eager == fused
    assert all(np.array_equal(a, b) for a, b in zip(eager_params, fused_params))
    groups = [rec for rec in step.plan.records if rec.fused]
    assert len(groups) == 2, str(step.plan)                 # one per attention layer
    text = str(step.plan)
    assert "fuses 11 calls" in text and "dropped 5 calls that change nothing: F.dropout x5" in text
    # the backward call lists the rules a replay runs: one per attention, no head split
    backward = text[text.index("t.backward"):]
    assert "ViewsAttentionBackward x2" in backward and "PermuteBackward" not in backward
    assert "as recorded" not in backward


def test_fuse_false_replays_the_calls_as_recorded():
    x = mt.randn(2, 5, 12, requires_grad=True)

    def f(x):
        q, k, v = x.split(4, dim=2)
        return F.scaled_dot_product_attention(q.view(2, 5, 2, 2).transpose(1, 2),
                                              k.view(2, 5, 2, 2).transpose(1, 2),
                                              v.view(2, 5, 2, 2).transpose(1, 2)).sum()
    plain, fused = mt.compile(f, fuse=False), mt.compile(f)
    for _ in range(3):
        assert plain(x).item() == fused(x).item() == f(x).item()
    assert not plain.plan.fused and len(fused.plan.fused) == 1
    assert len(plain.plan) > len(fused.plan)


# ---- the fused op on its own ---------------------------------------------------------------

def _views_of(x, B, T, nh, hs):
    C = nh * hs
    item = x.numpy().itemsize
    shape, strides = (B, nh, T, hs), (T * 3 * C * item, hs * item, 3 * C * item, item)
    return tuple((i * C, shape, strides) for i in range(3))


def test_attention_on_views_refuses_views_outside_its_input():
    x = mt.randn(2, 3, 12)
    views = list(_views_of(x, 2, 3, 2, 2))
    views[2] = (views[2][0] + 5, views[2][1], views[2][2])       # runs past the end
    with pytest.raises(ValueError):
        attention_on_views(x, tuple(views), None)
    with pytest.raises(ValueError, match="C-contiguous"):
        attention_on_views(x.transpose(0, 1), _views_of(x, 2, 3, 2, 2), None)
    with pytest.raises(mt.ShapeError, match="not q, k and v"):
        bad = list(_views_of(x, 2, 3, 2, 2))
        bad[1] = (bad[1][0], (2, 2, 2, 2), bad[1][2])
        attention_on_views(x, tuple(bad), None)


@pytest.mark.parametrize("field", range(5))
def test_attention_on_views_refuses_hostile_views_one_field_at_a_time(field):
    """A view spec built by hand, wrong in one field: an exception, never a crash."""
    x = mt.randn(2, 3, 12, requires_grad=True)
    good = list(_views_of(x, 2, 3, 2, 2))
    offset, shape, strides = good[field % 3]
    bad = [(-4, shape, strides),                          # before the start
           (offset, shape, (144, 8, 48, 2)),              # a last dim not whole elements
           (offset, (2, 2, 3, 2.5), strides),             # a shape that is not ints
           (offset, shape, (144, 8, -48, 4)),             # rows running backwards
           (offset, shape[:3], strides[:3])][field]       # a dim short of q, k, v
    views = good[:field % 3] + [bad] + good[field % 3 + 1:]
    with pytest.raises((ValueError, TypeError, mt.ShapeError), match="attention_on_views"):
        y = attention_on_views(x, tuple(views), None, is_causal=True)
        y.sum().backward()


def test_the_rewrite_leaves_overlapping_views_alone():
    x = mt.randn(2, 3, 12).numpy()
    views = [(0, (2, 2, 3, 2), (144, 8, 48, 4))] * 2 + [(8, (2, 2, 3, 2), (144, 8, 48, 4))]
    assert _fuse.overlap(views, x)                                   # two views, one place
    assert not _fuse.overlap(_views_of(mt.tensor(x), 2, 3, 2, 2), x)
    # within one view: a broadcast dim (stride 0), rows closer than their length, a stride
    # that is not whole elements
    for strides in [(0, 48, 4), (144, 4, 4), (144, 48, 6)]:
        assert _fuse.overlap([(0, (2, 3, 2), strides)], x), strides
    assert not _fuse.overlap([(0, (2, 3, 2), (144, 48, 4)), (2, (2, 3, 2), (144, 48, 4))], x)


@pytest.mark.parametrize("out_as", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_on_views_gradients_against_central_differences(out_as, causal):
    B, T, nh, hs = 2, 5, 3, 2
    C = nh * hs
    x = mt.tensor(np.random.default_rng(4).standard_normal((B, T, 3 * C)), requires_grad=True)
    views = _views_of(x, B, T, nh, hs)

    def chain(x):
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return y.transpose(1, 2).contiguous().view(B, T, C) if out_as else y

    def f(x):
        return attention_on_views(x, views, chain, (B, T, C) if out_as else None,
                                  is_causal=causal)
    assert type(f(x).grad_fn).__name__ == "ViewsAttentionBackward"
    assert mt.autograd.gradcheck(f, (x,))           # float64, central differences
    assert mt.autograd.gradgradcheck(f, (x,))


# ---- grad modes: a group is one grad mode, as eager made its views ---------------------------

@pytest.mark.parametrize("no_grad_part", [None, "split", "heads", "q only", "out"])
@pytest.mark.parametrize("tail", [True, False])
def test_views_made_in_another_grad_mode_are_not_fused(no_grad_part, tail):
    """q, k and v (or the view calls after the attention) made under no_grad, the attention
    with grad on: eager's output then requires no grad (or its views none), and a fused
    call, made in the attention's mode, would give one that does. The rewrite must leave
    such a group alone; with every part in one mode it fuses (the control)."""
    B, T, nh, hs = 2, 5, 2, 3
    C = nh * hs

    def heads(t):
        return t.view(B, T, nh, hs).transpose(1, 2)

    def f(x):
        with mt.set_grad_enabled(no_grad_part != "split"):
            parts = x.split(C, dim=2)
        with mt.set_grad_enabled(no_grad_part != "heads"):
            q, k, v = (heads(t) for t in parts)
        if no_grad_part == "q only":
            with mt.no_grad():
                q = heads(parts[0])
        y = F.scaled_dot_product_attention(q, k, v)
        if tail:
            with mt.set_grad_enabled(no_grad_part != "out"):
                y = y.transpose(1, 2).contiguous().view(B, T, C)
        return y
    g = mt.compile(f)
    rng = np.random.default_rng(3)
    for call in range(4):
        x = mt.tensor(rng.standard_normal((B, T, 3 * C)), requires_grad=True)
        x2 = mt.tensor(x.numpy().copy(), requires_grad=True)
        got, want = g(x), f(x2)
        assert got.requires_grad == want.requires_grad, (no_grad_part, call)
        assert (got.grad_fn is None) == (want.grad_fn is None), (no_grad_part, call)
        assert np.array_equal(got.detach().numpy(), want.detach().numpy())
        if want.requires_grad:
            u = rng.standard_normal(want.shape)
            (got * mt.tensor(u)).sum().backward()
            (want * mt.tensor(u)).sum().backward()
            assert np.array_equal(x.grad.numpy(), x2.grad.numpy())
    assert g.calls["replayed"] == 2
    fused = [rec for rec in g.plan.records if rec.fused]
    if no_grad_part is None:
        assert len(fused) == 1 and len(fused[0].fused) == (11 if tail else 8), str(g.plan)
    elif no_grad_part != "out":
        assert not fused, str(g.plan)            # the attention's inputs: another mode
    else:
        # the tail's views were made without grad: the attention alone may be fused, its
        # tail not (eager's output has no graph)
        assert all("contiguous" not in rec.fused for rec in fused), str(g.plan)


# ---- the plan's listing of backward rules is the rewritten plan's --------------------------

def _rules_run(fn, *args):
    """Counter of the backward rules one call of fn runs."""
    import collections
    from microtensor.core import _core
    rules = []

    def row(node, grad):
        rules.append(node.name())
        return node.backward(grad)
    previous = _core.set_backward_profiler(row)
    try:
        fn(*args)
    finally:
        _core.set_backward_profiler(previous)
    return collections.Counter(rules)


def _rules_listed(plan):
    import collections
    backward = [rec for rec in plan.records if rec.label in ("t.backward", "run_backward")]
    assert len(backward) == 1
    return collections.Counter(i for i in backward[0].info if isinstance(i, str))


@pytest.mark.parametrize("attention", [True, False])
@pytest.mark.parametrize("dropout", [True, False])
def test_the_listed_backward_rules_are_those_a_replay_runs(attention, dropout):
    """Every mix of rewrites (a fused attention, a dropped dropout, both, none): once the
    plan has been replayed, the rules it lists for its backward call are the rules its
    replays run; before that, a listing that differs says it is the recording's."""
    B, T, nh, hs = 2, 3, 2, 2
    C = nh * hs
    W = mt.randn(C, 3 * C, requires_grad=True)

    def f(x):
        if attention:
            q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        else:
            y = (x[..., :C] * 2.0).tanh()
        if dropout:
            y = F.dropout(y, 0.0, training=True)          # returns y: the rewrite drops it
        loss = (y @ W).square().sum()
        loss.backward()
        return loss
    g = mt.compile(f)
    x = mt.randn(B, T, 3 * C, requires_grad=True)
    g(x), g(x)                                            # recorded twice: a trusted plan
    plan = g.plan
    assert bool(plan.fused) == attention and bool(plan.dropped) == dropout, str(plan)
    g(x)                                                  # the first replay
    listed = _rules_listed(plan)
    actual = _rules_run(g, x)                             # the rules a replay runs
    assert g.calls["replayed"] == 2
    assert listed == actual, str(plan)
    assert "as recorded" not in str(plan)
    if attention:
        assert actual["ViewsAttentionBackward"] == 1 and "PermuteBackward" not in actual
    assert _rules_run(g, x) == actual == _rules_listed(plan)      # and on later replays


@pytest.mark.parametrize("dropout", [True, False])
def test_a_rewritten_plan_says_its_listing_is_the_recordings_until_it_is_replayed(dropout):
    B, T, nh, hs = 2, 3, 2, 2
    C = nh * hs

    def f(x):
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in x.split(C, dim=2))
        loss = F.dropout(F.scaled_dot_product_attention(q, k, v), 0.0 if dropout else 0.5)
        loss = loss.square().sum()
        loss.backward()
        return loss
    g = mt.compile(f)
    x = mt.randn(B, T, 3 * C, requires_grad=True)
    g(x), g(x)
    assert "(as recorded, before the rewrites)" in str(g.plan)
    g(x)
    assert "(as recorded, before the rewrites)" not in str(g.plan)
    assert "ViewsAttentionBackward" in str(g.plan)
