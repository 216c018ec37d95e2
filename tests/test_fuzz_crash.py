"""A crash fuzzer: hostile arguments to every public function, in child processes.

Each batch runs in a fresh interpreter (this file, run as a script) that calls random
public callables of microtensor (mt.*, Tensor methods, mt.nn.functional, the nn layers,
the optimizers) with random and hostile arguments: wrong dtypes and shapes, 0-d, empty
and non-contiguous tensors, huge and negative ints, NaN and inf, None, strings, nested
lists, hooks that return a gradient of the wrong shape, tensors changed in place or
given another `.data` after the call, any attribute of a result or of its grad_fn set
to a hostile value (`y.grad_fn.inputs = (5,)`, `y._grad = 5`). Results that require grad are back-propagated,
optimizers step. Any Python exception is fine; a signal (segfault, abort, a kill) fails
the test, which then names the batch's seed and the call that was running, from the
log the child writes before each call.

    pytest tests/test_fuzz_crash.py                            # CI: a few batches
    MT_CRASH_BATCHES=200 pytest -m slow tests/test_fuzz_crash.py   # the long run

The child limits its address space (so that a huge allocation is a MemoryError, not
the kernel's OOM killer) and each call's time. Known crashes of the core are skipped
by SKIP below and each has an xfail(strict=True) reproducer at the end of this file.
"""
import os
import subprocess
import sys
import tempfile

import pytest

CI_BATCHES, CI_CALLS = 4, 250
LONG_BATCHES = int(os.environ.get("MT_CRASH_BATCHES", "200"))
LONG_CALLS = int(os.environ.get("MT_CRASH_CALLS", "1000"))
MEMORY_LIMIT = 6 * 2 ** 30          # bytes of address space for a child


# ---- the child: one batch of random calls -----------------------------------------------

