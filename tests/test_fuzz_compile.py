"""A differential fuzzer for mt.compile: random programs, compiled and eager, must agree.

A program is two to seven statements drawn from: an op of the op table (tests/test_ops.py)
on the function's arguments, a pointwise op on the last result, an in-place op, a random
draw (mt.randn, rand_like, dropout, t.normal_, nn.init.uniform_, randperm), a value read
(item, float, bool, mt.equal, str, a boolean-mask shape), Python control flow on a
constant or on a counter the function keeps, a call of another compiled function, an
optimizer step (SGD or AdamW on a small Linear), a read of a parameter's `.grad`, and
an op called through a reference taken before mt.compile wrapped the ops, an op run
by another thread the function starts and joins (its result used), and a scalar that
Python calls equal but eager does not treat alike (0.0 and -0.0, 2 and 2.0, 1 and True,
two NaNs, inf and -inf), given as an argument or read from a global: calls 0 and 1 get
the first of the pair, the later calls alternate. And aliasing: a list of two (3, 3)
tensors given as an argument, read beside a global tensor, where the two are drawn as
one object, overlapping views of one storage (`x[:3]`, `x[1:]`; `x`, `x.T`), views that
share a storage but no element, the global itself or a view of it, or two tensors of
their own (calls 0 and 1 get one drawing, the later calls alternate with another); and
a tensor attribute of the program's Linear (`lin.scale`) that is set anew between calls.
It is built twice, on the same seed: once eager, once through mt.compile (with its inner
function compiled too). Both are called six times on the same inputs, from the same RNG
state (the first two calls get the same inputs, the later ones new ones: a value baked
into both recordings shows). Every result and every parameter after the calls must be
bit for bit equal. A compiled program may run eagerly only for a documented refusal (a
value read, a counter, an op it cannot see): one without them must replay, and one with
them must not.

    pytest tests/test_fuzz_compile.py                               # CI: 60 programs
    MT_FUZZ_COMPILE_PROGRAMS=20000 pytest -m slow tests/test_fuzz_compile.py   # long run
"""
import math
import os
import threading
import warnings

import numpy as np
import pytest

import microtensor as mt
import test_ops
from test_ops import OPS

CI_PROGRAMS = 60
LONG_PROGRAMS = int(os.environ.get("MT_FUZZ_COMPILE_PROGRAMS", "20000"))
CALLS = 6

OP_NAMES = sorted(OPS)
UNARY = ["tanh", "sigmoid", "neg", "abs", "relu", "exp", "square"]
IN_PLACE = ["exp_", "relu_", "tanh_", "neg_", "sigmoid_", "abs_", "zero_", ("mul_", 2.0),
            ("add_", 1.5), ("clamp_min_", 0.0), ("pow_", 2), ("fill_", 0.25), "masked_fill_"]
DRAWS = ["randn", "rand_like", "dropout", "normal_", "init.uniform_", "randperm", "bernoulli"]
READS = ["item", "float", "bool", "equal", "str", "mask shape", "tolist"]
KINDS = ["op", "op", "op", "unary", "in_place", "draw", "read", "const_branch", "counter",
         "nested", "step", "grad_read", "captured", "thread", "scalar_arg", "scalar_global",
         "alias", "alias", "module_attr"]
REFUSING = {"read", "counter", "captured", "thread"}          # the documented refusals
SCALAR_USES = ["mul", "div", "clamp_max", "full", "pow", "add_zero"]
# pairs Python calls equal (or that share a hash) which eager tells apart
SCALAR_PAIRS = [(0.0, -0.0), (-0.0, 0.0), (2, 2.0), (2.0, 2), (1, True), (True, 1.0),
                (float("nan"), float("nan")), (math.inf, -math.inf), (0, -0.0)]
