"""nn.Module (the containers Sequential, ModuleList, ModuleDict, which subclass it, are in
containers.py).

A Module owns three ordered dicts: `_parameters`, `_buffers` and `_modules`.
Assigning an attribute files the value into the right one, as torch does:

    self.weight = nn.Parameter(...)    ->  _parameters["weight"]
    self.attn = Attention(...)         ->  _modules["attn"]
    self.register_buffer("bias", t)    ->  _buffers["bias"]

and reading `self.weight` finds it there again (`__getattr__` runs only when normal
lookup fails). Everything else (parameters(), state_dict(), train(), to(dtype), the
printed tree) walks those dicts recursively, with dotted names like
"transformer.h.0.attn.c_attn.weight".
"""
from collections import OrderedDict, namedtuple

import numpy as np

from microtensor.core._core import Tensor, Parameter, as_dtype, parse_to_args
from microtensor.nn.utils import zero_grads
from microtensor.capture.recorder import recorded_call


class StateDictError(ValueError, RuntimeError):
    """load_state_dict found missing or unexpected keys, or shapes that differ.
    A ValueError (a bad value) and a RuntimeError (what torch raises)."""


class _IncompatibleKeys(namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])):
    def __repr__(self):
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return super().__repr__()

    __str__ = __repr__


class _HookHandle:
    def __init__(self, hooks, key):
        self._hooks, self._key = hooks, key

    def remove(self):
        self._hooks.pop(self._key, None)


def _addindent(text, spaces):
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return lines[0] + "\n" + "\n".join(" " * spaces + line for line in lines[1:])


def _check_name(kind, name):
    if not isinstance(name, str):
        raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
    if name == "":
        raise KeyError(f'{kind} name can\'t be empty string ""')
    if "." in name:
        raise KeyError(f'{kind} name can\'t contain ".", got: {name}')


