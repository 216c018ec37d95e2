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

Forward: while the profiler is on, the public op functions of microtensor.core._core (which
Tensor's operators and methods call) and the function of every other op registry row
(the Python op families, F's ops as "F.<name>", mt.linalg's as "linalg.<name>") are
replaced by timing wrappers, also where other microtensor / models modules imported them
by name.
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
import time

from microtensor.core import _core
from microtensor.ops import _intercept

_active = None           # the Profiler that is on, if any
register_ops = _intercept.register_ops   # microtensor.nn registers nn.init as "nn.init."


def backward_hook():
    """The per-node backward hook of the Profiler that is on (None when none is): a tool
    that puts its own hook into the engine while a profile runs calls through it."""
    if _active is None or not _active.backward:
        return None
    return _active._backward_hook


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
        return _intercept.stand_in(timed, fn, label)

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
        # every op function, the references modules took of them, and the registry's
        # Tensor methods (microtensor/ops/_intercept.py, shared with mt.compile)
        self._patched = _intercept.patch_ops(self._wrap, packages=self.extra_modules)
        if self.backward:
            _core.set_backward_profiler(self._backward_hook)
        global _active
        _active = self
        return self

    def __exit__(self, *exc):
        global _active
        _active = None
        if self.backward:
            _core.set_backward_profiler(None)
        _intercept.unpatch(self._patched)
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