VARYING = {"scalar_arg", "scalar_global"}           # a new key or guard value per call
FUZZ_SCALAR = 0.0         # the global the "scalar_global" statements read
# how an "alias" statement reads its pair (and the global FUZZ_ALIAS beside it)
ALIAS_USES = ["sum", "in_place", "last", "matmul"]
# how the pair of (3, 3) tensors is drawn: each with the class of aliasing it gives (the
# same class, the same plan; FUZZ_ALIAS is the global the function reads)
ALIAS_DRAWS = {"own": "apart", "apart": "apart", "same": "same", "overlap": "overlap",
               "transpose": "overlap", "global": "global", "global view": "global view"}
ALIAS_NAMES = sorted(ALIAS_DRAWS)
FUZZ_ALIAS = mt.zeros(3, 3)        # reset to ALIAS_VALUES before each run
ALIAS_VALUES = np.arange(9, dtype=np.float32).reshape(3, 3) / 4 - 1
# lin.scale, call by call: the index of the tensor object (the same index, the same
# object) and its value; calls 0 and 1 share one, as a plan's two recordings must
SCALES = [(0, 1.5), (0, 1.5), (1, -2.0), (1, -2.0), (0, 1.5), (2, 0.25)]
SCALE_REPLAYS = 1          # call 4 (the first object again); calls 2, 3 and 5 record
# table ops whose output shape is read from the values (the door refuses them)
DOOR_OPS = {"index_mask"}
_TANH = mt.tanh         # a reference taken before any recording wrapped the ops


def make_program(seed):
    """A program: [(kind, detail)], drawn from seed."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 8))
    program = [("op", OP_NAMES[rng.integers(len(OP_NAMES))])]
    for _ in range(n - 1):
        kind = KINDS[rng.integers(len(KINDS))]
        table = {"op": OP_NAMES, "unary": UNARY, "in_place": IN_PLACE, "draw": DRAWS,
                 "read": READS, "scalar_arg": SCALAR_USES,
                 "scalar_global": SCALAR_USES, "alias": ALIAS_USES}.get(kind, [None])
        program.append((kind, table[rng.integers(len(table))]))
    return program


def _inputs(program, call):
    """The arguments of one call: each op's inputs, then a (2, 4) feature."""
    saved = test_ops.rng
    test_ops.rng = np.random.default_rng(max(call, 1))       # calls 0 and 1: the same
    try:
        args = []
        for kind, detail in program:
            if kind == "op":
                args.append(tuple(mt.from_numpy(m(s).astype(np.float32))
                                  for m, s in OPS[detail][2]))
        feature = mt.from_numpy(test_ops.rng.standard_normal((2, 4)).astype(np.float32))
        return args, feature
    finally:
        test_ops.rng = saved


def _alias_draws(seed):
    """The two ways a program's pair is drawn: calls 0 and 1 the first, then alternating."""
    rng = np.random.default_rng(seed + 7)
    return [ALIAS_NAMES[i] for i in rng.integers(len(ALIAS_NAMES), size=2)]


def _alias_pair(draw, call):
    """A list of two (3, 3) float32 tensors, aliased as `draw` says."""
    rng = np.random.default_rng(100 + max(call, 1))
    base = mt.from_numpy(rng.standard_normal((6, 3)).astype(np.float32))
    if draw == "own":
        return [mt.from_numpy(rng.standard_normal((3, 3)).astype(np.float32)), base[3:] * 1]
    if draw == "apart":
        return [base[:3], base[3:]]                  # one storage, no element in common
    if draw == "same":
        return [base[:3], ] * 2
    if draw == "overlap":
        return [base[:3], base[1:4]]
    if draw == "transpose":
        return [base[:3], base[:3].T]
    if draw == "global":
        return [FUZZ_ALIAS, base[:3]]
    return [base[:3], FUZZ_ALIAS.view(9).view(3, 3)]   # a view of the global: overlaps it


def _use_alias(use, pair, acc, last, g):
    """(acc, last) after reading the pair beside the global g (FUZZ_ALIAS)."""
    a, b = pair
    if use == "sum":
        return acc + (a * 3.0 + b * 5.0 + g * 7.0).sum(), last
    if use == "in_place":
        a.mul_(2.0)                                  # b sees it where they share memory
        return acc + (b * 5.0 + g).sum(), last
    if use == "last":
        return acc, (a + g) * b - a
    return acc, a @ b + g.T


