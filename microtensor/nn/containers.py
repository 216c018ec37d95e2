"""The containers Sequential, ModuleList and ModuleDict: Modules whose children are
kept in order (applied one after another, indexed by position, or by name), with
torch's indexing, slicing, insertion and printed form (repeated identical entries of
a ModuleList print once, as "(0-11): 12 x Block(...)"). Re-exported by
`microtensor.nn.module` and `microtensor.nn`.
"""
from collections import OrderedDict
from itertools import islice

from microtensor.nn.module import Module, _addindent


def _index(idx, n, what):
    idx = int(idx)
    if not -n <= idx < n:
        raise IndexError(f"index {idx} is out of range for {what} of length {n}")
    return idx + n if idx < 0 else idx


class Sequential(Module):
    """Modules applied one after another: Sequential(a, b, c)(x) == c(b(a(x))).
    Also Sequential(OrderedDict(name=module, ...)) to name them."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def forward(self, x):
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        i = _index(idx, len(self), "Sequential")
        return next(islice(iter(self._modules.values()), i, None))

    def __setitem__(self, idx, module):
        key = list(self._modules)[_index(idx, len(self), "Sequential")]
        setattr(self, key, module)

    def __delitem__(self, idx):
        keys = list(self._modules)
        for key in (keys[idx] if isinstance(idx, slice) else [keys[_index(idx, len(self), "Sequential")]]):
            del self._modules[key]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self


class ModuleList(Module):
    """A list of modules whose parameters are registered ("h.0.attn...", "h.1..."); it
    has no forward: iterate over it."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[str(_index(idx, len(self), "ModuleList"))]

    def __setitem__(self, idx, module):
        setattr(self, str(_index(idx, len(self), "ModuleList")), module)

    def __delitem__(self, idx):
        modules = list(self._modules.values())
        if isinstance(idx, slice):
            del modules[idx]
        else:
            del modules[_index(idx, len(self), "ModuleList")]
        self._modules.clear()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __iadd__(self, modules):
        return self.extend(modules)

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules):
        if isinstance(modules, Module) and not isinstance(modules, (ModuleList, Sequential)):
            raise TypeError("ModuleList.extend should be called with an iterable of modules, "
                            f"but got {type(modules).__name__}")
        for module in modules:
            self.append(module)
        return self

    def insert(self, index, module):
        modules = list(self._modules.values())
        modules.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def __repr__(self):
        # runs of identical-looking blocks print once, as "(0-11): 12 x Block(...)"
        if not self._modules:
            return "ModuleList()"
        reprs = [repr(m) for m in self._modules.values()]
        lines = []
        start = 0
        for i in range(1, len(reprs) + 1):
            if i < len(reprs) and reprs[i] == reprs[start]:
                continue
            if i - start == 1:
                lines.append(f"({start}): " + _addindent(reprs[start], 2))
            else:
                lines.append(f"({start}-{i - 1}): {i - start} x " + _addindent(reprs[start], 2))
            start = i
        return "ModuleList(\n  " + "\n  ".join(lines) + "\n)"


class ModuleDict(Module):
    """A dict of named modules whose parameters are registered ("transformer.wte...")."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key):
        if key not in self._modules:
            raise KeyError(key)
        return self._modules[key]

    def __setitem__(self, key, module):
        self.add_module(key, module)

    def __delitem__(self, key):
        del self._modules[key]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key):
        return key in self._modules

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()

    def pop(self, key):
        module = self[key]
        del self[key]
        return module

    def clear(self):
        self._modules.clear()

    def update(self, modules):
        items = modules.items() if hasattr(modules, "items") else modules
        for key, module in items:
            self[key] = module
