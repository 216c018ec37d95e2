"""Which module call made which graph node: `track_modules`.

Inside `with track_modules(model) as calls:` every call of `model` or of one of its
submodules is recorded through Module's own forward hooks (a pre-hook opens the call,
a forward hook closes it), with the graph nodes it created between its inputs and its
outputs. The recorder and the graph exporter use this to name and group things.
"""
from dataclasses import dataclass, field
from typing import Optional
import re

from microtensor.core._core import Tensor

__all__ = ["ModuleCall", "ModuleCalls", "track_modules"]


def _grad_tensors(obj):
    """The tensors inside a call's arguments or result (tuples, lists, dicts), in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _grad_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _grad_tensors(item)]
    return []


def _region(out_tensors, stop_tensors):
    """The op nodes reachable (backwards) from `out_tensors`, not going past
    `stop_tensors`: the part of the graph a module call built.

    Returns (nodes in discovery order, {node: the tensor it produced})."""
    stop_nodes = {t._node for t in stop_tensors if t._node is not None}
    produced = {}
    order = []
    seen = set()
    work = []
    for t in out_tensors:
        node = t._node
        if node is None or node in stop_nodes or node in seen:
            continue
        seen.add(node)
        produced[node] = t
        work.append(node)
    while work:
        node = work.pop()
        order.append(node)
        for inp in node.inputs:
            if inp is None or inp._node is None or not inp._requires_grad:
                continue
            m = inp._node
            if m in stop_nodes or m in seen:
                continue
            seen.add(m)
            produced[m] = inp
            work.append(m)
    return order, produced


@dataclass
class ModuleCall:
    """One call of a module: its name (a second call of the same module is `name#1`),
    the tensors it got and returned, its parent call and its depth below the root."""
    name: str
    module: object
    inputs: list
    outputs: list
    parent: Optional["ModuleCall"] = None
    depth: int = 0
    children: list = field(default_factory=list)


class ModuleCalls:
    """The module calls seen inside `track_modules(model)`, and the owner of each graph
    node: the innermost call that created it."""

    def __init__(self, root):
        self.root = root
        self.calls = []
        self.owner = {}          # node -> ModuleCall
        self.param_names = {}    # id(parameter) -> qualified name
        if root is not None:
            for name, p in root.named_parameters():
                self.param_names.setdefault(id(p), name)

    def owner_name(self, node):
        """The name of the call that created `node`, or None for nodes made outside
        every tracked call."""
        call = self.owner.get(node)
        return None if call is None else call.name


def _module_filter(modules):
    """None: every module; a type or tuple of types; an iterable of names; a regex
    string; or a callable(name, module) -> bool."""
    if modules is None:
        return lambda name, module: True
    if isinstance(modules, type) or (isinstance(modules, tuple) and modules
                                     and all(isinstance(m, type) for m in modules)):
        return lambda name, module: isinstance(module, modules)
    if isinstance(modules, str):
        pattern = re.compile(modules)
        return lambda name, module: pattern.fullmatch(name) is not None
    if callable(modules):
        return modules
    names = set(modules)
    return lambda name, module: name in names


class track_modules:
    """`with track_modules(model) as calls:` puts a forward pre-hook and a forward hook
    on `model` and on every submodule, so each call (selected by `modules`, see
    GradientRecorder) is recorded with the graph nodes it created. Leaving the block
    removes the hooks.

    The tensors a call gets are its positional arguments (forward pre-hooks do not see
    keyword arguments)."""

    def __init__(self, model, modules=None):
        if not hasattr(model, "named_modules"):
            raise TypeError(f"track_modules needs an nn.Module, got {type(model).__name__}")
        self.model = model
        self.select = _module_filter(modules)
        self.calls = ModuleCalls(model)
        self._handles = []
        self._stack = []
        self._counts = {}

    # subclasses (the recorder) add hooks here
    def on_call(self, call, region_nodes, produced):
        pass

    def __enter__(self):
        seen = set()
        for name, module in self.model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._opener(name)))
            self._handles.append(module.register_forward_hook(self._closer()))
        return self.calls

    def __exit__(self, *exc):
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        return False

    def _opener(self, name):
        def pre_hook(module, args):
            if module is self.model:
                # NOTE: a forward that raised never reached its forward hook; a new call
                # of the root starts from an empty stack, whatever was left open
                self._stack.clear()
            parent = self._stack[-1] if self._stack else None
            count = self._counts.get(name, 0)
            self._counts[name] = count + 1
            self._stack.append(ModuleCall(name if count == 0 else f"{name}#{count}", module,
                                          _grad_tensors(args), [], parent,
                                          0 if parent is None else parent.depth + 1))
        return pre_hook

    def _closer(self):
        def hook(module, args, output):
            # calls left open above this one (their forward raised) are dropped
            while self._stack:
                call = self._stack.pop()
                if call.module is module:
                    call.outputs = _grad_tensors(output)
                    self._finish(call)
                    break
        return hook

    def _finish(self, call):
        ins = [t for t in call.inputs if t._requires_grad]
        outs = [t for t in call.outputs if t._requires_grad]
        region_nodes, produced = _region(outs, ins)
        owner = self.calls.owner
        for node in region_nodes:
            owner.setdefault(node, call)     # children returned first and kept theirs
        self.calls.calls.append(call)
        if call.parent is not None:
            call.parent.children.append(call)
        if self.select(call.name.split("#")[0], call.module):
            self.on_call(call, region_nodes, produced)