def build(program, compiled, seed):
    """The program as a function, with its own Linear and optimizer."""
    mt.manual_seed(seed)
    lin = mt.nn.Linear(4, 1)
    opt = (mt.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9) if seed % 2
           else mt.optim.AdamW(lin.parameters(), lr=0.01))
    flag = seed % 3 == 0
    count = 0

    def inner(t):
        return (t * 2).tanh().sum()
    inner_fn = mt.compile(inner) if compiled else inner

    def program_fn(op_args, feature, scalar=0.0, pair=None):
        nonlocal count
        acc = mt.zeros(())
        last = feature
        ops = iter(op_args)
        for kind, detail in program:
            if kind == "op":
                last = _op(detail)(*next(ops)).float()
            elif kind == "unary":
                last = getattr(mt, detail)(last)
            elif kind == "in_place":
                y = last * 1
                if detail == "masked_fill_":
                    y.masked_fill_(y > 0, 0.0)
                elif isinstance(detail, tuple):
                    getattr(y, detail[0])(detail[1])
                else:
                    getattr(y, detail)()
                last = y
            elif kind == "draw":
                last = _draw(detail, last)
            elif kind == "read":
                acc = _read(detail, acc, last)
            elif kind == "const_branch":
                acc = acc + 1 if flag else acc - 1
            elif kind == "counter":
                count += 1
                if count % 2:
                    acc = acc * 3
            elif kind == "nested":
                acc = acc + inner_fn(last)
            elif kind == "step":
                loss = lin(feature).pow(2).mean() + (last.sum() * 0.01).detach()
                loss.backward()
                opt.step()
                opt.zero_grad()
                acc = acc + loss.detach()
            elif kind == "captured":
                last = _TANH(last)
            elif kind == "thread":
                last = _in_thread(last)
            elif kind == "scalar_arg":
                last = _use_scalar(detail, last, scalar)
            elif kind == "scalar_global":
                last = _use_scalar(detail, last, FUZZ_SCALAR)
            elif kind == "alias":
                # the global is read here, where the plan's guards see it (a global read
                # only by a helper is not: docs/COMPILE.md, "cannot see")
                acc, last = _use_alias(detail, pair, acc, last, FUZZ_ALIAS)
            elif kind == "module_attr":
                last = last * lin.scale
            elif kind == "grad_read":
                lin.zero_grad()
                lin(feature).sum().backward()
                acc = acc + lin.weight.grad.sum() * 1
            acc = acc + last.float().sum() * 0.5
        return acc, last

    fn = mt.compile(program_fn) if compiled else program_fn
    return fn, lin


def _op(name):
    """The table's function; an `mt.` function is looked up at the call, as user code
    does (`mt.exp(x)`): the table's own reference was taken before any wrapping."""
    fn = OPS[name][0]
    public = getattr(mt, getattr(fn, "__name__", ""), None)
    return public if public is fn or _unwrapped(public) is fn else fn


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", None)


def _draw(kind, last):
    if kind == "randn":
        return last + mt.randn(*last.shape)
    if kind == "rand_like":
        return last * mt.rand_like(last)
    if kind == "dropout":
        return mt.nn.functional.dropout(last, 0.3, training=True)
    if kind == "normal_":
        return last + last.clone().normal_()
    if kind == "init.uniform_":
        return last + mt.nn.init.uniform_(mt.empty(*last.shape))
    if kind == "randperm":
        return last + mt.randperm(5).float().sum()
    return last * mt.bernoulli(mt.full(tuple(last.shape), 0.5))


def _in_thread(last):
    """last * 2 + 1, computed by a thread the function starts and joins."""
    box = []
    worker = threading.Thread(target=lambda: box.append(last * 2.0 + 1.0))
    worker.start()
    worker.join()
    return box[0]


def _use_scalar(use, last, s):
    if use == "mul":
        return last * s
    if use == "div":
        return 1.0 / (last * 0.0 + s)
    if use == "clamp_max":
        return mt.clamp(last, max=s)
    if use == "full":
        return last + mt.full(tuple(last.shape), s).float()
    if use == "pow":
        return (last.abs() + 1.0).pow(s)
    return last * 0.0 + s


