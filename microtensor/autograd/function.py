"""mt.autograd.Function: an op with a hand-written backward, as torch.autograd.Function.

    class Exp(mt.autograd.Function):
        @staticmethod
        def forward(ctx, x):                 # Tensors in, Tensors out (grad mode off)
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad_output):      # one gradient (or None) per forward argument
            (y,) = ctx.saved_tensors
            return grad_output * y

    y = Exp.apply(x)

`forward` runs without recording a graph and receives the arguments as they were given;
keyword arguments to `apply` bind to forward's parameters as a call would (a parameter
that can be given by position is an input of the op, in its position, with the defaults
of the parameters before it filled in; a keyword-only one reaches forward as a keyword
and must not be a tensor that requires grad). `backward` receives one gradient per
output (None for an output that is not a tensor) and returns one per positional input
(None for an input that is not a tensor, or needs none). Under `create_graph=True`
backward runs with grad mode on, so a backward written from tensor ops is differentiable
again (gradgradcheck works through it); `@once_differentiable` marks one that is not.
The torch 2 form, a forward without ctx plus `setup_context(ctx, inputs, output)`, works too.

`ctx` is the user's namespace: any attribute may be set on it (`ctx.fn`, `ctx.inputs`,
`ctx.release`, ...). Its own names are torch's: `save_for_backward` / `saved_tensors`
(read-only, with the version check: a saved tensor changed in place since forward makes
`saved_tensors` raise), `needs_input_grad`, `mark_non_differentiable`,
`set_materialize_grads`. The engine keeps its record of the call out of those names, in
the graph node (`y.grad_fn`, which reads the ctx's attributes through).

Several outputs: each differentiable output has a small node of its own in front of the
Function's node, so backward knows which outputs received a gradient. One that received
none, or a non-differentiable tensor output, gets zeros (None after
`ctx.set_materialize_grads(False)`); an output that is not a tensor always gets None.
"""
import functools
import inspect as _inspect

import numpy as np

import microtensor.core._core as C
from microtensor.core._core import (Tensor, Node, SliceGrad, wrap, needs_graph, attach, no_grad,
                               enable_grad)

__all__ = ["Function", "FunctionCtx", "once_differentiable"]


def _describe(t):
    return f"[microtensor.{t.dtype} tensor {list(t.shape)}]"


class _Call:
    """The engine's record of one Function.apply call (never one of the ctx's names)."""
    __slots__ = ("cls", "args", "to_save", "saved", "saved_at", "freed", "non_diff",
                 "materialize", "needs_input_grad", "outputs", "arrived")

    def __init__(self, cls, args):
        self.cls = cls
        self.args = tuple(a if isinstance(a, Tensor) else None for a in args)
        self.to_save, self.saved, self.saved_at = (), None, ()
        self.freed = False
        self.non_diff = set()
        self.materialize = True
        # as torch: from requires_grad alone (also under no_grad)
        self.needs_input_grad = tuple(a is not None and a.requires_grad for a in self.args)
        self.outputs = []          # per forward output: (kind, shape, dtype)
        self.arrived = set()       # outputs that received a gradient in this backward

    def name(self):
        return self.cls.__name__ + "Backward"


class FunctionCtx:
    """The `ctx` that a Function's forward and backward see: the user's namespace."""
    __slots__ = ("__dict__", "__weakref__", "_engine_call")

    def save_for_backward(self, *tensors):
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"save_for_backward can only save variables, but argument {i} "
                                f"is of type {type(t).__name__}")
        _call(self).to_save = tensors

    @property
    def saved_tensors(self):
        call = _call(self)
        if call.freed:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward.")
        if call.saved is None:                   # inside forward: what was passed, unchecked
            return tuple(call.to_save)
        for t, version in zip(call.saved, call.saved_at):
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: {_describe(t)}, saved by {call.name()}, is at version "
                    f"{t._version}; expected version {version} instead.")
        return call.saved

    @property
    def needs_input_grad(self):
        return _call(self).needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value):          # torch lets the user overwrite it
        _call(self).needs_input_grad = value

    def mark_non_differentiable(self, *tensors):
        _call(self).non_diff.update(id(t) for t in tensors)

    def set_materialize_grads(self, value):
        """False: an output that received no gradient reaches backward as None, not zeros."""
        _call(self).materialize = bool(value)

    def mark_dirty(self, *tensors):
        raise NotImplementedError("mark_dirty (a Function that changes its inputs in place) is "
                                  "not supported: return a new tensor instead")

    def __repr__(self):
        return f"<FunctionCtx of {_call(self).cls.__name__}>"


