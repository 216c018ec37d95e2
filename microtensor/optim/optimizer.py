"""The Optimizer base class: parameter groups, per-parameter state, state dicts.

An optimizer holds `param_groups`, a list of dicts, each with a "params" list and its
own options (lr, weight_decay, ...), and `state`, a dict from parameter to that
parameter's buffers (momentum, Adam's moments, the step count). Subclasses write
`step()`; everything else, including saving and restoring, lives here.

Checkpoints store tensors and string metadata only (safetensors, no pickle), so
`flatten_state_dict` turns an optimizer's state dict into numpy arrays plus one JSON
string, and `unflatten_state_dict` turns them back:

    arrays, meta = mt.optim.flatten_state_dict(opt.state_dict())
    mt.save({**model.state_dict(), **arrays}, "ckpt.safetensors", metadata={"optimizer": meta})
    tensors, metadata = mt.load("ckpt.safetensors", with_metadata=True)
    opt.load_state_dict(mt.optim.unflatten_state_dict(tensors, metadata["optimizer"]))
"""
import json
import math
from numbers import Number

import numpy as np

from microtensor.core._core import Tensor, ShapeError, enable_grad, get_num_threads, wrap
from microtensor.core._grads import zero_grads
from microtensor.core.dtypes import KERNEL_FLOATS
from microtensor.capture.recorder import recorded_call


class _RequiredParameter:
    """Marks an option with no default: every param group must set it."""

    def __repr__(self):
        return "<required parameter>"


required = _RequiredParameter()


