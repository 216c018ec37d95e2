"""An op-level profiler: where the time of a training step goes.

    from microtensor.profiler import Profiler
    with Profiler() as prof:
        for step in range(3):
            with prof.region("forward"):
                logits, loss = model(x, y)
            with prof.region("backward"):
                loss.backward()
            with prof.region("optimizer"):
                opt.step()
    print(prof.table(steps=3))

Forward: while the profiler is on, the public op functions of microtensor._core (which
Tensor's operators and methods call) and of the modules registered with `register_ops`
(microtensor.nn registers nn.functional) are replaced by timing wrappers, also where
other microtensor / models modules imported them by name.
Only the outermost op is timed: an op that calls other ops (cross_entropy calling
log_softmax, say) counts once, with everything it called inside it.

Backward: the engine calls a hook around each node's backward rule
(`_core.set_backward_profiler`), so the time of each rule is charged to its node
class (MatmulBackward, LayerNormBackward, ...).

Regions: the wall time of a region minus the time of the ops timed inside it is the
"Python overhead between ops": module calls, argument handling, graph bookkeeping,
the engine's traversal and gradient accumulation. The wrappers themselves cost about
a microsecond per op, which lands in that overhead; `wrapper_cost()` measures it.
"""
import contextlib
import sys
import time

from microtensor import _core

# functions of _core that are not ops (creation, random state, modes, plumbing)
_NOT_OPS = {
    "tensor", "from_numpy", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
    "full_like", "arange", "linspace", "randn", "rand", "randint", "randperm",
    "multinomial", "manual_seed", "get_rng_state", "set_rng_state", "default_generator",
    "is_grad_enabled", "set_grad_enabled_", "set_anomaly_enabled_", "is_anomaly_enabled",
    "set_num_threads", "get_num_threads", "set_backward_profiler", "run_backward",
    "wrap", "needs_graph", "attach", "as_dtype",
    # the op registry's own functions
    "register_op", "registered_ops", "register_tensor_method", "registered_tensor_methods",
    "replace_tensor_method", "op_function",
}
_PUBLIC_F_SKIP = {"Tensor", "Node", "ShapeError", "wrap", "needs_graph", "attach"}

# modules whose own op functions are timed besides _core's: (module, label prefix);
# a layer above the core registers itself here (the core never imports it)
_op_modules = []
_active = None           # the Profiler that is on, if any
_Method = object()       # marks a patched Tensor method in Profiler._patched


def register_ops(module, prefix):
    """Time the public functions defined in `module` too, labelled `prefix + name`
    (microtensor.nn registers nn.functional as "F.")."""
    if all(m is not module for m, _ in _op_modules):
        _op_modules.append((module, prefix))


def backward_hook():
    """The per-node backward hook of the Profiler that is on (None when none is): a tool
    that puts its own hook into the engine while a profile runs calls through it."""
    if _active is None or not _active.backward:
        return None
    return _active._backward_hook


def _is_function(obj):
    return callable(obj) and not isinstance(obj, type) and (
        type(obj).__name__ in ("function", "cython_function_or_method",
                               "builtin_function_or_method", "fused_cython_function"))


def _op_functions():
    """{label: (module, attribute name, function)} of everything the profiler wraps."""
    ops = {}
    for name, obj in vars(_core).items():
        if name.startswith("_") or name in _NOT_OPS or not _is_function(obj):
            continue
        # kernels (exp_backward, softmax_forward, ...) run inside ops and rules
        if name.endswith(("_forward", "_backward")) or name in ("max_lastdim", "scatter_add_rows"):
            continue
        # Cython-level helpers of the engine live here too; ops are the lowercase
        # functions defined in the module
        if getattr(obj, "__module__", "microtensor._core") != "microtensor._core":
            continue
        ops[name] = (_core, name, obj)
    for module, prefix in _op_modules:
        for name, obj in vars(module).items():
            if name.startswith("_") or name in _PUBLIC_F_SKIP or not _is_function(obj):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # re-exported from elsewhere: wrapped there
            ops[f"{prefix}{name}"] = (module, name, obj)
    return ops