# the slot that holds the engine's record is taken out of the class, so that no attribute
# name reaches it: `ctx._engine_call = ...` is an ordinary attribute of the user's
_CALL_SLOT = FunctionCtx.__dict__["_engine_call"]
del FunctionCtx._engine_call


def _call(ctx):
    return _CALL_SLOT.__get__(ctx, FunctionCtx)


class _FunctionNode(Node):
    """Shared by the two node kinds: reads the ctx's attributes through, as torch's grad_fn
    (which is the ctx) does: `y.grad_fn.saved_tensors`, `y.grad_fn.my_attribute`."""
    saved_mask = 0        # the engine checks no input's version: saved_tensors checks its own

    def create_graph(self, grad_output):
        """Each kind below defines its own (this base is never a node of a graph)."""
        raise NotImplementedError(f"{type(self).__name__} has no create_graph rule")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ctx = self.__dict__.get("_ctx")
        if ctx is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(ctx, name)


class FunctionBackward(_FunctionNode):
    """The graph node of one Function.apply call."""

    def __init__(self, ctx, call):
        self._ctx, self._call = ctx, call

    def name(self):
        return self._call.name()

    def release(self):
        self._call.saved = None                  # what forward saved; the rest stays readable
        self._call.freed = True

    # ---- the two ways the engine runs it --------------------------------------------

    def backward(self, grad_output):
        """First order: numpy gradient in, numpy gradients out (grad mode is off)."""
        grads = self._split(grad_output, lambda g: wrap(np.asarray(g)))
        out = self._call_backward(grads)
        return tuple(None if g is None else g._data for g in out)

    def create_graph(self, grad_output):
        """create_graph=True: the user's backward run with grad mode on, so what it returns
        is built from differentiable ops (a function of the saved tensors and of g)."""
        def as_tensor(g):
            return g if isinstance(g, Tensor) else wrap(np.asarray(g))
        return self._call_backward(self._split(as_tensor(grad_output), as_tensor))

    def _split(self, g, convert):
        """The node's one gradient, cut into one per forward output."""
        call = self._call
        arrived, call.arrived = call.arrived, set()
        grads, flat = [], None
        for i, (kind, shape, dtype, offset) in enumerate(call.outputs):
            if kind == "value":
                grads.append(None)
            elif kind == "whole":
                grads.append(convert(g))
            elif kind == "none" or i not in arrived:
                grads.append(wrap(np.zeros(shape, dtype=dtype)) if call.materialize else None)
            else:
                n = int(np.prod(shape, dtype=np.int64))
                if isinstance(g, Tensor):
                    flat = flat if flat is not None else C.reshape(g, (-1,))
                    piece = C.reshape(flat[offset:offset + n], shape)
                    grads.append(piece if piece.dtype == dtype else C._cast(piece, dtype))
                else:
                    grads.append(wrap(np.asarray(g).reshape(-1)[offset:offset + n]
                                      .reshape(shape).astype(dtype, copy=False)))
        return tuple(grads)

    def _call_backward(self, grads):
        result = self._call.cls.backward(self._ctx, *grads)
        if not isinstance(result, tuple):
            result = (result,)
        args = self._call.args
        if len(result) != len(args):
            extra = result[len(args):]
            if len(result) < len(args) or any(g is not None for g in extra):
                raise RuntimeError(f"function {self.name()} returned an incorrect number of "
                                   f"gradients (expected {len(args)}, got {len(result)})")
            result = result[:len(args)]
        out = []
        for i, (a, g) in enumerate(zip(args, result)):
            if g is None:
                out.append(None)
                continue
            if a is None:
                raise RuntimeError(
                    f"function {self.name()} returned a gradient different than None at "
                    f"position {i + 1}, but the corresponding forward input was not a Variable")
            if not isinstance(g, Tensor):
                raise TypeError(f"function {self.name()} returned a {type(g).__name__} as "
                                f"gradient {i}; expected a Tensor or None")
            if tuple(g.shape) != tuple(a.shape):
                self._check_broadcast(g, a, i)      # the engine sums it down to a's shape
            if g.dtype != a.dtype:
                g = C._cast(g, a.dtype)
            out.append(g if a.requires_grad else None)
        return tuple(out)

    def _check_broadcast(self, g, a, i):
        """As torch: a gradient of a shape the input broadcasts to is fine (the engine
        sums it down, as for every rule); any other shape is the Function's error."""
        gs, s = tuple(g.shape), tuple(a.shape)
        ok = len(s) <= len(gs) and all(x == y or x == 1 for x, y in zip(s[::-1], gs[::-1]))
        if not ok:
            raise RuntimeError(f"Function {self.name()} returned an invalid gradient at index "
                               f"{i} - got {list(gs)} but expected shape compatible with {list(s)}")


