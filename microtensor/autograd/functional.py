"""mt.autograd.functional: vector-Jacobian, Jacobian-vector and Hessian-vector products,
full Jacobians and Hessians of a function, with torch.autograd.functional's signatures.

    f(x) -> y:   vjp  = v^T J     one backward pass
                 jvp  = J v       two backward passes (the double-vjp trick, below)
    f(x) -> s:   vhp  = v^T H     backward of (gradient . v)
                 hvp  = H v       as torch: the double-vjp trick applied to the gradient
                 (for a twice continuously differentiable f, H is symmetric: hvp == vhp)

The double-vjp trick: u -> vjp(u) = u^T J is linear in u, so its own vjp with respect
to u, taken at any u (zero here), is J v. Reverse mode gives forward mode, at the price
of differentiating a backward pass (create_graph=True).

`inputs` is a tensor or a tuple of tensors; results mirror it (and the outputs) as in
torch: a tensor for a tensor, tuples for tuples. Without create_graph the results are
detached; with it they can be differentiated again.
"""
import numpy as np

import microtensor.core._core as C
from microtensor.core._core import Tensor, wrap
from microtensor.autograd.gradients import grad as _grad

__all__ = ["vjp", "jvp", "vhp", "hvp", "jacobian", "hessian"]


# ---- inputs and outputs as tuples, and back ------------------------------------------

def _as_tuple(x, what, fn_name):
    is_tuple = isinstance(x, (tuple, list))
    items = tuple(x) if is_tuple else (x,)
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise TypeError(f"The {what} given to {fn_name} must be either a Tensor or a tuple "
                            f"of Tensors, but {what} {i} is {type(t).__name__}")
    return is_tuple, items


def _prepare_inputs(inputs, create_graph):
    """Fresh tensors to differentiate by: detached leaves, or (with create_graph, for an
    input that already requires grad) an identity view, so results stay connected to it."""
    out = []
    for t in inputs:
        if t.dtype.kind != "f":
            raise TypeError(f"autograd.functional: inputs must be floating tensors, got {t.dtype}")
        if create_graph and t.requires_grad:
            out.append(C.reshape(t, t.shape))            # a view with a node: a new tensor
        else:
            out.append(t.detach().requires_grad_())
    return tuple(out)


def _finish(items, is_tuple, create_graph):
    items = tuple(t if create_graph else t.detach() for t in items)
    return items if is_tuple else items[0]


def _fill(grads, like, strict, fn_name, what="input"):
    """None (an output independent of an input) becomes zeros, or an error with strict."""
    out = []
    for i, (g, t) in enumerate(zip(grads, like)):
        if g is None:
            if strict:
                raise RuntimeError(f"The output of the user-provided function is independent of "
                                   f"{what} {i}. This is not allowed in strict mode ({fn_name}).")
            g = C.zeros_like(t)
        out.append(g)
    return tuple(out)


def _check_v(v, like, what, fn_name):
    """v given (one per tensor in `like`, same shapes), or None for one-element tensors."""
    if v is None:
        if len(like) != 1 or like[0].numel() != 1:
            raise RuntimeError(f"The vector v can only be None if the {what} of the "
                               f"user-provided function is a single Tensor with a single "
                               f"element ({fn_name}).")
        return (C.ones_like(like[0]),)
    _, v = _as_tuple(v, "v", fn_name)
    if len(v) != len(like):
        raise RuntimeError(f"{fn_name}: v has {len(v)} tensors, but the {what} has {len(like)}")
    for i, (a, b) in enumerate(zip(v, like)):
        if tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"{fn_name}: entry {i} in v has shape {tuple(a.shape)}, but the "
                               f"{what} has shape {tuple(b.shape)} there")
    return v


def _call(func, inputs, fn_name):
    with C.enable_grad():
        out = func(*inputs)
    return _as_tuple(out, "outputs of the user-provided function", fn_name)


def _requiring(outputs, grads_like):
    """(outputs, grads) pairs whose output has a graph (others contribute nothing)."""
    return [(o, g) for o, g in zip(outputs, grads_like) if o.requires_grad]


def _vjp_raw(outputs, inputs, v, create_graph):
    """Gradients of sum <v_i, out_i> w.r.t. inputs (None where unused)."""
    pairs = _requiring(outputs, v)
    if not pairs:
        return (None,) * len(inputs)
    return _grad([o for o, _ in pairs], list(inputs), [g for _, g in pairs],
                 retain_graph=True, create_graph=create_graph, allow_unused=True)


# ---- products ------------------------------------------------------------------------

def vjp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T J): the vector-Jacobian product, one backward pass."""
    in_tuple, inputs = _as_tuple(inputs, "inputs", "vjp")
    inputs = _prepare_inputs(inputs, create_graph)
    out_tuple, outputs = _call(func, inputs, "vjp")
    v = _check_v(v, outputs, "output", "vjp")
    grads = _fill(_vjp_raw(outputs, inputs, v, create_graph), inputs, strict, "vjp")
    return _finish(outputs, out_tuple, create_graph), _finish(grads, in_tuple, create_graph)


def jvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), J v): the Jacobian-vector product by the double-vjp trick."""
    in_tuple, inputs = _as_tuple(inputs, "inputs", "jvp")
    inputs = _prepare_inputs(inputs, create_graph)
    v = _check_v(v, inputs, "input", "jvp")
    out_tuple, outputs = _call(func, inputs, "jvp")
    # u^T J as a function of u (zero here; the value does not matter, u^T J is linear)
    us = tuple(C.zeros_like(o).requires_grad_() for o in outputs)
    g_u = _vjp_raw(outputs, inputs, us, True)
    pairs = [(g, vi) for g, vi in zip(g_u, v) if g is not None and g.requires_grad]
    if pairs:
        jv = _grad([g for g, _ in pairs], list(us), [vi for _, vi in pairs],
                   retain_graph=create_graph, create_graph=create_graph, allow_unused=True)
    else:
        jv = (None,) * len(us)
    jv = _fill(jv, outputs, strict, "jvp", "output")
    return _finish(outputs, out_tuple, create_graph), _finish(jv, out_tuple, create_graph)