def _scalar(seed, call):
    pair = SCALAR_PAIRS[seed % len(SCALAR_PAIRS)]
    if pair[0] != pair[0]:
        pair = (float("nan"), float("nan"))           # two NaN objects
    return pair[0] if call < 2 else pair[call % 2]


def _read(kind, acc, last):
    if kind == "item":
        return acc * 2 if acc.item() > 0 else acc - 2
    if kind == "float":
        return acc + float(last.sum())
    if kind == "bool":
        return acc + 1 if (last.sum() > 0) else acc
    if kind == "equal":
        return acc + 1 if mt.equal(last, last.abs()) else acc
    if kind == "str":
        return acc + len(str(last.sum()))
    if kind == "tolist":
        return acc + sum(1 for v in np.ravel(last.tolist()) if v > 0)
    return acc + last[last > 0].shape[0]            # a shape read from the values


def run_program(seed):
    """Run one program both ways; a failure message, or None."""
    program = make_program(seed)
    kinds = {k for k, _ in program}
    draws = _alias_draws(seed)
    results = {}
    for compiled in (False, True):
        fn, lin = build(program, compiled, seed)
        mt.manual_seed(seed + 1)
        with mt.no_grad():
            FUZZ_ALIAS.copy_(mt.from_numpy(ALIAS_VALUES))      # the same object, reset
        scales = {}
        outs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for call in range(CALLS):
                op_args, feature = _inputs(program, call)
                # a scalar varies only in a program that uses it (else it would key anew)
                globals()["FUZZ_SCALAR"] = (_scalar(seed + 1, call)
                                            if "scalar_global" in kinds else 0.0)
                scalar = _scalar(seed, call) if "scalar_arg" in kinds else 0.0
                draw = draws[0] if call < 2 or call % 2 else draws[1]
                pair = _alias_pair(draw, call) if "alias" in kinds else None
                if "module_attr" in kinds:
                    index, value = SCALES[call]
                    if index not in scales:
                        scales[index] = mt.tensor(value)
                    lin.scale = scales[index]
                try:
                    acc, last = fn(op_args, feature, scalar, pair)
                    outs.append((acc.numpy().copy(), last.numpy().copy()))
                except Exception as e:                          # noqa: BLE001
                    outs.append(("error", type(e).__name__))
        results[compiled] = (outs, lin.weight.numpy().copy(), lin.bias.numpy().copy(), fn)
    eager, comp = results[False], results[True]
    for call, (a, b) in enumerate(zip(eager[0], comp[0])):
        if not _same(a, b):
            return f"program {seed} {program}: call {call} differs: eager {a}, compiled {b}"
    if not (_same(eager[1], comp[1]) and _same(eager[2], comp[2])):
        return f"program {seed} {program}: the parameters differ after the calls"
    fn = comp[3]
    refuses = any(kind in REFUSING or (kind == "op" and detail in DOOR_OPS)
                  for kind, detail in program)
    if any(o[0] == "error" for o in comp[0]):
        return None                                      # both raised alike: nothing to replay
    if refuses and fn.calls["replayed"]:
        return f"program {seed} {program}: replayed though it reads a value: {fn.eager_reasons}"
    if any(kind in VARYING for kind, _ in program) or refuses:
        return None                                      # keys vary per call: no count
    # the calls that replay: all but the two recorded, less those whose aliasing or
    # lin.scale no plan was recorded for (each such call records; two in a row trust)
    expected = CALLS - 2
    if "alias" in kinds and "module_attr" in kinds:
        return None                   # both vary: their recordings interleave, no count
    if "alias" in kinds and ALIAS_DRAWS[draws[0]] != ALIAS_DRAWS[draws[1]]:
        expected = 2                  # calls 2 and 4 record the other aliasing's plan
    if "module_attr" in kinds:
        expected = SCALE_REPLAYS
    if fn.calls["replayed"] != expected:
        return (f"program {seed} {program} {draws}: replayed {fn.calls['replayed']} calls, "
                f"not {expected}: {fn.eager_reasons}")
    return None