class FunctionOutputBackward(_FunctionNode):
    """One of several outputs: passes its gradient into its place in the Function node's
    flat gradient, and notes that it received one."""

    def __init__(self, main, index, offset, size, total, dtype):
        self._ctx, self._main = main._ctx, main
        self._index, self._offset, self._size = index, offset, size
        self._total, self._dtype = total, dtype

    def name(self):
        return self._main.name()

    def release(self):
        pass                                     # holds nothing forward saved

    def backward(self, grad_output):
        self._main._call.arrived.add(self._index)
        g = np.asarray(grad_output, dtype=self._dtype).reshape(-1)
        key = slice(self._offset, self._offset + self._size)
        return (SliceGrad(key, g, (self._total,), self._dtype),)

    def create_graph(self, grad_output):
        self._main._call.arrived.add(self._index)
        g = C.reshape(grad_output, (-1,))
        if g.dtype != self._dtype:
            g = C._cast(g, self._dtype)
        parts = [wrap(np.zeros(n, dtype=self._dtype))
                 for n in (self._offset, self._total - self._offset - self._size)]
        return (C.cat([parts[0], g, parts[1]], 0),)


def once_differentiable(backward):
    """Marks a backward that is not itself differentiable (it leaves tensor ops, or its
    formula is only right to first order): it runs without recording a graph, and under
    create_graph=True its gradients raise if someone differentiates them again."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with no_grad():
            result = backward(ctx, *grads)
        if not C.is_grad_enabled():
            return result
        call = _call(ctx)
        sources = tuple(t for t in tuple(grads) + call.args
                        if isinstance(t, Tensor) and t.requires_grad)
        if not sources:
            return result
        from microtensor.autograd.higher_order import NotDifferentiableTwiceBackward
        single = not isinstance(result, tuple)
        marked = []
        for g in ((result,) if single else result):
            if isinstance(g, Tensor):
                g = wrap(g._data)
                mark = NotDifferentiableTwiceBackward()
                mark.message = ("trying to differentiate twice a function that was marked with "
                                f"@once_differentiable ({call.name()})")
                attach(g, mark, sources)
            marked.append(g)
        return marked[0] if single else tuple(marked)
    return wrapper


class Function:
    """Base for user-defined ops with a hand-written backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("a Function subclass must define forward(ctx, *args)")

    @staticmethod
    def setup_context(ctx, inputs, output):
        raise NotImplementedError("setup_context is not defined for this Function")

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError("a Function subclass must define backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args, **kwargs):
        setup = _has_setup_context(cls)
        if kwargs or setup:
            args, kwargs = _bind(cls, args, kwargs, setup)
        # under mt.compile one call is one record: the replay runs forward and attaches
        # the node again (microtensor/capture/recorder.py)
        return _record_call(f"{cls.__name__}.apply", _apply,
                            (cls, tuple(kwargs.items())) + tuple(args))


def _has_setup_context(cls):
    return getattr(cls.setup_context, "__func__", cls.setup_context) is not _BASE_SETUP


_BASE_SETUP = Function.__dict__["setup_context"].__func__


def _bind(cls, args, kwargs, setup):
    """apply's arguments as forward's: (positional inputs, keyword-only arguments)."""
    try:
        sig = _inspect.signature(cls.forward)
    except (TypeError, ValueError):             # no signature to read: as given
        return args, kwargs
    params = list(sig.parameters.values())
    if not setup:
        params = params[1:]                      # ctx
    sig = sig.replace(parameters=params)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls.__name__}.forward(): {e}") from None
    if setup:
        bound.apply_defaults()                   # as torch: inputs then include defaults
    given = bound.arguments
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    last = max((i for i, p in enumerate(positional) if p.name in given), default=-1)
    out_args, out_kwargs = [], {}
    for p in positional[:last + 1]:
        if p.kind == p.VAR_POSITIONAL:
            out_args.extend(given.get(p.name, ()))
        else:
            out_args.append(given[p.name] if p.name in given else p.default)
    for p in params:
        if p.kind == p.KEYWORD_ONLY and p.name in given:
            out_kwargs[p.name] = given[p.name]
        elif p.kind == p.VAR_KEYWORD:
            out_kwargs.update(given.get(p.name, {}))
    for name, v in out_kwargs.items():
        if isinstance(v, Tensor) and v.requires_grad:
            raise TypeError(
                f"{cls.__name__}.apply: the tensor passed as the keyword-only argument {name!r} "
                f"requires grad, but only forward's positional parameters are inputs that "
                f"receive a gradient: make {name!r} a parameter that can be given by position")
    return tuple(out_args), out_kwargs