class Optimizer:
    """Base class of the optimizers: `step()` is the subclass's, the rest is shared."""

    def __init_subclass__(cls, **kwargs):
        # mt.compile records a step as one call (it changes parameters and state outside
        # any op), also through a reference taken before (`step = optimizer.step`)
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is not None and not getattr(step, "__recorded__", False):
            cls.step = recorded_call(step, f"{cls.__name__}.step")

    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        self.state = {}         # parameter -> dict of its buffers (Tensor hashes by identity)
        self.param_groups = []
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or "
                f"dicts, but got a single {type(params).__name__}; wrap it in a list")
        if isinstance(params, dict):
            raise TypeError("params should be an iterable of Tensors or of param-group dicts, "
                            "got a dict; wrap it in a list")
        groups = list(params)
        if len(groups) == 0:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def __repr__(self):
        lines = [type(self).__name__ + " ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)

    def add_param_group(self, param_group):
        """Add a group of parameters with its own options (missing ones take the
        optimizer's defaults)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        if params is None:
            raise ValueError("a param group needs a 'params' entry")
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs; "
                            "use a list instead")
        else:
            params = list(params)
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but param {i} of the "
                                f"group is a {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError(f"can't optimize a non-leaf Tensor (param {i} of the group, "
                                 f"shape {p.shape}, was computed by {p.grad_fn.name()})")
            if p.dtype not in (np.float32, np.float64):
                raise TypeError(f"optimizers update float32 and float64 tensors, but param "
                                f"{i} of the group has dtype {p.dtype}")
            if id(p) in seen:
                raise ValueError(f"param {i} appears twice in the same parameter group")
            seen.add(id(p))
        group = dict(param_group)
        group["params"] = params
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required "
                                 f"optimization parameter {name}")
            group.setdefault(name, default)
        for other in self.param_groups:
            if not seen.isdisjoint(id(p) for p in other["params"]):
                raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    @recorded_call
    def zero_grad(self, set_to_none=True):
        """Forget the gradients: drop them (default) or fill them with zeros."""
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    def step(self, closure=None):
        raise NotImplementedError(f"{type(self).__name__} does not implement step()")

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with enable_grad():
            return closure()

    # -- saving and restoring ---------------------------------------------------------
    def state_dict(self):
        """{"state": {index: {name: value}}, "param_groups": [{options..., "params": [index]}]}.

        Parameters are numbered in group order, as torch does. Values are the live state
        (tensors share memory with the optimizer's buffers): save or copy them before
        stepping again if you keep them around."""
        index_of = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if id(p) not in index_of:
                    index_of[id(p)] = len(index_of)
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    state[index_of[id(p)]] = self.state[p]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore options and buffers saved by `state_dict()` (values are copied; floating
        buffers are cast to their parameter's dtype)."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state dict: expected a dict with 'state' and "
                             "'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"but the optimizer has {len(self.param_groups)}")
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group ({i}) with "
                    f"{len(saved['params'])} parameters, but the optimizer's group has "
                    f"{len(group['params'])}")
        param_of = {}
        for group, saved in zip(self.param_groups, saved_groups):
            for index, p in zip(saved["params"], group["params"]):
                param_of[_state_index(index)] = p

        # Everything is checked before anything is changed: the kernels of step() trust
        # these buffers' sizes, and a checkpoint may have been damaged or tampered with.
        state = {}
        saved_state = state_dict.get("state", {})
        if not isinstance(saved_state, dict):
            raise ValueError(f"optimizer state dict: 'state' must be a dict, got "
                             f"{type(saved_state).__name__}")
        for index, values in saved_state.items():
            p = param_of.get(_state_index(index))
            if p is None:
                continue
            if not isinstance(values, dict):
                raise ValueError(f"optimizer state of parameter {index} must be a dict, got "
                                 f"{type(values).__name__}")
            restored = {}
            for name, value in values.items():
                if name == "step":
                    value = _step_count(value, index)
                elif isinstance(value, (Tensor, np.ndarray)):
                    array = value._data if isinstance(value, Tensor) else value
                    if array.dtype.kind != "f":
                        raise TypeError(
                            f"optimizer state '{name}' of parameter {index} has dtype "
                            f"{array.dtype}, but optimizer buffers are floating point (the "
                            f"parameter is {p.dtype})")
                    if array.shape != p.shape:
                        raise ValueError(
                            f"optimizer state '{name}' of parameter {index} has shape "
                            f"{array.shape}, but the parameter has shape {p.shape}")
                    value = wrap(np.array(array, dtype=p.dtype, order="C", copy=True))
                elif value is not None:
                    raise TypeError(
                        f"optimizer state '{name}' of parameter {index} must be a tensor (or "
                        f"None), got {type(value).__name__}")
                restored[name] = value
            state[p] = restored
        self.state = state

        new_groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            new_group = {k: v for k, v in saved.items() if k != "params"}
            new_group["params"] = group["params"]
            new_groups.append(new_group)
        self.param_groups = new_groups

    # -- helpers for subclasses -------------------------------------------------------
    def _state_buffer(self, state, name, p):
        """state[name] as a zero-initialised tensor like p, in p's dtype (recast after
        module.double() and the like). A buffer whose shape is not p's (the parameter's
        `.data` was replaced by another shape since the last step) is an error: the
        kernels index every buffer with the parameter's elements."""
        buf = state.get(name)
        if buf is None:
            buf = wrap(np.zeros(p.shape, dtype=p.dtype))
            state[name] = buf
        else:
            if not isinstance(buf, Tensor):
                raise TypeError(f"{type(self).__name__}: optimizer state '{name}' must be a "
                                f"tensor, got {type(buf).__name__}")
            data = buf._data
            if data.shape != p._data.shape:
                raise ShapeError(
                    f"{type(self).__name__}.step(): optimizer state '{name}' has shape "
                    f"{data.shape}, but its parameter now has shape {p._data.shape} (was the "
                    f"parameter's .data replaced? create a new optimizer, or load a state "
                    f"of matching shapes)")
            if data.dtype != p._data.dtype or not data.flags.c_contiguous:
                if data.dtype.kind != "f":
                    raise TypeError(f"{type(self).__name__}: optimizer state '{name}' has "
                                    f"dtype {data.dtype}; optimizer buffers are floating point")
                buf._data = np.ascontiguousarray(data, dtype=p._data.dtype)
        return buf


def _state_index(index):
    if isinstance(index, bool) or not isinstance(index, (int, np.integer, str)):
        raise ValueError(f"optimizer state dict: parameter index {index!r} is not an integer")
    try:
        return int(index)
    except ValueError:
        raise ValueError(f"optimizer state dict: parameter index {index!r} is not an "
                         "integer") from None


def _step_count(value, index):
    """A saved step count as an int >= 0 (torch saves it as a 0-d float tensor)."""
    if isinstance(value, (Tensor, np.ndarray)):
        array = value._data if isinstance(value, Tensor) else value
        if array.size != 1 or array.dtype.kind not in "iuf":
            raise ValueError(f"optimizer state 'step' of parameter {index} must be one number, "
                             f"got an array of shape {array.shape} and dtype {array.dtype}")
        value = array.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, Number):
        raise TypeError(f"optimizer state 'step' of parameter {index} must be a number, got "
                        f"{type(value).__name__}")
    if not (math.isfinite(value) and value >= 0 and value == int(value) and value < 2 ** 53):
        raise ValueError(f"optimizer state 'step' of parameter {index} must be a whole number "
                         f">= 0, got {value}")
    return int(value)