def _same(a, b):
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    a, b = np.asarray(a), np.asarray(b)
    return (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
            and np.array_equal(np.signbit(a), np.signbit(b)))      # -0.0 is not 0.0


def _run(first, count):
    failures = [m for m in (run_program(s) for s in range(first, first + count)) if m]
    assert not failures, f"{len(failures)} of {count} programs:\n" + "\n".join(failures[:5])


def test_fuzz_compile_ci():
    _run(0, CI_PROGRAMS)


@pytest.mark.slow
def test_fuzz_compile_long():
    _run(10_000, LONG_PROGRAMS)


def test_the_fuzzer_finds_a_plan_that_bakes_a_value(monkeypatch):
    """The fuzzer can fail: with the door shut (value reads no longer refuse), programs
    that read a value replay the recorded branch and the fuzzer reports them."""
    from microtensor.capture import recorder
    monkeypatch.setattr(recorder.Recorder, "seen", lambda self, tensor, what: None)
    failures = [m for m in (run_program(s) for s in range(CI_PROGRAMS)) if m]
    assert failures


def _seeds_with(kinds, n, start=0, replaying=False):
    """The first n seeds whose program has one of kinds (and, with replaying, no
    documented refusal: a program that runs eagerly cannot show a wrong plan)."""
    return [s for s in range(start, start + 2000)
            if any(k in kinds for k, _ in make_program(s))
            and not (replaying and any(k in REFUSING for k, _ in make_program(s)))][:n]


def test_the_fuzzer_finds_a_plan_that_bakes_another_threads_result(monkeypatch):
    """With another thread's ops no longer interrupting a recording, the programs that
    run an op in a thread replay its first result and the fuzzer reports them."""
    from microtensor.capture import recorder
    monkeypatch.setattr(recorder, "_foreign", lambda what, mine=None: None)
    seeds = _seeds_with({"thread"}, 12)
    failures = [m for m in (run_program(s) for s in seeds) if m]
    assert len(failures) >= 3, failures


def test_the_fuzzer_finds_a_key_that_ignores_a_zeros_sign_or_a_type(monkeypatch):
    """With scalars keyed and guarded by value alone (0.0 == -0.0, 2 == 2.0 == True),
    the programs that use such a scalar replay the other one's plan."""
    from microtensor.capture import guards
    monkeypatch.setattr(guards, "scalar_id", lambda v: v)
    seeds = _seeds_with(VARYING, 60, replaying=True)
    failures = [m for m in (run_program(s) for s in seeds) if m]
    assert len(failures) >= 2, failures


def test_the_fuzzer_finds_a_key_that_ignores_aliasing(monkeypatch):
    """With the arguments' aliasing out of the key and the guards (a plan recorded with
    one object twice, or with the global as an argument, replayed for two objects), the
    programs that draw aliased arguments replay the other drawing's plan."""
    from microtensor.capture import aliasing
    monkeypatch.setattr(aliasing, "among", lambda tensors: ())
    monkeypatch.setattr(aliasing.Beside, "holds", lambda self, inputs: True)
    seeds = [s for s in _seeds_with({"alias"}, 60, replaying=True)
             if ALIAS_DRAWS[_alias_draws(s)[0]] != ALIAS_DRAWS[_alias_draws(s)[1]]]
    failures = [m for m in (run_program(s) for s in seeds) if m]
    assert len(failures) >= len(seeds) // 3, failures


def test_the_fuzzer_finds_an_unguarded_module_tensor_attribute(monkeypatch):
    """With a module's tensor attributes out of its guarded state, the programs that
    read lin.scale replay the old tensor after it is set anew."""
    from microtensor.capture import guards
    state = guards.state
    monkeypatch.setattr(guards, "state", lambda m: tuple(
        p for p in state(m) if not (len(p) == 3 and p[1] == "tensor")))
    seeds = _seeds_with({"module_attr"}, 20, replaying=True)
    failures = [m for m in (run_program(s) for s in seeds) if m]
    assert len(failures) >= len(seeds) // 2, failures
