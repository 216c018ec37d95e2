"""mt.autograd: gradients without touching .grad, anomaly detection, gradcheck.

The engine itself (the Node type and the backward traversal) lives in
`core/engine.pxi`; this package is its public face. Higher-order gradients
(`create_graph=True`): each node's `create_graph` rule, run by `higher_order.py`. `grad`
and `backward` are in `gradients.py`; Jacobians, Hessians and
vector products: `mt.autograd.functional`.
"""
import numpy as np

from microtensor.core._core import (
    Tensor, Node, run_backward, wrap, needs_graph, attach, no_grad, enable_grad, set_grad_enabled,
    is_grad_enabled, detect_anomaly, AnomalyError, is_anomaly_enabled,
)
from microtensor.autograd.gradcheck import gradcheck, gradgradcheck, GradcheckError

__all__ = ["grad", "backward", "gradcheck", "gradgradcheck", "GradcheckError", "detect_anomaly",
           "AnomalyError", "Function", "FunctionCtx", "once_differentiable", "function", "Node",
           "no_grad", "enable_grad", "functional"]


from microtensor.autograd.gradients import grad, backward  # noqa: E402
# the engine runs each node's create-graph rule through higher_order, which registers
# itself with the core when imported (the core imports nothing above it)
from microtensor.autograd import higher_order  # noqa: E402,F401
from microtensor.autograd import function  # noqa: E402
from microtensor.autograd.function import Function, FunctionCtx, once_differentiable  # noqa: E402
from microtensor.autograd import functional  # noqa: E402