def _scalar_output(func, inputs, fn_name):
    out_tuple, outputs = _call(func, inputs, fn_name)
    if out_tuple or outputs[0].numel() != 1:
        raise RuntimeError(f"The function given to {fn_name} should return a single Tensor with "
                           f"a single element, got {len(outputs)} tensor(s) of shape "
                           f"{tuple(outputs[0].shape)}")
    return outputs[0]


def _gradient(out, inputs, strict, fn_name):
    g = _grad(out, list(inputs), retain_graph=True, create_graph=True, allow_unused=True)
    return _fill(g, inputs, strict, fn_name)


def vhp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T H): the gradient of <grad f, v>, one double backward."""
    in_tuple, inputs = _as_tuple(inputs, "inputs", "vhp")
    inputs = _prepare_inputs(inputs, create_graph)
    v = _check_v(v, inputs, "input", "vhp")
    out = _scalar_output(func, inputs, "vhp")
    jac = _gradient(out, inputs, strict, "vhp")
    res = _fill(_vjp_raw(jac, inputs, v, create_graph), inputs, strict, "vhp")
    return _finish((out,), False, create_graph), _finish(res, in_tuple, create_graph)


def hvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), H v), computed as torch does: the double-vjp trick applied to the
    gradient (H^T u is linear in u; its vjp w.r.t. u is H v)."""
    in_tuple, inputs = _as_tuple(inputs, "inputs", "hvp")
    inputs = _prepare_inputs(inputs, create_graph)
    v = _check_v(v, inputs, "input", "hvp")
    out = _scalar_output(func, inputs, "hvp")
    jac = _gradient(out, inputs, strict, "hvp")
    us = tuple(C.zeros_like(t).requires_grad_() for t in inputs)
    double_back = _vjp_raw(jac, inputs, us, True)
    pairs = [(d, vi) for d, vi in zip(double_back, v) if d is not None and d.requires_grad]
    if pairs:
        res = _grad([d for d, _ in pairs], list(us), [vi for _, vi in pairs],
                    retain_graph=create_graph, create_graph=create_graph, allow_unused=True)
    else:
        res = (None,) * len(us)
    res = _fill(res, inputs, strict, "hvp")
    return _finish((out,), False, create_graph), _finish(res, in_tuple, create_graph)


# ---- full matrices -------------------------------------------------------------------

def jacobian(func, inputs, create_graph=False, strict=False, vectorize=False,
             strategy="reverse-mode"):
    """d func(inputs) / d inputs, one backward pass per output element.

    J[i][j] has shape outputs[i].shape + inputs[j].shape; a tensor when func takes and
    returns one tensor, a tuple when one side is a tuple, a tuple of tuples when both."""
    if strategy != "reverse-mode":
        raise NotImplementedError(f"jacobian: only strategy='reverse-mode' is implemented, "
                                  f"got {strategy!r}")
    in_tuple, inputs = _as_tuple(inputs, "inputs", "jacobian")
    inputs = _prepare_inputs(inputs, create_graph)
    out_tuple, outputs = _call(func, inputs, "jacobian")
    table = []
    for i, out in enumerate(outputs):
        rows = [[] for _ in inputs]                      # per input: one row per out element
        flat = out.reshape(-1) if out.requires_grad else None
        for k in range(out.numel()):
            if flat is None:
                grads = (None,) * len(inputs)
            else:
                grads = _grad(flat[k], list(inputs), retain_graph=True,
                              create_graph=create_graph, allow_unused=True)
            for j, g in enumerate(grads):
                if g is None:
                    if strict:
                        raise RuntimeError(f"Output {i} of the user-provided function is "
                                           f"independent of input {j}. This is not allowed in "
                                           "strict mode (jacobian).")
                    g = C.zeros_like(inputs[j])
                rows[j].append(g if create_graph else g.detach())
        blocks = []
        for j, r in enumerate(rows):
            shape = tuple(out.shape) + tuple(inputs[j].shape)
            if not r:                                    # an output with no elements
                blocks.append(C.zeros(*shape, dtype=inputs[j].dtype))
            elif create_graph:
                blocks.append(C.reshape(C.stack(r), shape))
            else:
                blocks.append(wrap(np.stack([g._data for g in r]).reshape(shape)))
        table.append(tuple(blocks))
    if out_tuple and in_tuple:
        return tuple(table)
    if out_tuple:
        return tuple(row[0] for row in table)
    if in_tuple:
        return table[0]
    return table[0][0]


def hessian(func, inputs, create_graph=False, strict=False, vectorize=False,
            outer_jacobian_strategy="reverse-mode"):
    """d^2 func / d inputs^2 for a func returning one element: the Jacobian of its
    gradient. H[i][j] has shape inputs[i].shape + inputs[j].shape (a tensor for one input)."""
    in_tuple, inputs = _as_tuple(inputs, "inputs", "hessian")

    def gradient(*xs):
        out = _scalar_output(func, xs, "hessian")
        g = _gradient(out, xs, strict, "hessian")
        return g if in_tuple else g[0]

    return jacobian(gradient, inputs if in_tuple else inputs[0], create_graph=create_graph,
                    strict=strict, strategy=outer_jacobian_strategy)
