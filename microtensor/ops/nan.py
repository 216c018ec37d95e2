"""Elementwise ops that treat NaN as a missing value: fmax and fmin.

`maximum(a, b)` gives NaN when either side is NaN; `fmax(a, b)` gives the other side,
and NaN only where both are NaN (numpy's and torch's fmax). These two ops are the worked
example of docs/ADDING_AN_OP.md: each is one rule (a node whose gradient is written once,
in differentiable ops), one registry row, and one line in the op table of
tests/test_ops.py.
"""
import numpy as np

import microtensor.core._core as _core
from microtensor.core._core import Tensor, wrap, needs_graph, attach, register_op
from microtensor.ops._common import declare_saved
from microtensor.autograd.graph_rules import DifferentiableRule


class FmaxBackward(DifferentiableRule):
    """y = fmax(a, b);  da = g where a was taken (a >= b, or b is NaN),  db = g elsewhere"""

    def create_graph(self, g):
        """The gradient, in differentiable ops: first order and gradients of gradients."""
        took_a, zero = wrap(self.took_a), _core.zeros_like(g)
        return (_core.where(took_a, g, zero), _core.where(took_a, zero, g))


declare_saved(FmaxBackward)     # the rule reads its own mask, not the inputs


def _fmax_like(input, other, take_larger):
    for t, what in ((input, "input"), (other, "other")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{'fmax' if take_larger else 'fmin'}(): {what} must be a Tensor, "
                            f"got {type(t).__name__}")
    a, b = input._data, other._data
    try:
        out = np.fmax(a, b) if take_larger else np.fmin(a, b)
    except ValueError:
        raise _core.ShapeError(f"{'fmax' if take_larger else 'fmin'}: shapes {a.shape} and "
                               f"{b.shape} cannot be broadcast together") from None
    y = wrap(out)
    if needs_graph((input, other)) and out.dtype.kind == "f":
        node = FmaxBackward()
        with np.errstate(invalid="ignore"):
            node.took_a = ((a >= b) if take_larger else (a <= b)) | np.isnan(b)
        attach(y, node, (input, other))
    return y


def fmax(input, other):
    """Elementwise max that ignores NaN: NaN only where both are NaN"""
    return _fmax_like(input, other, True)


def fmin(input, other):
    """Elementwise min that ignores NaN: NaN only where both are NaN"""
    return _fmax_like(input, other, False)


register_op("fmax", fmax, kind="pointwise")
register_op("fmin", fmin, kind="pointwise")