def _child(seed, calls, log_path):
    import gc
    import math
    import random
    import resource
    import signal
    import warnings

    import numpy as np

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    warnings.simplefilter("ignore")
    import microtensor as mt
    import microtensor.nn as nn
    import microtensor.nn.functional as F

    log = open(log_path, "w", buffering=1)
    if seed < 0:                                           # the fuzzer's own check
        log.write("0 a deliberate segfault\n")
        os.kill(os.getpid(), signal.SIGSEGV)
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)

    class CallTimeout(Exception):
        pass

    def on_alarm(signum, frame):
        raise CallTimeout()
    signal.signal(signal.SIGALRM, on_alarm)

    # -- the surface ---------------------------------------------------------------------
    def public(module, skip=()):
        out = []
        for name in dir(module):
            if name.startswith("_") or name in skip:
                continue
            obj = getattr(module, name, None)
            if callable(obj) and not isinstance(obj, type(mt)):
                out.append((f"{module.__name__}.{name}", obj))
        return out

    functions = public(mt, skip=SKIP_NAMES) + public(F, skip=SKIP_NAMES)
    for sub in ("linalg", "autograd", "threads"):
        if hasattr(mt, sub):
            functions += public(getattr(mt, sub), skip=SKIP_NAMES)
    layers = [(n, c) for n, c in vars(nn).items() if isinstance(c, type)
              and issubclass(c, nn.Module) and c is not nn.Module and n not in SKIP_NAMES]
    methods = [n for n in dir(mt.Tensor) if not n.startswith("_") and n not in SKIP_NAMES]
    optimizers = [mt.optim.SGD, mt.optim.Adam, mt.optim.AdamW]

    # -- hostile values ------------------------------------------------------------------
    HUGE = [2 ** 31 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1, -2 ** 63, 10 ** 20, -10 ** 9]
    FLOATS = [0.0, -0.0, 1.5, -2.0, 0.5, 1e-300, 1e308, math.nan, math.inf, -math.inf]
    STRINGS = ["", "mean", "sum", "none", "tanh", "cpu", "cuda", "inf", "fro", "x" * 300, "float32"]
    DTYPES = [mt.float32, mt.float64, mt.int64, mt.bool, np.float16, np.int32, np.uint8,
              np.complex64, "float64", None]

    def shape():
        nd = rng.choice([0, 1, 1, 2, 2, 3, 4])
        dims = [rng.choice([0, 1, 2, 3, 4, 5]) for _ in range(nd)]
        if dims and rng.random() < 0.05:
            dims[rng.randrange(nd)] = rng.choice([300, 1000, 4096])
        return tuple(dims)

    def array():
        s = shape()
        kind = rng.choice(["f32", "f32", "f64", "f64", "i64", "bool", "f16", "i32", "u8", "c64"])
        a = nrng.standard_normal(s) * rng.choice([1.0, 1e3, 1e30])
        special = rng.random()
        if a.size and special < 0.2:
            a.reshape(-1)[nrng.integers(0, a.size, max(1, a.size // 4))] = rng.choice(
                [np.nan, np.inf, -np.inf, 0.0])
        if kind in ("i64", "i32", "u8"):
            a = nrng.integers(-5, 10, s) if rng.random() < 0.8 else nrng.integers(-2 ** 62, 2 ** 62, s)
        a = a.astype({"f32": np.float32, "f64": np.float64, "i64": np.int64, "bool": np.bool_,
                      "f16": np.float16, "i32": np.int32, "u8": np.uint8, "c64": np.complex64}[kind])
        layout = rng.random()
        if a.ndim >= 2 and layout < 0.15:
            a = a.swapaxes(0, -1)
        elif a.ndim >= 1 and layout < 0.25:
            a = a[::2]
        elif layout < 0.3:
            a = np.broadcast_to(a, (2,) + a.shape)
        elif layout < 0.35:
            a = a.copy()
            a.flags.writeable = False
        return a

    def tensor():
        a = array()
        try:
            if rng.random() < 0.3:
                t = mt.from_numpy(a)
            else:
                t = mt.tensor(a)
            if rng.random() < 0.6 and a.dtype.kind == "f":
                t.requires_grad_()
            if rng.random() < 0.2:
                t = t * 1.0 if rng.random() < 0.5 else t.transpose(0, -1) if t.ndim else t
        except Exception:                                  # noqa: BLE001
            t = mt.zeros(2, 3, requires_grad=True)
        return t

    def hook():
        return rng.choice([
            lambda g: mt.ones(1_000),
            lambda g: mt.ones(*(g.shape + (2,))),
            lambda g: g.sum(),
            lambda g: g.long() if hasattr(g, "long") else g,
            lambda g: g.numpy() if hasattr(g, "numpy") else g,
            lambda g: "not a tensor",
            lambda g: None,
            lambda g: g * math.nan,
            lambda g: g.T if getattr(g, "ndim", 0) == 2 else g,
            lambda g: (_ for _ in ()).throw(RuntimeError("hook raised")),
        ])

    class Weird:
        def __index__(self):
            return 2 ** 62

        def __float__(self):
            raise ValueError("no float")

        def __len__(self):
            return -1

    def value(depth=0):
        r = rng.random()
        if r < 0.4:
            return tensor()
        if r < 0.5:
            return rng.choice([0, 1, 2, 3, -1, -2, 4, 7] + HUGE)
        if r < 0.58:
            return rng.choice(FLOATS)
        if r < 0.63:
            return array()
        if r < 0.68:
            return rng.choice(STRINGS)
        if r < 0.73:
            return rng.choice(DTYPES)
        if r < 0.8 and depth < 2:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if r < 0.85:
            return tuple(rng.choice([-1, 0, 1, 2, 3, 2 ** 40]) for _ in range(rng.randint(0, 4)))
        if r < 0.88:
            return hook()
        if r < 0.9 and depth < 2:
            return {"params": [tensor()], "lr": rng.choice(FLOATS)}
        if r < 0.93:
            return rng.choice([None, True, False])
        return rng.choice([Weird(), object(), slice(None, None, -1), Ellipsis, b"x"])

    KWARGS = ["dim", "keepdim", "dtype", "p", "eps", "weight", "bias", "reduction",
              "ignore_index", "training", "inplace", "min", "max", "diagonal", "out",
              "num_classes", "padding_idx", "label_smoothing", "correction", "start_dim",
              "end_dim", "is_causal", "attn_mask", "scale", "approximate", "lr", "momentum",
              "requires_grad", "retain_graph", "create_graph", "gradient"]

    TENSOR_NAMES = {"input", "x", "self", "other", "a", "b", "tensor", "tensors", "query", "key",
                    "value", "weight", "bias", "target", "mat1", "mat2", "vec", "end", "logits",
                    "inputs", "outputs", "y", "mask", "attn_mask", "cond", "condition", "src",
                    "index", "indices", "grad_output", "gradient", "t", "input1", "input2"}
    FLOAT_NAMES = {"p", "eps", "lr", "alpha", "beta", "min", "max", "negative_slope", "scale",
                   "momentum", "label_smoothing", "threshold", "lambd", "margin", "delta", "value"}

    def sane_tensor(base):
        """A float tensor whose shape fits the call's other tensors (usually)."""
        dims = list(base)
        r = rng.random()
        if r < 0.2 and dims:
            dims = dims[rng.randrange(len(dims)):]              # a broadcastable suffix
        elif r < 0.3 and dims:
            dims[rng.randrange(len(dims))] = 1
        elif r < 0.35:
            dims = dims[::-1]
        a = nrng.standard_normal(dims).astype(rng.choice([np.float32, np.float64]))
        t = mt.tensor(a, requires_grad=rng.random() < 0.7)
        if rng.random() < 0.15 and t.ndim >= 2:
            t = t.transpose(0, 1)
        return t

    def plausible(name, base):
        if name in ("mask", "attn_mask") and rng.random() < 0.7:
            return mt.tensor(nrng.random(base) < 0.5)
        if name in ("hook", "fn", "func", "hooks"):
            return hook()
        if name in ("exponent",):
            return rng.choice([2, 0.5, -1, 0]) if rng.random() < 0.7 else sane_tensor(base)
        if name in TENSOR_NAMES:
            if name in ("index", "indices", "target") and rng.random() < 0.6:
                return mt.tensor(nrng.integers(0, max(base[-1] if base else 1, 1), base[:-1] or (2,)))
            if name == "tensors":
                return [sane_tensor(base) for _ in range(rng.randint(1, 3))]
            return sane_tensor(base)
        if "dim" in name:
            return rng.randint(-len(base) - 1, len(base))
        if name in ("keepdim", "training", "inplace", "bias_", "affine", "elementwise_affine"):
            return rng.random() < 0.5
        if name in ("shape", "size", "sizes", "normalized_shape", "output_size"):
            return tuple(base[rng.randrange(len(base)):]) if base else ()
        if name in FLOAT_NAMES:
            return rng.choice([0.1, 0.5, 1.0, 1e-5, 0.0])
        if name == "dtype":
            return rng.choice([mt.float32, mt.float64])
        if name == "reduction":
            return rng.choice(["mean", "sum", "none"])
        if name in ("n", "k", "num_classes", "chunks", "split_size_or_sections", "diagonal",
                    "in_features", "out_features", "num_embeddings", "embedding_dim", "d_model"):
            return rng.choice([1, 2, 3, 4])
        return value()

    def arguments(fn=None):
        """Positional and keyword arguments: fitting the signature's names, with one or
        more swapped for a hostile value; or wholly random."""
        import inspect
        try:
            params = list(inspect.signature(fn).parameters.values()) if fn is not None else None
        except (TypeError, ValueError):
            params = None
        if params is None or rng.random() < 0.25:
            args = [value() for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4]))]
            kwargs = {k: value() for k in rng.sample(KWARGS, rng.choice([0, 0, 0, 1, 2]))}
            return args, kwargs
        base = rng.choice([(2, 3), (3,), (2, 3, 4), (), (4, 4), (2, 0), (1, 5), (2, 2, 3, 4)])
        args, kwargs = [], {}
        for prm in params:
            if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD) or prm.name in ("self", "cls"):
                continue
            if prm.default is not prm.empty and rng.random() < 0.6:
                continue
            v = plausible(prm.name, base)
            if prm.kind == prm.KEYWORD_ONLY or (prm.default is not prm.empty and rng.random() < 0.5):
                kwargs[prm.name] = v
            else:
                args.append(v)
        for _ in range(rng.choice([0, 0, 1, 1, 2])):        # the hostile part
            if args and rng.random() < 0.7:
                args[rng.randrange(len(args))] = value()
            elif kwargs:
                kwargs[rng.choice(list(kwargs))] = value()
        return args, kwargs

    def short(x):
        if isinstance(x, mt.Tensor):
            return f"T{tuple(x.shape)}:{x.dtype}{'g' if x.requires_grad else ''}"
        if isinstance(x, np.ndarray):
            return f"A{x.shape}:{x.dtype}"
        if isinstance(x, (list, tuple)):
            return type(x)(short(v) for v in x)
        if isinstance(x, dict):
            return {k: short(v) for k, v in x.items()}
        if callable(x):
            return "<callable>"
        return x

    def assign_attributes(t):
        """Assignments to what the engine reads: any attribute of the result's node, or
        of the tensor itself (private ones included), set to a hostile value."""
        for _ in range(rng.choice([1, 1, 2, 3])):
            obj = t.grad_fn if t.grad_fn is not None and rng.random() < 0.7 else t
            names = [n for n in dir(obj) if not n.startswith("__")]
            name = rng.choice(names)
            v = rng.choice([value(), (value(),), (np.ones(2),), (5,), lambda *a: 5, None, 5,
                            np.ones(3), (t, t, t), ()])
            log.write(f"   setattr {type(obj).__name__}.{name} = {short(v)}\n")
            try:
                setattr(obj, name, v)
            except Exception:                             # noqa: BLE001 (refusing is fine)
                pass
        if rng.random() < 0.5:
            log.write("   next_functions\n")
            t.grad_fn is not None and t.grad_fn.next_functions

    def after(out, inputs):
        """Back-propagate results, with hostile hooks, assignments to the graph's
        attributes and in-place changes of inputs."""
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, mt.Tensor) or not t.requires_grad:
                continue
            if rng.random() < 0.3:
                t.register_hook(hook())
            if rng.random() < 0.3:
                assign_attributes(t)
            for x in inputs:
                if isinstance(x, mt.Tensor) and rng.random() < 0.2:
                    r = rng.random()
                    if r < 0.3:
                        x.data = tensor()
                    elif r < 0.6 and x.dtype in (mt.float32, mt.float64):
                        with mt.no_grad():
                            x.data.fill_(rng.choice(FLOATS))
                    elif x.is_leaf and x.requires_grad:
                        x.register_hook(hook())
            if rng.random() < 0.7:
                if rng.random() < 0.5:
                    t.sum().backward()
                else:
                    t.backward(value())
            break

    def one_call(i):
        r = rng.random()
        if r < 0.45:
            name, fn = rng.choice(functions)
            args, kwargs = arguments(fn)
            log.write(f"{i} {name} {short(args)} {short(kwargs)}\n")
            if known_crash(name.rsplit(".", 1)[-1], args[:1]):
                return
            out = fn(*args, **kwargs)
            after(out, args)
        elif r < 0.75:
            name = rng.choice(methods)
            args, kwargs = arguments(getattr(mt.Tensor, name, None))
            t = tensor() if rng.random() < 0.4 else sane_tensor(rng.choice([(2, 3), (3,), (), (2, 3, 4)]))
            log.write(f"{i} Tensor.{name} on {short(t)} {short(args)} {short(kwargs)}\n")
            if known_crash(name, [t]):
                return
            out = getattr(t, name)
            out = out(*args, **kwargs) if callable(out) else out
            after(out, [t] + args)
        elif r < 0.9:
            name, cls = rng.choice(layers)
            args, kwargs = arguments(cls.__init__)
            if args and args[0] is not None and not isinstance(args[0], mt.Tensor):
                pass
            elif rng.random() < 0.5:
                args = [rng.choice([1, 2, 3, 4, 5])] + args
            log.write(f"{i} nn.{name}({short(args)}, {short(kwargs)})\n")
            layer = cls(*args, **kwargs)
            x = ([sane_tensor(rng.choice([(2, 3), (2, 4), (3, 4, 5), (5,)]))
                  for _ in range(rng.choice([1, 1, 2]))] if rng.random() < 0.7
                 else [value() for _ in range(rng.choice([1, 1, 2]))])
            log.write(f"{i}   forward {short(x)}\n")
            out = layer(*x)
            after(out, x)
            if rng.random() < 0.3:
                log.write(f"{i}   load_state_dict\n")
                layer.load_state_dict({k: value() for k in layer.state_dict()},
                                      strict=rng.random() < 0.5)
                out = layer(*x)
                after(out, x)
        else:
            cls = rng.choice(optimizers)
            params = [tensor() if rng.random() < 0.3 else sane_tensor((3, 4))
                      for _ in range(rng.randint(1, 3))]
            args, kwargs = arguments() if rng.random() < 0.3 else ([rng.choice([0.1, 1e-3])], {})
            log.write(f"{i} {cls.__name__}({short(params)}, {short(args)}, {short(kwargs)})\n")
            opt = cls(params, *args[:1], **kwargs)
            for p in params:
                if rng.random() < 0.8:
                    p.grad = tensor() if rng.random() < 0.3 else mt.ones_like(p)
                if rng.random() < 0.2:
                    p.data = tensor()
            log.write(f"{i}   step\n")
            opt.step()
            if rng.random() < 0.5:
                sd = opt.state_dict()
                for state in sd["state"].values():
                    for k in list(state):
                        if rng.random() < 0.5:
                            state[k] = value()
                log.write(f"{i}   load_state_dict {short(sd['state'])}\n")
                opt.load_state_dict(sd)
            log.write(f"{i}   step again\n")
            opt.step()

    ok = raised = 0
    for i in range(calls):
        signal.setitimer(signal.ITIMER_REAL, 10.0)
        try:
            one_call(i)
            ok += 1
        except (Exception, CallTimeout) as e:              # noqa: BLE001 (any exception is fine)
            raised += 1
            if os.environ.get("MT_CRASH_VERBOSE"):
                log.write(f"   -> {type(e).__name__}: {str(e)[:150]}\n")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if i % 50 == 0:
            gc.collect()
    log.write(f"completed {ok}, raised {raised}\ndone\n")


