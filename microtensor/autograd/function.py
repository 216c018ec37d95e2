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
`backward` receives one gradient per output and returns one per argument (None for an
argument that is not a tensor, or needs none). Under `create_graph=True` backward runs
with grad mode on, so a backward written from tensor ops is differentiable again
(gradgradcheck works through it); `@once_differentiable` marks one that is not.

The context `ctx` is the graph node itself: `save_for_backward` / `saved_tensors` (with
the version check: a saved tensor changed in place since forward makes `saved_tensors`
raise), `needs_input_grad`, `mark_non_differentiable`, `set_materialize_grads`.

Several outputs: the differentiable ones are laid end to end in one flat buffer, which
is the node's single output, and each output is a reshaped slice of it (ordinary
differentiable ops). Backward gets the flat gradient and cuts it back into one per output
(an output that received none gets zeros: gradients are always materialized).
"""
import functools

import numpy as np

import microtensor._core as C
from microtensor._core import Tensor, Node, wrap, needs_graph, attach, no_grad, enable_grad

__all__ = ["Function", "FunctionCtx", "once_differentiable"]


def _describe(t):
    return f"[microtensor.{t.dtype} tensor {list(t.shape)}]"


class FunctionCtx(Node):
    """The graph node of one Function.apply call, and the `ctx` its forward and backward see."""

    saved_mask = 0        # the engine checks no input's version: saved_tensors checks its own

    def save_for_backward(self, *tensors):
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"save_for_backward can only save variables, but argument {i} "
                                f"is of type {type(t).__name__}")
        self._to_save = tensors

    @property
    def saved_tensors(self):
        if self.freed and self._saved is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward.")
        if self._saved is None:                  # inside forward: what was passed, unchecked
            return tuple(getattr(self, "_to_save", ()))
        for t, version in zip(self._saved, self._saved_at):
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: {_describe(t)}, saved by {self.name()}, is at version "
                    f"{t._version}; expected version {version} instead.")
        return self._saved

    def mark_non_differentiable(self, *tensors):
        self._non_differentiable = {id(t) for t in tensors}

    def set_materialize_grads(self, value):
        # microtensor always hands backward a tensor for every output (zeros where none
        # arrived), which is what torch does with the default value=True
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors):
        raise NotImplementedError("mark_dirty (a Function that changes its inputs in place) is "
                                  "not supported: return a new tensor instead")

    def name(self):
        return self.fn.__name__ + "Backward"

    def release(self):
        self._saved = None                       # what forward saved; the rest stays readable

    # ---- the two ways the engine runs it --------------------------------------------

    def backward(self, grad_output):
        """First order: numpy gradient in, numpy gradients out (grad mode is off)."""
        grads = tuple(g if isinstance(g, Tensor) else wrap(np.asarray(g))
                      for g in self._split(grad_output, np.asarray))
        out = self._call_backward(grads)
        return tuple(None if g is None else g._data for g in out)

    def create_graph(self, grad_output):
        """create_graph=True: the user's backward run with grad mode on, so what it returns
        is built from differentiable ops (a function of the saved tensors and of g)."""
        def as_tensor(g):
            return g if isinstance(g, Tensor) else wrap(np.asarray(g))
        return self._call_backward(tuple(self._split(as_tensor(grad_output), as_tensor)))

    def _split(self, g, convert):
        """The node's one gradient, cut into one per forward output."""
        grads, flat = [], None
        for kind, shape, dtype, offset in self._outputs:
            if kind == "whole":
                grads.append(convert(g))
            elif kind == "none":
                grads.append(wrap(np.zeros(shape, dtype=dtype)))
            else:
                n = int(np.prod(shape, dtype=np.int64))
                if isinstance(g, Tensor):
                    flat = flat if flat is not None else C.reshape(g, (-1,))
                    piece = C.reshape(flat[offset:offset + n], shape)
                    grads.append(piece if piece.dtype == dtype else C._cast(piece, dtype))
                else:
                    grads.append(np.asarray(g).reshape(-1)[offset:offset + n]
                                 .reshape(shape).astype(dtype, copy=False))
        return grads

    def _call_backward(self, grads):
        result = self.fn.backward(self, *grads)
        if not isinstance(result, tuple):
            result = (result,)
        args = self._args
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
            if not isinstance(a, Tensor):
                raise RuntimeError(
                    f"function {self.name()} returned a gradient different than None at "
                    f"position {i + 1}, but the corresponding forward input was not a Variable")
            if not isinstance(g, Tensor):
                raise TypeError(f"function {self.name()} returned a {type(g).__name__} as "
                                f"gradient {i}; expected a Tensor or None")
            if tuple(g.shape) != tuple(a.shape):
                g = self._reduce(g, a, i)
            if g.dtype != a.dtype:
                g = C._cast(g, a.dtype)
            out.append(g if a.requires_grad else None)
        return tuple(out)

    def _reduce(self, g, a, i):
        """As torch: a gradient of a shape the input broadcasts to is summed down to it."""
        gs, s = tuple(g.shape), tuple(a.shape)
        ok = len(s) <= len(gs) and all(x == y or x == 1 for x, y in zip(s[::-1], gs[::-1]))
        if not ok:
            raise RuntimeError(f"Function {self.name()} returned an invalid gradient at index "
                               f"{i} - got {list(gs)} but expected shape compatible with {list(s)}")
        if len(gs) > len(s):
            g = C.sum(g, tuple(range(len(gs) - len(s))))
        axes = tuple(k for k, n in enumerate(s) if n == 1 and g.shape[k] != 1)
        return C.sum(g, axes, True) if axes else g


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
        sources = tuple(t for t in tuple(grads) + tuple(ctx.inputs)
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
                                f"@once_differentiable ({ctx.name()})")
                attach(g, mark, sources)
            marked.append(g)
        return marked[0] if single else tuple(marked)
    return wrapper