def _apply(cls, kw_items, *args):
    """Function.apply's work: forward with grad mode off, then its outputs attached."""
    ctx = FunctionCtx()
    call = _Call(cls, args)
    _CALL_SLOT.__set__(ctx, call)
    graph = needs_graph(tuple(a for a in call.args if a is not None))
    kwargs = dict(kw_items)
    with no_grad():
        if _has_setup_context(cls):
            result = cls.forward(*args, **kwargs)
            cls.setup_context(ctx, args, result)
        else:
            result = cls.forward(ctx, *args, **kwargs)
    if not graph:
        call.to_save = ()
        return result
    # as torch: a tuple is several outputs; anything else (a list too) is one
    single = not isinstance(result, tuple)
    results = (result,) if single else result
    outputs = _attach_outputs(ctx, call, results)
    return outputs[0] if single else tuple(outputs)


def _attach_outputs(ctx, call, results):
    """Make the tensors forward returned the outputs of the Function's node: the one place
    a Function call enters the graph. Returns the outputs to hand to the user."""
    inputs = call.args
    inputs_by_id = {id(a) for a in inputs if a is not None}
    node = FunctionBackward(ctx, call)
    fresh, diff = [], []
    for r in results:
        if isinstance(r, Tensor):
            if id(r) in inputs_by_id or r.requires_grad:   # returned an input: a new tensor
                r = wrap(r._data)
            if id(r) not in call.non_diff and r.dtype.kind in "fc":
                diff.append(r)
        fresh.append(r)
    if len(diff) == 1 and len([r for r in fresh if isinstance(r, Tensor)]) == 1:
        attach(diff[0], node, inputs)
        call.outputs = [("whole", None, None, 0) if isinstance(r, Tensor)
                        else ("value", None, None, 0) for r in fresh]
        outputs = fresh
    else:
        outputs = _attach_several(node, call, fresh, diff, inputs)
    # saved outputs: the tensors the user will hold (the same objects, or their stand-ins)
    replaced = {id(r): o for r, o in zip(results, outputs) if isinstance(r, Tensor)}
    saved = tuple(replaced.get(id(t), t) if t is not None else None for t in call.to_save)
    call.to_save = ()
    call.saved = saved
    call.saved_at = tuple(None if t is None else t._version for t in saved)
    return outputs


def _attach_several(node, call, fresh, diff, inputs):
    """Several outputs (or non-differentiable ones): the Function's node has one flat
    output (never shown, and owning no memory); each differentiable output is the output
    of a FunctionOutputBackward of its own, whose input is that flat tensor."""
    diff_ids = {id(d) for d in diff}
    total = sum(d.numel() for d in diff)
    if diff:
        dtype = np.result_type(*[d.dtype for d in diff])
        flat = wrap(np.broadcast_to(np.zeros((), dtype=dtype), (total,)))
        attach(flat, node, inputs)
    outputs, offset = [], 0
    for i, r in enumerate(fresh):
        if not isinstance(r, Tensor):
            call.outputs.append(("value", None, None, 0))
            outputs.append(r)
            continue
        if id(r) not in diff_ids:
            call.outputs.append(("none", tuple(r.shape), r.dtype, 0))
            outputs.append(r)
            continue
        n = r.numel()
        o = wrap(r._data)
        attach(o, FunctionOutputBackward(node, i, offset, n, total, dtype), (flat,))
        call.outputs.append(("part", tuple(r.shape), r.dtype, offset))
        outputs.append(o)
        offset += n
    return outputs


def _record_call(label, fn, args):
    """fn(*args); mt.compile's recorder takes this place (set_call_recorder), so that one
    apply is one recorded call. The capture is a layer above autograd: the package's
    __init__ wires it in, autograd never imports it."""
    return fn(*args)


def set_call_recorder(record_call):
    """Route every Function.apply through record_call(label, fn, args) (the capture's)."""
    global _record_call
    _record_call = record_call