def _check_param(opt, p, index, group):
    """Before a kernel touches p (parameter `index` of param group `group`): a float
    parameter with a float gradient of its shape. Returns p's gradient array (any layout
    and float dtype)."""
    data = p._data
    if data.dtype not in KERNEL_FLOATS:
        raise TypeError(f"{type(opt).__name__}.step(): parameter {index} of param group "
                        f"{group} has dtype {data.dtype}; optimizers update float32 and "
                        "float64 tensors")
    grad = p._grad
    g = grad._data if isinstance(grad, Tensor) else np.asarray(grad)
    if g.shape != data.shape:
        raise ShapeError(f"{type(opt).__name__}.step(): the gradient of parameter {index} of "
                         f"param group {group} has shape {g.shape}, but the parameter has "
                         f"shape {data.shape}")
    if g.dtype.kind != "f":
        raise TypeError(f"{type(opt).__name__}.step(): the gradient of parameter {index} of "
                        f"param group {group} has dtype {g.dtype}; gradients must be "
                        "floating point")
    return g


def _bump_version(p):
    """An optimizer step is an in-place change of p: a graph that saved p before the step
    must refuse to run backward with the new values (torch: "modified by an inplace
    operation")."""
    bump = getattr(p, "_bump_version", None)
    if bump is not None:
        bump()


def _flat(array):
    """A 1-D view of a C-contiguous array (a copy, flagged, for any other layout)."""
    if array.flags.c_contiguous:
        return array.reshape(-1), False
    return np.ascontiguousarray(array).reshape(-1), True


def _flat_grad(p, g, maximize=False):
    """The gradient g (checked by _check_param) as a flat contiguous array of p's dtype;
    with maximize, -g in a new array (p.grad is left as it is), as torch negates the
    gradient before anything else reads it: every kernel then runs its usual update,
    and the sign flip is exact, so the steps are torch's to the bit."""
    if maximize:
        return np.negative(g, dtype=p._data.dtype, casting="same_kind").reshape(-1)
    if g.dtype != p._data.dtype or not g.flags.c_contiguous:
        g = np.ascontiguousarray(g, dtype=p._data.dtype)
    return g.reshape(-1)


def _num_threads():
    return get_num_threads()


# -- checkpoints: optimizer state as arrays + JSON ------------------------------------

def _jsonable(value, where):
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, Number):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    raise TypeError(f"optimizer option {where} = {value!r} cannot be stored in a checkpoint")


def flatten_state_dict(state_dict, prefix="optimizer."):
    """An optimizer state dict as (arrays, meta): `arrays` maps
    "{prefix}state.{index}.{name}" to numpy arrays (no copies), and `meta` is a JSON
    string with the param groups and the non-array state (step counts). Both go into
    a checkpoint: `mt.save({**arrays, ...}, path, metadata={"optimizer": meta})`."""
    arrays = {}
    scalars = {}
    array_names = {}
    for index, values in state_dict["state"].items():
        index = int(index)
        for name, value in values.items():
            if isinstance(value, (Tensor, np.ndarray)):
                key = f"{prefix}state.{index}.{name}"
                arrays[key] = value._data if isinstance(value, Tensor) else value
                array_names.setdefault(str(index), []).append(name)
            else:
                scalars.setdefault(str(index), {})[name] = _jsonable(value, f"state {index}.{name}")
    groups = []
    for i, group in enumerate(state_dict["param_groups"]):
        groups.append({k: _jsonable(v, f"group {i} '{k}'") for k, v in group.items()})
    meta = {"format": "microtensor.optimizer/1", "prefix": prefix, "param_groups": groups,
            "scalars": scalars, "arrays": array_names}
    return arrays, json.dumps(meta)


def unflatten_state_dict(tensors, meta, prefix=None):
    """Inverse of `flatten_state_dict`: `tensors` is any dict holding the arrays (for
    instance everything `mt.load` returned), `meta` the JSON string."""
    try:
        meta = json.loads(meta) if isinstance(meta, (str, bytes)) else meta
        if meta.get("format") != "microtensor.optimizer/1":
            raise ValueError(f"unknown format {meta.get('format')!r}")
        prefix = meta["prefix"] if prefix is None else prefix
        groups = []
        for group in meta["param_groups"]:
            groups.append({k: (tuple(v) if isinstance(v, list) and k != "params" else v)
                           for k, v in group.items()})
        state = {}
        for index, values in meta["scalars"].items():
            state.setdefault(int(index), {}).update(values)
        for index, names in meta["arrays"].items():
            for name in names:
                key = f"{prefix}state.{index}.{name}"
                if key not in tensors:
                    raise ValueError(f"the optimizer array '{key}' is missing")
                state.setdefault(int(index), {})[name] = tensors[key]
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a flattened optimizer state: {e!r}") from None
    return {"state": state, "param_groups": groups}
