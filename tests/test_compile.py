"""mt.compile (microtensor/capture): record a function's ops on two calls, compare the
recordings, replay the plan after. The numbers of a replay must be the eager numbers,
bit for bit; what a plan cannot replay must run eagerly, with a warning that says why."""
import re
import threading
import warnings

import numpy as np
import pytest

import microtensor as mt
from models import GPT, GPTConfig

STEPS = 12


def _tiny_gpt():
    mt.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = GPT(cfg)
    opt = mt.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt


def _batches(n, shapes=((4, 16),), seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        shape = shapes[i % len(shapes)]
        out.append((mt.from_numpy(rng.integers(0, 65, shape)),
                    mt.from_numpy(rng.integers(0, 65, shape))))
    return out


def _lr(i):
    return 1e-3 * (1.0 + 0.37 * i) / (1.0 + 0.05 * i * i)      # different at every step


def _train(compiled, batches):
    """Train a fresh tiny GPT on `batches`; the step is mt.compile'd when `compiled`."""
    model, opt = _tiny_gpt()
    seen = {"body_runs": 0, "compiling": []}

    def step(x, y):
        seen["body_runs"] += 1
        seen["compiling"].append(mt.compiler.is_compiling())
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        norm = mt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss, norm

    fn = mt.compile(step) if compiled else step
    results = []
    for i, (x, y) in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = _lr(i)
        loss, norm = fn(x, y)
        results.append((loss.numpy().copy(), norm.numpy().copy()))
    return dict(model=model, opt=opt, step=fn, results=results, seen=seen,
                rng=mt.get_rng_state(), compiling_after=mt.compiler.is_compiling())


@pytest.fixture(scope="module")
def runs():
    batches = _batches(STEPS)
    return _train(False, batches), _train(True, batches)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


# -- 1. a training step, compiled, is bitwise the eager one ---------------------------------
def test_compiled_training_is_bitwise_eager(runs):
    eager, comp = runs
    step = comp["step"]
    assert step.calls == {"recorded": 2, "replayed": STEPS - 2, "eager": 0}, step
    assert step.eager_reasons == {}
    assert len(step.plans) == 1
    for i, ((le, ne), (lc, nc)) in enumerate(zip(eager["results"], comp["results"])):
        assert _same(le, lc), f"loss of step {i}: {le} vs {lc}"
        assert _same(ne, nc), f"grad norm of step {i}: {ne} vs {nc}"
    # the losses moved: the replays trained the model, they did not repeat one step
    assert len({float(l) for l, _ in comp["results"]}) == STEPS
    pe, pc = list(eager["model"].named_parameters()), list(comp["model"].named_parameters())
    assert [n for n, _ in pe] == [n for n, _ in pc]
    for (name, a), (_, b) in zip(pe, pc):
        assert _same(a.numpy(), b.numpy()), name
    # AdamW's state: the same keys per parameter, the same step count, the same moments
    params_e, params_c = list(eager["model"].parameters()), list(comp["model"].parameters())
    assert len(eager["opt"].state) == len(comp["opt"].state) == len(params_e)
    for pe_, pc_ in zip(params_e, params_c):
        se, sc = eager["opt"].state[pe_], comp["opt"].state[pc_]
        assert set(se) == set(sc) and {"exp_avg", "exp_avg_sq", "step"} <= set(sc)
        for key in se:
            if isinstance(se[key], mt.Tensor):
                assert _same(se[key].numpy(), sc[key].numpy()), key
            else:
                assert se[key] == sc[key] == STEPS, key
    for ge, gc in zip(eager["opt"].param_groups, comp["opt"].param_groups):
        assert ge["lr"] == gc["lr"] == _lr(STEPS - 1)
    # dropout drew from the generator on every replayed call, as eagerly
    assert eager["rng"] == comp["rng"]


# -- 2. the plan, printed and timed ---------------------------------------------------------
def test_plan_lists_the_calls_in_order_and_times_them(runs):
    plan = runs[1]["step"].plan
    text = str(plan)
    lines = text.splitlines()

    def first(pattern):
        for i, line in enumerate(lines):
            if re.search(pattern, line):
                return i
        raise AssertionError(f"{pattern!r} not in the plan:\n{text}")

    order = [first(r"\bOptimizer\.zero_grad\b"), first(r"\bF\.linear\b"),
             first(r"\bF\.scaled_dot_product_attention\b"), first(r"\bt\.backward\b"),
             first(r"\bclip_grad_norm_\b"), first(r"\b(Adam|AdamW)\.step\b")]
    assert order == sorted(order) and len(set(order)) == len(order), text
    # 2 layers: qkv, proj, fc, fc-proj per layer, and the head
    assert sum(bool(re.search(r"\bF\.linear\b", l)) for l in lines) == 2 * 4 + 1
    assert sum("F.scaled_dot_product_attention" in l for l in lines) == 2
    assert "backward rules" in text and "MFLOP" in text
    assert len(plan) > 0 and text.startswith(f"plan: {len(plan)} calls")

    summary = plan.summary()
    assert summary.startswith(f"{STEPS - 2} replays")
    row = [l for l in summary.splitlines() if l.startswith("F.linear ")]
    assert len(row) == 1, summary
    _, calls, ms, pct = row[0].split()
    assert int(calls) == 9 and float(ms) > 0 and 0 < float(pct) <= 100, row[0]


# -- 7. the function's Python runs on the recorded calls only ---------------------------------
def test_is_compiling_and_python_side_effects(runs):
    eager, comp = runs
    assert eager["seen"]["compiling"] == [False] * STEPS
    assert eager["seen"]["body_runs"] == STEPS
    # the body runs on the two recorded calls, and is_compiling() is True there; the
    # replays run no Python of the function (the counter stays at 2)
    assert comp["seen"]["compiling"] == [True, True]
    assert comp["seen"]["body_runs"] == 2
    assert comp["compiling_after"] is False and mt.compiler.is_compiling() is False


# -- 3. keys: shapes and grad mode ---------------------------------------------------------
def test_a_new_batch_shape_records_a_new_plan_with_eager_numbers():
    batches = _batches(8, shapes=((4, 16), (2, 8)), seed=1)
    eager, comp = _train(False, batches), _train(True, batches)
    step = comp["step"]
    assert len(step.plans) == 2
    assert step.calls == {"recorded": 4, "replayed": 4, "eager": 0}
    assert {p.replays for p in step.plans} == {2}
    for (le, ne), (lc, nc) in zip(eager["results"], comp["results"]):
        assert _same(le, lc) and _same(ne, nc)
    for a, b in zip(eager["model"].parameters(), comp["model"].parameters()):
        assert _same(a.numpy(), b.numpy())
    assert eager["rng"] == comp["rng"]


def test_grad_mode_is_part_of_the_key():
    lin = mt.nn.Linear(3, 2)
    f = mt.compile(lambda x: lin(x) * 2)
    x = mt.randn(4, 3)
    expected = (lin(x) * 2).numpy()
    outs = []
    for _ in range(3):
        outs.append(f(x))
        with mt.no_grad():
            outs.append(f(x))
    assert len(f.plans) == 2
    assert f.calls == {"recorded": 4, "replayed": 2, "eager": 0}
    for i, out in enumerate(outs):
        assert _same(out.numpy(), expected)
        if i % 2 == 0:
            assert out.requires_grad and out.grad_fn is not None, i
        else:
            assert not out.requires_grad and out.grad_fn is None, i
    assert mt.is_grad_enabled()
    # the replayed grad-mode output still backpropagates
    outs[4].sum().backward()
    assert lin.weight.grad is not None


# -- 4. guards: a module's training flag ---------------------------------------------------
def test_eval_records_a_new_plan_and_train_replays_the_first():
    model, _ = _tiny_gpt()
    x, y = _batches(1)[0]
    fwd = mt.compile(lambda x, y: model(x, y)[1])

    def eager_loss():
        return model(x, y)[1].numpy()

    def check(expect_recorded, expect_replayed):
        state = mt.get_rng_state()
        want = eager_loss()
        mt.set_rng_state(state)
        got = fwd(x, y).numpy()
        assert _same(got, want)
        assert fwd.calls["recorded"] == expect_recorded
        assert fwd.calls["replayed"] == expect_replayed
        assert mt.get_rng_state() != state if model.training else True
        return got

    train = [check(1, 0), check(2, 0), check(2, 1)]
    assert len(fwd.plans) == 1
    model.eval()
    evals = [check(3, 1), check(4, 1), check(4, 2)]
    assert len(fwd.plans) == 2
    assert evals[0] == evals[1] == evals[2]           # no dropout in eval mode
    assert len({float(t) for t in train}) == 3         # dropout in train mode
    train_plan, eval_plan = fwd.plans
    assert (train_plan.replays, eval_plan.replays) == (1, 1)
    model.train()
    check(4, 3)
    assert (train_plan.replays, eval_plan.replays) == (2, 1)
    assert fwd.calls["eager"] == 0


# -- 5. what a plan cannot replay runs eagerly ---------------------------------------------
def _eager_every_call(compiled, reference, calls, cause):
    """Each call of `compiled` returns `reference()`'s numbers; the first warns."""
    with pytest.warns(RuntimeWarning, match="running eagerly") as caught:
        for _ in range(calls):
            want = reference()
            got = compiled()
            assert _same(got, want)
    assert any(re.search(cause, str(w.message)) for w in caught)
    assert compiled.plans == []
    reasons = list(compiled.eager_reasons.values())
    assert reasons and all(re.search(cause, r) for r in reasons), reasons


class _Call:
    """A compiled function called with fixed arguments (returns numpy)."""

    def __init__(self, fn, *args, **kw):
        self.fn, self.args = mt.compile(fn, **kw), args

    def __call__(self):
        return self.fn(*self.args).numpy()

    def __getattr__(self, name):
        return getattr(self.fn, name)


def test_reading_a_value_runs_eagerly():
    lin = mt.nn.Linear(3, 2)

    def f(x):
        out = lin(x).sum()
        if out.item() > 0:          # Python control flow on a tensor's value
            out = out * 2
        return out - 1

    x = mt.randn(4, 3)
    call = _Call(f, x)
    _eager_every_call(call, lambda: f(x).numpy(), 4, r"item\(\)")
    assert call.calls["replayed"] == 0 and call.calls["eager"] >= 2
    # the branch still follows the value: a flipped sign takes the other branch
    with mt.no_grad():
        lin.weight.mul_(-1)
        lin.bias.mul_(-1)
    assert _same(call(), f(x).numpy())


def test_setting_grad_in_the_function_runs_eagerly():
    lin = mt.nn.Linear(3, 2)

    def f(x):
        lin.weight.grad = None
        out = lin(x).sum()
        out.backward()
        return lin.weight.grad.clone()

    x = mt.randn(4, 3)
    call = _Call(f, x)
    _eager_every_call(call, lambda: f(x).numpy(), 4, r"grad")
    assert call.calls["replayed"] == 0


def test_refusal_names_the_functions_own_line():
    lin = mt.nn.Linear(3, 2)

    def f(x):
        out = lin(x).sum()
        value = out.item()  # MARK-READ
        return out * value

    with pytest.warns(RuntimeWarning, match="running eagerly"):
        mt_f = mt.compile(f)
        mt_f(mt.randn(4, 3))
    (reason,) = mt_f.eager_reasons.values()
    assert "MARK-READ" in reason, reason


def test_in_place_op_on_a_captured_tensor_replays():
    buf = mt.zeros(3)

    def f(x):
        buf.add_(1)                 # an in-place Tensor method: recorded, replayed
        return x * 2 + buf

    x = mt.randn(3)
    g = mt.compile(f)
    for i in range(1, 6):
        out = g(x)
        assert _same(buf.numpy(), np.full(3, float(i), np.float32))
        assert _same(out.numpy(), (x * 2 + mt.full((3,), float(i))).numpy())
    assert g.calls == {"recorded": 2, "replayed": 3, "eager": 0}
    assert "t.add_" in str(g.plan)


def test_numpy_random_values_are_caught_by_the_comparison():
    def f(x):
        return x + mt.from_numpy(np.random.rand(3).astype(np.float32))

    x = mt.randn(3)
    np.random.seed(123)
    want = [f(x).numpy() for _ in range(5)]
    np.random.seed(123)
    g = mt.compile(f)
    with pytest.warns(RuntimeWarning, match="running eagerly") as caught:
        got = [g(x).numpy() for _ in range(5)]
    assert all(_same(a, b) for a, b in zip(got, want))
    assert len({a.tobytes() for a in got}) == 5
    assert g.calls == {"recorded": 2, "replayed": 0, "eager": 3}
    (reason,) = g.eager_reasons.values()
    assert "changed between calls" in reason and "from_numpy" in reason
    assert any("changed between calls" in str(w.message) for w in caught)


def test_a_generator_argument_gives_eager_results():
    lin = mt.nn.Linear(3, 2)

    def f(params):
        return mt.stack([p.sum() for p in params]).sum()

    g = mt.compile(f)
    for _ in range(4):
        assert _same(g(p for p in lin.parameters()).numpy(), f(lin.parameters()).numpy())
    assert g.calls["replayed"] == 0


def test_a_generator_argument_is_refused_at_once():
    lin = mt.nn.Linear(3, 2)
    g = mt.compile(lambda params: mt.stack([p.sum() for p in params]).sum())
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        g(p for p in lin.parameters())
    assert g.calls["recorded"] == 0
    assert any("generator" in r for r in g.eager_reasons.values())


def test_max_plans_exceeded_runs_eagerly():
    lin = mt.nn.Linear(3, 2)

    def f(x):
        return lin(x).relu().sum(0)

    g = mt.compile(f, max_plans=1)
    xs = [mt.randn(n, 3) for n in (2, 3, 4)]
    with pytest.warns(RuntimeWarning, match="running eagerly.*max_plans=1"):
        for x in xs * 3:
            assert _same(g(x).numpy(), f(x).numpy())
    assert len(g.plans) <= 1
    assert g.calls["eager"] >= 4 and sum(g.calls.values()) == 9
    assert len(g.eager_reasons) >= 2
    assert all("max_plans" in r for r in g.eager_reasons.values())


def test_max_plans_counts_plans_not_the_pending_key():
    lin = mt.nn.Linear(3, 2)

    def f(x):
        return lin(x).relu().sum(0)

    g = mt.compile(f, max_plans=2)
    a, b, c = (mt.randn(n, 3) for n in (2, 3, 4))
    for x in (a, a, b, b, a, b):
        assert _same(g(x).numpy(), f(x).numpy())
    assert len(g.plans) == 2 and g.calls == {"recorded": 4, "replayed": 2, "eager": 0}
    with pytest.warns(RuntimeWarning, match="max_plans=2"):
        assert _same(g(c).numpy(), f(c).numpy())
    one = mt.compile(f, max_plans=1)
    for _ in range(3):
        assert _same(one(a).numpy(), f(a).numpy())
    assert one.calls == {"recorded": 2, "replayed": 1, "eager": 0}


def test_an_unhashable_argument_runs_eagerly():
    g = mt.compile(lambda x, scale: x * mt.from_numpy(scale))
    x = mt.randn(3)
    with pytest.warns(RuntimeWarning, match="running eagerly.*cannot key"):
        for k in (2.0, 3.0, 4.0):
            scale = np.full(3, k, np.float32)          # a numpy array: not hashable
            assert _same(g(x, scale).numpy(), (x * k).numpy())
    assert g.calls == {"recorded": 0, "replayed": 0, "eager": 3} and g.plans == []


# -- 6. the forms mt.compile takes ---------------------------------------------------------
def test_decorator_forms_and_options():
    @mt.compile
    def double(x):
        """Twice x."""
        return x * 2

    assert isinstance(double, mt.capture.CompiledFunction)
    assert double.__name__ == "double" and double.__doc__ == "Twice x."
    x = mt.randn(3)
    for _ in range(3):
        assert _same(double(x).numpy(), (x * 2).numpy())
    assert double.calls == {"recorded": 2, "replayed": 1, "eager": 0}

    @mt.compile(max_plans=2)
    def triple(x):
        return x * 3

    assert isinstance(triple, mt.capture.CompiledFunction) and triple.max_plans == 2
    assert _same(triple(x).numpy(), (x * 3).numpy())

    def f(x):
        return x + 1

    g = mt.compile(f, mode="max-autotune", fullgraph=True, dynamic=False, backend="inductor")
    for _ in range(3):
        assert _same(g(x).numpy(), (x + 1).numpy())
    assert g.calls["replayed"] == 1
    assert mt.compile(f, disable=True) is f
    assert mt.compile(disable=True)(f) is f
    assert mt.compile(f, disable=False) is not f

    with pytest.raises(TypeError, match="unexpected keyword"):
        mt.compile(f, optimize=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        mt.compile(frobnicate=1)
    with pytest.raises(TypeError, match="callable"):
        mt.compile(3)
    with pytest.raises(TypeError, match="callable"):
        mt.compile(max_plans=2)("not a function")
    with pytest.raises(ValueError, match="max_plans"):
        mt.compile(f, max_plans=0)


# -- 8. threads: another thread's ops interrupt a recording -------------------------------
def test_ops_of_another_thread_interrupt_the_recording_then_it_records_again():
    """An op in another thread while a call records may feed the function (a constant
    of the plan): that recording is dropped. Once the other thread is quiet, the key
    records twice and replays."""
    inside, release = threading.Event(), threading.Event()
    other_results, errors = [], []
    y = mt.randn(5)

    def f(x):
        a = x * 2
        inside.set()
        assert release.wait(10)
        return a + 1

    def other():
        try:
            assert inside.wait(10)
            z = (y.exp() + 1).sum()
            other_results.append(z.item())
        except Exception as e:                        # noqa: BLE001
            errors.append(e)
        finally:
            release.set()

    g = mt.compile(f)
    x = mt.randn(3)
    t = threading.Thread(target=other)
    t.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # one interruption: no warning
        outs = [g(x)]
        t.join(10)
        release.set()
        outs += [g(x), g(x), g(x)]
    assert not errors and len(other_results) == 1
    assert g.eager_reasons == {}
    assert g.calls == {"recorded": 3, "replayed": 1, "eager": 0}, g.calls
    assert [r.label for r in g.plan.records] == ["mul", "add"]
    assert all(_same(o.numpy(), (x * 2 + 1).numpy()) for o in outs)


@pytest.mark.parametrize("how", ["thread", "pool", "compiled in thread", "in place"])
def test_a_function_whose_work_runs_in_another_thread_runs_eagerly(how):
    """The issue's case and its relatives: a thread (or a pool made before the call, or a
    compiled function called in a thread, or an in-place change made by a thread) does
    the function's work; calls 3.. must not return call 2's numbers."""
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()               # its thread exists before any call
    inner = mt.compile(lambda t: t * 2.0)

    def work(t, box):
        if how == "compiled in thread":
            box.append(inner(t))
        elif how == "in place":
            t.mul_(2.0)
            box.append(t)
        else:
            box.append(t * 2.0)

    def f(x):
        t4 = x + 1
        box = []
        if how == "pool":
            pool.submit(work, t4, box).result()
        else:
            th = threading.Thread(target=work, args=(t4, box))
            th.start()
            th.join()
        return box[0] - 1

    g = mt.compile(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            x = mt.full((3,), float(i))
            assert _same(g(x).numpy(), ((x + 1) * 2 - 1).numpy()), (how, i)
    pool.shutdown()
    assert g.calls["replayed"] == 0
    assert any("another thread" in str(w.message) for w in caught)
    assert any("another thread" in r for r in g.eager_reasons.values())


# ---- memory planning: the arena ----------------------------------------------------------

def test_the_arena_serves_the_plan_and_changes_no_number():
    """From the second replay on, allocations come from one arena smaller than the sum
    of what they would take apart; parameters stay bit for bit those of arena=False."""
    results = {}
    for arena in (True, False):
        mt.manual_seed(3)
        model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32,
                              dropout=0.1))
        opt = mt.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            return loss

        step = mt.compile(step, arena=arena)
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(7):
            x, y = (mt.from_numpy(rng.integers(0, 65, (4, 16))) for _ in range(2))
            losses.append(step(x, y).item())
        results[arena] = (losses, [p.numpy().copy() for p in model.parameters()], step.plan)
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert np.array_equal(a, b)
    memory = results[True][2].memory
    hits, _ = memory.arena.counts
    assert memory.state == "serve" and hits > 0
    assert 0 < memory.arena.capacity < memory.unshared
    assert "one arena of" in str(results[True][2])
    assert results[False][2].memory is None


def test_an_arena_block_still_alive_is_never_handed_out_again():
    from microtensor.kernels._arena import Arena
    from microtensor.capture.memory import place, conflicts
    arena = Arena()
    arena.start("log")
    a = np.empty(1000)
    del a
    b = np.empty(1000)
    del b
    arena.stop()
    sizes, alloc, freed = arena.log()
    assert len(sizes) == 2 and (freed >= 0).all()
    offsets, planned, capacity = place(sizes, alloc, freed)
    assert offsets[0] == offsets[1]             # lifetimes apart: one block for both
    arena.set_plan(offsets, planned, *conflicts(offsets, planned), capacity)
    arena.start("serve")
    try:
        a = np.empty(1000)                      # served: allocation 0 of the plan
        b = np.empty(1000)                      # planned onto a's block, but a is alive
    finally:
        arena.stop()
    assert arena.counts == (1, 1)
    a[:] = 0.0
    b[:] = 1.0
    assert not np.shares_memory(a, b) and a.sum() == 0 and b.sum() == 1000


def test_the_arena_refuses_a_bad_plan():
    from microtensor.kernels._arena import Arena
    arena = Arena()
    ok = dict(offsets=[0], sizes=[64], conflict_ptr=[0, 0], conflicts=[], capacity=128)
    for bad, error in [(dict(offsets=[0, 1]), ValueError), (dict(sizes=[-1]), ValueError),
                       (dict(capacity=64), ValueError), (dict(conflict_ptr=[0, 1]), ValueError),
                       (dict(conflict_ptr=[0, 1], conflicts=[5]), ValueError)]:
        args = {**ok, **bad}
        with pytest.raises(error):
            arena.set_plan(args["offsets"], args["sizes"], args["conflict_ptr"],
                           args["conflicts"], args["capacity"])
    with pytest.raises(RuntimeError, match="no plan"):
        arena.start("serve")
    with pytest.raises(ValueError, match="mode"):
        arena.start("fast")
    arena.set_plan(ok["offsets"], ok["sizes"], ok["conflict_ptr"], ok["conflicts"], ok["capacity"])
    with pytest.raises(RuntimeError, match="once"):
        arena.set_plan(ok["offsets"], ok["sizes"], ok["conflict_ptr"], ok["conflicts"], ok["capacity"])


def test_a_reference_taken_before_compile_is_still_one_call():
    """clip, an optimizer's step and zero_grad are recorded wherever they are called
    from: an alias taken before mt.compile does not run their insides unrecorded."""
    lin = mt.nn.Linear(4, 3)
    opt = mt.optim.SGD(lin.parameters(), lr=0.1)
    clip, step, zero = mt.nn.utils.clip_grad_norm_, opt.step, opt.zero_grad

    @mt.compile
    def train(x):
        zero()
        lin(x).square().sum().backward()
        clip(lin.parameters(), 0.5)
        step()

    x = mt.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            train(x)
    assert train.calls == {"recorded": 2, "replayed": 2, "eager": 0}
    labels = [r.label for r in train.plan.records]
    assert labels[0] == "Optimizer.zero_grad" and labels[-2:] == ["clip_grad_norm_", "SGD.step"]