class Function:
    """Base for user-defined ops with a hand-written backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError("a Function subclass must define forward(ctx, *args)")

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError("a Function subclass must define backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args):
        # under mt.compile one call is one record: the replay runs forward and attaches
        # the node again (microtensor/capture/recorder.py)
        return _capture.record_call(f"{cls.__name__}.apply", _apply, (cls,) + args)


def _apply(cls, *args):
    """Function.apply's work: forward with grad mode off, then its outputs attached."""
    ctx = FunctionCtx()
    ctx.fn = cls
    ctx._args = tuple(a if isinstance(a, Tensor) else None for a in args)
    ctx._saved = None
    ctx.materialize_grads = True
    ctx._non_differentiable = set()
    tensors = tuple(a for a in ctx._args if a is not None)
    graph = needs_graph(tensors)
    # as torch: from requires_grad alone (also under no_grad)
    ctx.needs_input_grad = tuple(a is not None and a.requires_grad for a in ctx._args)
    with no_grad():
        result = cls.forward(ctx, *args)
    single = not isinstance(result, (tuple, list))
    results = (result,) if single else tuple(result)
    if not graph:
        ctx._to_save = ()
        return result
    outputs = _attach_outputs(ctx, results, ctx._args)
    return outputs[0] if single else tuple(outputs)


def _attach_outputs(ctx, results, inputs):
    """Make the tensors forward returned the outputs of `ctx` applied to `inputs`: the one
    place a Function call enters the graph. Returns the outputs to hand to the user."""
    inputs_by_id = {id(a) for a in inputs if a is not None}
    fresh, diff = [], []
    for r in results:
        if isinstance(r, Tensor):
            if id(r) in inputs_by_id or r.requires_grad:   # returned an input: a new tensor
                r = wrap(r._data)
            if id(r) not in ctx._non_differentiable and r.dtype.kind in "fc":
                diff.append(r)
        fresh.append(r)
    ctx._outputs = []
    if len(diff) == 1 and len([r for r in fresh if isinstance(r, Tensor)]) == 1:
        attach(diff[0], ctx, inputs)
        ctx._outputs.append(("whole", None, None, 0))
        outputs = fresh
    else:
        outputs = _attach_several(ctx, fresh, diff, inputs)
    # saved outputs: the tensors the user will hold (the same objects, or their stand-ins)
    replaced = {id(r): o for r, o in zip(results, outputs) if isinstance(r, Tensor)}
    saved = tuple(replaced.get(id(t), t) if t is not None else None
                  for t in getattr(ctx, "_to_save", ()))
    ctx._to_save = ()
    ctx._saved = saved
    ctx._saved_at = tuple(None if t is None else t._version for t in saved)
    return outputs


def _attach_several(ctx, fresh, diff, inputs):
    """Several outputs (or non-differentiable ones): one flat buffer is the node's output,
    each differentiable output a reshaped slice of it."""
    diff_ids = {id(d) for d in diff}
    outputs = []
    if diff:
        dtype = np.result_type(*[d.dtype for d in diff])
        flat = wrap(np.concatenate([np.asarray(d._data, dtype=dtype).reshape(-1) for d in diff]))
        attach(flat, ctx, inputs)
    offset = 0
    for r in fresh:
        if not isinstance(r, Tensor):
            outputs.append(r)
            continue
        if id(r) not in diff_ids:
            ctx._outputs.append(("none", tuple(r.shape), r.dtype, 0))
            outputs.append(r)
            continue
        n = r.numel()
        with enable_grad():
            o = C.reshape(flat[offset:offset + n], tuple(r.shape))
            if o.dtype != r.dtype:
                o = C._cast(o, r.dtype)
        ctx._outputs.append(("part", tuple(r.shape), r.dtype, offset))
        outputs.append(o)
        offset += n
    return outputs


from microtensor.capture import recorder as _capture  # noqa: E402  (capture wraps ops)
