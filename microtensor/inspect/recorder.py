"""`GradientRecorder`: the gradient norms one backward pass sends through a model.

For chosen tensors, or at the input and output of every module call, the norm of the
gradient that arrives, with a residual block's input gradient split into the part that
came through the skip path and the part that came through the branch. Everything is
read off the engine's own backward pass: tensor hooks (`t.register_hook`) at the call's
inputs and outputs, and for the split, the skip stream of `residual.py`.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from microtensor.core._core import Tensor
from microtensor.inspect.calls import track_modules
from microtensor.inspect.residual import SkipPath, residual_adds, start_stream, stop_stream

__all__ = ["GradientRecorder", "GradRecord", "ResidualUnit"]


def _norm(array):
    """The 2-norm of a gradient, accumulated in float64 (a float32 sum of 10^6 squares
    loses digits)."""
    return float(math.sqrt(np.sum(np.square(np.asarray(array, dtype=np.float64)))))


@dataclass
class ResidualUnit:
    """One skip connection z = s + b(s) inside a module: the gradient reaching the stream
    s splits into dL/dz (straight through the addition) and J_b^T dL/dz (through the
    branch b). `label` names the module that computed b when it was a module call."""
    label: str
    skip_norm: Optional[float] = None
    branch_norm: Optional[float] = None
    total_norm: Optional[float] = None


@dataclass
class GradRecord:
    """What one backward pass sent to a watched tensor or through one module call.

    input_norm   |dL/dx| at the call's input tensor(s) (all of them together);
    output_norm  |dL/dy| at its output tensor(s);
    skip_norm    for a residual module, |skip| where skip = dL/dx along the skip path
                 alone (dL/dy for y = x + f(x));
    branch_norm  |dL/dx - skip|, the part that went through the branch(es);
    units        the same split for each skip connection inside the module;
    param_norm   (a property) |dL/dθ| over the module's parameters, from their .grad.
    `grads` holds the arrays ('input', 'output', 'skip', 'branch') with keep_grads=True.
    """
    name: str
    kind: str = "module"
    type: str = ""
    input_norm: Optional[float] = None
    output_norm: Optional[float] = None
    skip_norm: Optional[float] = None
    branch_norm: Optional[float] = None
    units: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    module: object = field(default=None, repr=False, compare=False)

    @property
    def param_norm(self):
        """|dL/dθ| over the module's parameters, read from their `.grad` (so it is this
        backward pass's gradient when .grad was zeroed before it, as in a training step).
        None for tensors, for modules without parameters, and before backward."""
        if self.module is None:
            return None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(math.sqrt(sum(_norm(g._data) ** 2 for g in grads)))

    @property
    def norm(self):
        """For a watched tensor: the norm of its gradient."""
        return self.output_norm

    @property
    def is_residual(self):
        return self.skip_norm is not None


class GradientRecorder(track_modules):
    """Record, for one backward pass, the gradient norms at chosen tensors and at the
    input and output of every module call made inside `with recorder:`.

        rec = GradientRecorder(model, modules=TransformerBlock, keep_grads=False)
        with rec:
            logits, loss = model(idx, targets)
        loss.backward()
        rec.table()

    `modules` selects which calls to record (None: all; a type or tuple of types; a
    list of names; a regex on the qualified name; or callable(name, module)).
    `residual=True` splits the input gradient of modules that contain skip connections
    (an addition z = s + b where b was computed from s through parameters) into skip and
    branch parts. Tensors can be watched without a model: `x = rec.watch(x, "x")`.
    Hooks stay on the graph, so records fill in when backward runs (inside or after the
    `with` block); a second backward through a retained graph overwrites them. Hooks on
    leaf tensors outlive the graph: `remove_hooks()` takes them off.
    """

    def __init__(self, model=None, modules=None, residual=True, keep_grads=False):
        self.residual = residual
        self.keep_grads = keep_grads
        self.records = {}
        self._leaf_handles = []
        if model is not None:
            super().__init__(model, modules)
        else:
            self.model = None
            self._handles = []

    def __enter__(self):
        if self.model is not None:
            super().__enter__()
        return self

    def __exit__(self, *exc):
        if self.model is not None:
            super().__exit__(*exc)
        return False

    def __getitem__(self, name):
        return self.records[name]

    def __iter__(self):
        return iter(self.records.values())

    def __len__(self):
        return len(self.records)

    def clear(self):
        self.records.clear()

    def _hook(self, tensor, fn):
        """tensor.register_hook(fn), remembering the handle when the tensor is a leaf:
        a leaf keeps its hooks for life (a non-leaf's go with its graph)."""
        handle = tensor.register_hook(fn)
        if tensor.grad_fn is None:
            self._leaf_handles.append(handle)
        return handle

    def remove_hooks(self):
        """Unregister the hooks this recorder put on leaf tensors (watched leaves, leaf
        inputs of module calls), so later backward passes do not update the records."""
        for handle in self._leaf_handles:
            handle.remove()
        self._leaf_handles.clear()

    def _keep(self, record, key, array):
        if self.keep_grads:
            record.grads[key] = np.array(array, copy=True)

    # -- chosen tensors ------------------------------------------------------------
    def watch(self, tensor, name=None):
        """Record the norm of the gradient reaching `tensor` (leaf or not); returns it."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"watch() takes a tensor, got {type(tensor).__name__}")
        if not tensor.requires_grad:
            raise RuntimeError("cannot watch a tensor that doesn't require grad")
        name = name or f"tensor{len(self.records)}"
        if name in self.records:
            raise ValueError(f"a record named {name!r} exists already")
        record = self.records[name] = GradRecord(name, kind="tensor", type=str(tuple(tensor.shape)))

        def hook(grad):
            record.output_norm = _norm(grad._data)
            self._keep(record, "output", grad._data)
        self._hook(tensor, hook)
        return tensor

    # -- module calls --------------------------------------------------------------
    def on_call(self, call, region_nodes, produced):
        ins = [t for t in call.inputs if t._requires_grad]
        outs = [t for t in call.outputs if t._requires_grad]
        record = self.records[call.name] = GradRecord(call.name, type=type(call.module).__name__,
                                                      module=call.module)
        _hook_group(self, outs, record, "output_norm")
        adds = []
        if (self.residual and len(ins) == 1 and len(outs) == 1
                and tuple(ins[0].shape) == tuple(outs[0].shape)):
            # region_nodes run from the output back; the units read better in forward order
            adds = residual_adds(region_nodes)[::-1]
        if not adds:
            _hook_group(self, ins, record, "input_norm")
            return
        x, y = ins[0], outs[0]
        box = {}

        def at_output(grad):
            # the path is found when backward reaches y: the forward pays nothing for it
            box["stream"] = start_stream(SkipPath(y, x, region_nodes, adds), grad._data)

        def at_input(grad):
            total = grad._data
            record.input_norm = _norm(total)
            self._keep(record, "input", total)
            stream = box.pop("stream", None)
            if stream is not None:
                stop_stream(stream)
                skip = stream.result()
                record.skip_norm = _norm(skip)
                self._keep(record, "skip", skip)
                branch = total - skip
                record.branch_norm = _norm(branch)
                self._keep(record, "branch", branch)
        self._hook(y, at_output)
        self._hook(x, at_input)
        self._hook_units(record, call, adds, produced)

    def _hook_units(self, record, call, adds, produced):
        """Per skip connection z = s + b: skip = dL/dz, branch = dL/ds - dL/dz."""
        child_outputs = {}
        for other in call.children:
            for t in other.outputs:
                if t._node is not None:
                    child_outputs[t._node] = other.name.rsplit(".", 1)[-1]
        # the addition's output tensor (z): the tensor its node produced
        for k, (node, s_index, b_index) in enumerate(adds):
            s, b = node.inputs[s_index], node.inputs[b_index]
            label = child_outputs.get(b._node, f"branch{k}")
            unit = ResidualUnit(label)
            record.units.append(unit)
            z = produced.get(node)
            if z is None:
                continue
            box = {}

            def at_z(grad, unit=unit, box=box):
                box["z"] = np.array(grad._data, copy=True)
                unit.skip_norm = _norm(grad._data)

            def at_s(grad, unit=unit, box=box):
                unit.total_norm = _norm(grad._data)
                gz = box.pop("z", None)
                if gz is not None:
                    unit.branch_norm = _norm(grad._data - gz)
            self._hook(z, at_z)
            self._hook(s, at_s)

    # -- reading the records -------------------------------------------------------
    def table(self, units=False):
        """The records as a text table (norms to 4 significant digits); with `units`,
        one extra row per skip connection inside a module."""
        def fmt(v):
            return "-" if v is None else f"{v:.4g}"
        rows = [("name", "type", "|dL/d in|", "|dL/d out|", "|skip|", "|branch|", "|dL/dθ|")]
        for r in self.records.values():
            if r.kind == "tensor":
                rows.append((r.name, f"tensor {r.type}", "", fmt(r.norm), "", "", ""))
                continue
            rows.append((r.name or "(root)", r.type, fmt(r.input_norm), fmt(r.output_norm),
                         fmt(r.skip_norm), fmt(r.branch_norm), fmt(r.param_norm)))
            if units:
                for u in r.units:
                    rows.append((f"  + {u.label}", "skip connection", fmt(u.total_norm), "",
                                 fmt(u.skip_norm), fmt(u.branch_norm), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                 for row in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        return "\n".join(lines)


def _hook_group(recorder, tensors, record, attr):
    """Hook every tensor of a call's inputs (or outputs): `record.<attr>` becomes the
    joint norm of the gradients that reached them, updated as each one arrives."""
    squares = {}
    for t in tensors:
        key = t._node if t._node is not None else id(t)
        if key in squares:                          # the same tensor twice: once
            continue
        squares[key] = None

        def hook(grad, key=key):
            squares[key] = _norm(grad._data) ** 2
            setattr(record, attr, math.sqrt(sum(v for v in squares.values() if v is not None)))
            if len(squares) == 1:
                recorder._keep(record, attr.split("_")[0], grad._data)
        recorder._hook(t, hook)