# Names the child never calls: side effects outside the process (MPI, files beyond its
# temporary directory, subprocesses), and known crashes of the core (see the xfail
# reproducers below).
SKIP_NAMES = {
    "distributed", "init", "barrier", "all_reduce", "broadcast",
    "save", "load", "export_graph", "to_dot", "render", "profile", "show", "plot",
    # numpy's / scipy's BLAS threads (checked by hand: 2**31 - 1 is clamped, no crash);
    # library="all" unpins scipy's BLAS under the kernels' own threads: slow, not unsafe
    "set_blas_threads", "set_threads",
    "backward",                                            # Tensor.backward: called by after()
}


# Known crashes of the core: (function or method name, predicate on the first argument).
# Each has an xfail(strict=True) reproducer below; remove the entry once it is fixed.
KNOWN_CRASHES = {}


def known_crash(name, first):
    for names, hit in KNOWN_CRASHES.values():
        if name in names and first and hit(first[0]):
            return True
    return False


def run_batch(seed, calls, timeout):
    """Run one batch in a child; returns (returncode, log tail, stderr tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "calls.log")
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                f"import test_fuzz_crash as c; c._child({seed}, {calls}, {log_path!r})")
        try:
            proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", str(e.stderr or "")
        with open(log_path) as f:
            lines = f.read().splitlines()
    return rc, lines[-4:], err[-3000:]


def check_batch(seed, calls, timeout):
    rc, tail, err = run_batch(seed, calls, timeout)
    what = "\n".join(tail)
    assert rc != "timeout", f"batch {seed} hung; its last calls:\n{what}"
    assert rc >= 0, f"batch {seed}: the child died of signal {-rc} during:\n{what}\n{err}"
    assert rc == 0 and tail[-1] == "done", f"batch {seed} failed (exit {rc}):\n{what}\n{err}"


@pytest.mark.parametrize("seed", range(CI_BATCHES))
def test_hostile_calls_never_crash(seed):
    check_batch(seed, CI_CALLS, timeout=240)


@pytest.mark.slow
def test_hostile_calls_never_crash_long():
    """MT_CRASH_BATCHES batches of MT_CRASH_CALLS calls (seeds from MT_CRASH_SEED, default
    1000); MT_CRASH_SECONDS (if set) stops after the batch that passes that many seconds.
    Every crash is collected; the test fails at the end listing them."""
    import time
    first = int(os.environ.get("MT_CRASH_SEED", "1000"))
    seconds = float(os.environ.get("MT_CRASH_SECONDS", "inf"))
    t0, crashes, done = time.monotonic(), [], 0
    for seed in range(first, first + LONG_BATCHES):
        if time.monotonic() - t0 > seconds:
            break
        try:
            check_batch(seed, LONG_CALLS, timeout=1200)
        except AssertionError as e:
            crashes.append(str(e)[:2000])
        done += 1
    print(f"\nlong run: {done} batches of {LONG_CALLS} calls, {len(crashes)} crashed")
    assert not crashes, "\n\n".join(crashes)


def test_a_crash_is_caught():
    # the fuzzer can fail: a child killed by a signal is reported with its last call
    with pytest.raises(AssertionError, match=r"signal 11 during:\s+0 a deliberate segfault"):
        check_batch(-1, 1, timeout=60)


def test_crashes_found_by_this_fuzzer_stay_fixed():
    # size(0), split and chunk of a 0-d tensor read shape[0] of an empty shape with the
    # core's bounds checks off: a segfault (torch raises IndexError / RuntimeError)
    for call in ("mt.ones(()).size(0)", "mt.ones(()).size(-1)", "mt.ones(()).split(1, 0)",
                 "mt.ones(()).chunk(1, 0)", "mt.split(mt.ones(()), 1)"):
        proc = subprocess.run([sys.executable, "-c", f"import microtensor as mt\ntry:\n    {call}\n"
                               "except (IndexError, RuntimeError):\n    pass"])
        assert proc.returncode == 0, f"{call}: exit {proc.returncode}"


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