class Module:
    """Base class of every layer and model: subclass it, create parameters and
    submodules in `__init__`, write `forward`, and call the module like a function."""

    training: bool

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{type(self).__name__}.__init__() got unexpected arguments")
        # written through object.__setattr__: our own __setattr__ needs these to exist
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())

    # -- calling ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required '
                                  '"forward" function')

    def __call__(self, *args, **kwargs):
        if not (self._forward_pre_hooks or self._forward_hooks):
            return self.forward(*args, **kwargs)
        for hook, with_kwargs, _ in list(self._forward_pre_hooks.values()):
            if with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError("a forward pre-hook registered with_kwargs=True must "
                                           f"return None or (args, kwargs), got {result!r}")
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        try:
            output = self.forward(*args, **kwargs)
        except BaseException:
            # hooks registered with always_call=True run even when forward raised
            for hook, with_kwargs, always in list(self._forward_hooks.values()):
                if always:
                    try:
                        hook(self, args, kwargs, None) if with_kwargs else hook(self, args, None)
                    except Exception:
                        pass
            raise
        for hook, with_kwargs, _ in list(self._forward_hooks.values()):
            result = hook(self, args, kwargs, output) if with_kwargs else hook(self, args, output)
            if result is not None:
                output = result
        return output

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        """hook(module, args) runs before forward and may return replacement args; with
        with_kwargs=True it is hook(module, args, kwargs) and may return (args, kwargs)."""
        return self._add_hook(self._forward_pre_hooks, hook, prepend, with_kwargs, False)

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False, always_call=False):
        """hook(module, args, output) runs after forward and may return a new output
        (hook(module, args, kwargs, output) with with_kwargs=True); with always_call=True
        it also runs, with output None, when forward raised."""
        return self._add_hook(self._forward_hooks, hook, prepend, with_kwargs, always_call)

    def _add_hook(self, hooks, hook, prepend, with_kwargs, always_call):
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        key = object()
        hooks[key] = (hook, bool(with_kwargs), bool(always_call))
        if prepend:
            hooks.move_to_end(key, last=False)
        return _HookHandle(hooks, key)

    # -- registration -----------------------------------------------------------------
    def register_parameter(self, name, param):
        """Add a parameter (a Parameter, or None for an absent one such as bias=False)."""
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        _check_name("parameter", name)
        if hasattr(self, name) and name not in self._parameters:
            raise KeyError(f"attribute '{name}' already exists")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter "
                            f"'{name}' (nn.Parameter or None required)")
        self._parameters[name] = param

    def register_buffer(self, name, tensor, persistent=True):
        """Add a tensor that is state but not a parameter (a mask, running statistics,
        a table of positions). Persistent buffers go into state_dict()."""
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffer before Module.__init__() call")
        _check_name("buffer", name)
        if hasattr(self, name) and name not in self._buffers:
            raise KeyError(f"attribute '{name}' already exists")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer "
                            f"'{name}' (Tensor or None required)")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers.discard(name)
        else:
            self._non_persistent_buffers.add(name)

    def add_module(self, name, module):
        """Add a submodule (or None)."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        _check_name("module", name)
        if hasattr(self, name) and name not in self._modules:
            raise KeyError(f"attribute '{name}' already exists")
        self._modules[name] = module

    register_module = add_module

    def __setattr__(self, name, value):
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._forget(name)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                "(nn.Parameter or None expected)")
            params[name] = None
        elif isinstance(value, Module):
            if "_modules" not in self.__dict__:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._forget(name)
            self._modules[name] = value
        elif "_modules" in self.__dict__ and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module "
                                f"'{name}' (nn.Module or None expected)")
            self._modules[name] = None
        elif "_buffers" in self.__dict__ and name in self._buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                                "(Tensor or None expected)")
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name):
        """Remove `name` from wherever it lives, before it is filed somewhere else."""
        self.__dict__.pop(name, None)
        for store in ("_parameters", "_buffers", "_modules"):
            self.__dict__[store].pop(name, None)
        self._non_persistent_buffers.discard(name)

    def __getattr__(self, name):
        # only called when normal lookup fails: look in the three registries
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if store in d and name in d[store]:
                return d[store][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for store in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__.get(store, ()):
                del self.__dict__[store][name]
                self._non_persistent_buffers.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        keys = list(super().__dir__())
        keys += list(self._parameters) + list(self._buffers) + list(self._modules)
        return sorted(set(k for k in keys if not k[:1].isdigit()))

    # -- walking the tree -------------------------------------------------------------
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """(name, module) for this module and every descendant, depth first; a module
        reachable by two paths is yielded once, under its first name."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            sub = prefix + ("." if prefix else "") + name
            yield from module.named_modules(memo, sub, remove_duplicate)

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_children(self):
        seen = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self):
        for _, module in self.named_children():
            yield module

    def _named_members(self, store, prefix, recurse, remove_duplicate):
        seen = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in getattr(module, store).items():
                if value is None:
                    continue
                if remove_duplicate:
                    if id(value) in seen:
                        continue
                    seen.add(id(value))
                yield module_prefix + ("." if module_prefix else "") + name, value

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """(name, parameter) pairs; a shared (tied) parameter comes once, under its first
        name."""
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse=True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target):
        module = self
        if target == "":
            return module
        for part in target.split("."):
            if part not in module._modules or module._modules[part] is None:
                raise AttributeError(f"{type(module).__name__} has no submodule '{part}' "
                                     f"(looking up '{target}')")
            module = module._modules[part]
        return module

    def get_parameter(self, target):
        module_path, _, name = target.rpartition(".")
        module = self.get_submodule(module_path)
        if name not in module._parameters:
            raise AttributeError(f"{type(module).__name__} has no parameter '{name}'")
        return module._parameters[name]

    def apply(self, fn):
        """fn(module) for every submodule (children first), then for self."""
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    # -- modes and gradients ----------------------------------------------------------
    def train(self, mode=True):
        """Training mode on (dropout active) or off, for this module and all below it."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self.training = mode
        for module in self.children():
            module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    @recorded_call
    def zero_grad(self, set_to_none=True):
        zero_grads(self.parameters(), set_to_none)

    # -- dtype ------------------------------------------------------------------------
    def to(self, *args, **kwargs):
        """Cast floating parameters and buffers (and their gradients) to a dtype, in
        place: the Parameter objects stay the same, so optimizers and tied weights keep
        pointing at them. A device other than the CPU is a RuntimeError naming it."""
        dtype, _ = parse_to_args(args, dict(kwargs))
        if dtype is None:
            return self
        if dtype.kind != "f":
            raise TypeError(f"nn.Module.to only accepts floating point dtypes, but got {dtype}")
        return self._cast_floating(dtype)

    def _cast_floating(self, dtype):
        for t in list(self.parameters()) + list(self.buffers()):
            if t._data.dtype.kind == "f" and t._data.dtype != dtype:
                t._data = t._data.astype(dtype)
                if t._grad is not None:
                    t._grad._data = t._grad._data.astype(dtype)
        return self

    def float(self):
        return self._cast_floating(np.dtype(np.float32))

    def double(self):
        return self._cast_floating(np.dtype(np.float64))

    def cpu(self):
        return self

    # -- state dict -------------------------------------------------------------------
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """name -> tensor for every parameter and persistent buffer, recursively, with
        torch's dotted names. Tied parameters appear under every name. The tensors share
        memory with the module (detached, unless keep_vars)."""
        if destination is None:
            destination = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers:
                destination[prefix + name] = b if keep_vars else b.detach()
        for name, module in self._modules.items():
            if module is not None:
                module.state_dict(destination, prefix + name + ".", keep_vars)
        return destination

    def _state_targets(self):
        """name -> the live tensor that state_dict() would show under that name."""
        return self.state_dict(keep_vars=True)

    def load_state_dict(self, state_dict, strict=True):
        """Copy values (tensors or numpy arrays) into the parameters and buffers, in
        place. Shapes must match; with strict, the keys must match exactly too. Returns
        (missing_keys, unexpected_keys)."""
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"expected a dict of tensors, got {type(state_dict).__name__}")
        targets = self._state_targets()
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict.keys() if k not in targets]
        mismatched = []
        arrays = {}
        for key, target in targets.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(value, Tensor):
                array = value._data
            elif isinstance(value, np.ndarray):
                array = value
            else:
                raise TypeError(f"state_dict['{key}'] is a {type(value).__name__}; expected a "
                                "Tensor or a numpy array")
            if array.shape != target.shape:
                mismatched.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{array.shape} from checkpoint, the shape in current model "
                                  f"is {target.shape}.")
                continue
            arrays[key] = array

        problems = []
        if strict and missing:
            problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if strict and unexpected:
            problems.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        problems += mismatched
        if problems:
            message = f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(problems)
            raise StateDictError(message)
        # NOTE: every check ran before the first copy, so a failed load changes nothing
        for key, array in arrays.items():
            target = targets[key]
            if array is not target._data:
                np.copyto(target._data, array, casting="unsafe")
                target._bump_version()       # a write: graphs that saved it refuse backward
        return _IncompatibleKeys(missing, unexpected)

    # -- printing ---------------------------------------------------------------------
    def extra_repr(self):
        """The text inside this module's parentheses (its settings); override it."""
        return ""

    def _get_name(self):
        return type(self).__name__

    def __repr__(self):
        extra = self.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        child_lines = [f"({name}): " + _addindent(repr(module), 2)
                       for name, module in self._modules.items() if module is not None]
        if not child_lines and len(extra_lines) <= 1:
            return f"{self._get_name()}({extra})"
        return self._get_name() + "(\n  " + "\n  ".join(extra_lines + child_lines) + "\n)"