class Profiler:
    """Context manager that times microtensor's ops by name (see the module doc)."""

    def __init__(self, backward=True, extra_modules=("microtensor", "models")):
        self.backward = backward
        self.extra_modules = extra_modules
        self.stats = {}        # (region, op label) -> [calls, seconds]
        self.regions = {}      # region -> [calls, wall seconds, op seconds]
        self._region = "other"
        self._region_ops = 0.0   # op seconds inside the current region
        self._depth = 0
        self._patched = []     # (module, attribute, original)

    # -- recording ---------------------------------------------------------------
    def _record(self, label, seconds):
        key = (self._region, label)
        s = self.stats.get(key)
        if s is None:
            self.stats[key] = [1, seconds]
        else:
            s[0] += 1
            s[1] += seconds
        self._region_ops += seconds

    def _wrap(self, label, fn):
        prof = self
        clock = time.perf_counter

        def timed(*args, **kwargs):
            if prof._depth:
                return fn(*args, **kwargs)
            prof._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                prof._record(label, clock() - t0)
                prof._depth = 0
        timed.__name__ = getattr(fn, "__name__", label)
        timed.__doc__ = getattr(fn, "__doc__", None)
        timed.__wrapped__ = fn
        return timed

    def _backward_hook(self, node, grad):
        clock = time.perf_counter
        self._depth += 1   # ops a backward rule calls belong to the rule
        t0 = clock()
        try:
            return node.backward(grad)
        finally:
            self._depth -= 1
            self._record(node.name(), clock() - t0)

    # -- on / off --------------------------------------------------------------
    def __enter__(self):
        originals = {}
        for label, (module, name, fn) in _op_functions().items():
            timed = self._wrap(label, fn)
            originals[id(fn)] = timed
            self._patch(module, name, timed)
        # modules that did `from ... import op` hold their own reference
        for modname, module in list(sys.modules.items()):
            if module is None or not modname.split(".")[0] in self.extra_modules:
                continue
            if module is _core:
                continue
            for attr, value in list(vars(module).items()):
                timed = originals.get(id(value))
                if timed is not None and getattr(module, attr) is not timed:
                    self._patch(module, attr, timed)
        # Tensor methods are the registry's functions, installed in the class: t.exp()
        # reaches the op without a module lookup, so the method is swapped too
        for row in _core.registered_ops():
            timed = originals.get(id(row.method))
            if timed is not None:
                self._patched.append((_Method, row.name, _core.replace_tensor_method(row.name, timed)))
        if self.backward:
            _core.set_backward_profiler(self._backward_hook)
        global _active
        _active = self
        return self

    def _patch(self, module, attr, value):
        self._patched.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    def __exit__(self, *exc):
        global _active
        _active = None
        if self.backward:
            _core.set_backward_profiler(None)
        for module, attr, original in reversed(self._patched):
            if module is _Method:
                _core.replace_tensor_method(attr, original)
            else:
                setattr(module, attr, original)
        self._patched = []
        return False

    @contextlib.contextmanager
    def region(self, name):
        """Charge the ops run inside to `name` and time the region's wall clock."""
        prev_region, prev_ops = self._region, self._region_ops
        self._region, self._region_ops = name, 0.0
        t0 = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            r = self.regions.setdefault(name, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += wall
            r[2] += self._region_ops
            self._region, self._region_ops = prev_region, prev_ops

    # -- results ---------------------------------------------------------------
    def summary(self, steps=1):
        """Rows (region, op, calls per step, ms per step) sorted by time, and per
        region (calls, wall ms, ops ms, overhead ms) per step."""
        ops = sorted(((r, op, c / steps, s * 1e3 / steps) for (r, op), (c, s) in
                      self.stats.items()), key=lambda row: -row[3])
        regions = {name: {"wall_ms": wall * 1e3 / steps, "ops_ms": o * 1e3 / steps,
                          "overhead_ms": (wall - o) * 1e3 / steps}
                   for name, (n, wall, o) in self.regions.items()}
        return ops, regions

    def table(self, steps=1, top=25):
        """A text report: the regions, then the `top` ops by time."""
        ops, regions = self.summary(steps)
        total = sum(r["wall_ms"] for r in regions.values()) or 1.0
        lines = [f"per step (mean of {steps}); % of the profiled step's wall time", "",
                 "| region | wall ms | in ops ms | overhead ms | % of step |",
                 "|---|---:|---:|---:|---:|"]
        for name, r in regions.items():
            lines.append(f"| {name} | {r['wall_ms']:.2f} | {r['ops_ms']:.2f} | "
                         f"{r['overhead_ms']:.2f} | {100 * r['wall_ms'] / total:.1f} |")
        lines += ["", "| region | op | calls | ms | us/call | % of step |",
                  "|---|---|---:|---:|---:|---:|"]
        for region, op, calls, ms in ops[:top]:
            lines.append(f"| {region} | {op} | {calls:g} | {ms:.2f} | "
                         f"{1e3 * ms / calls if calls else 0:.1f} | {100 * ms / total:.1f} |")
        if len(ops) > top:
            rest = sum(row[3] for row in ops[top:])
            lines.append(f"| | ({len(ops) - top} more) | | {rest:.2f} | | {100 * rest / total:.1f} |")
        return "\n".join(lines)


def wrapper_cost(n=20000):
    """Seconds a profiling wrapper adds to one call (measured on a trivial op)."""
    x = _core.tensor([1.0])
    clock = time.perf_counter
    t0 = clock()
    for _ in range(n):
        _core.neg(x)
    plain = clock() - t0
    with Profiler(backward=False):
        t0 = clock()
        for _ in range(n):
            _core.neg(x)
        wrapped = clock() - t0
    return max(0.0, (wrapped - plain) / n)
