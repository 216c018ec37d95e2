"""Activation modules and shape modules: each holds its settings and calls the matching
F.* function in forward (torch's names, arguments and printed form)."""
from microtensor.core import _core
from microtensor.nn import functional as F
from microtensor.nn.module import Module

__all__ = ["Sigmoid", "Softmax", "LogSoftmax", "Softmin", "LeakyReLU", "ELU", "SELU", "CELU",
           "Softplus", "Mish", "Hardtanh", "ReLU6", "Hardsigmoid", "Hardswish", "LogSigmoid",
           "Softsign", "Tanhshrink", "GLU", "Flatten", "Unflatten"]


class Sigmoid(Module):
    """y = 1 / (1 + e^-x)"""

    def forward(self, input):
        return F.sigmoid(input)


class Softmax(Module):
    """y = e^x / sum(e^x) along dim"""

    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.softmax(input, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """y = x - logsumexp(x) along dim"""

    def forward(self, input):
        return F.log_softmax(input, self.dim)


class Softmin(Softmax):
    """y = softmax(-x) along dim"""

    def forward(self, input):
        return F.softmin(input, self.dim)


class LeakyReLU(Module):
    """y = x where x > 0, else negative_slope * x"""

    def __init__(self, negative_slope=0.01, inplace=False):
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, input):
        return F.leaky_relu(input, self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace else "")


class ELU(Module):
    """y = x where x > 0, else alpha (e^x - 1)"""

    def __init__(self, alpha=1.0, inplace=False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, input):
        return F.elu(input, self.alpha)

    def extra_repr(self):
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class CELU(ELU):
    """y = x where x > 0, else alpha (e^(x/alpha) - 1)"""

    def forward(self, input):
        return F.celu(input, self.alpha)


class SELU(Module):
    """y = scale * elu(x, alpha) (the self-normalizing constants)"""

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):
        return F.selu(input)


class Softplus(Module):
    """y = log(1 + e^(beta x)) / beta, linear above threshold"""

    def __init__(self, beta=1.0, threshold=20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, input):
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self):
        return f"beta={self.beta}, threshold={self.threshold}"


class Hardtanh(Module):
    """y = clamp(x, min_val, max_val)"""

    def __init__(self, min_val=-1.0, max_val=1.0, inplace=False):
        super().__init__()
        if max_val <= min_val:
            raise ValueError(f"Hardtanh: max_val ({max_val}) must be greater than min_val "
                             f"({min_val})")
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, input):
        return F.hardtanh(input, self.min_val, self.max_val)

    def extra_repr(self):
        return f"min_val={self.min_val}, max_val={self.max_val}"


class ReLU6(Hardtanh):
    """y = clamp(x, 0, 6)"""

    def __init__(self, inplace=False):
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""


def _simple(name, fn, doc):
    """A module with no settings that applies `fn`."""
    def forward(self, input):
        return fn(input)
    cls = type(name, (Module,), {"forward": forward, "__doc__": doc,
                                 "__module__": __name__})
    return cls


Mish = _simple("Mish", F.mish, "y = x tanh(softplus(x))")
Hardsigmoid = _simple("Hardsigmoid", F.hardsigmoid, "y = clamp(x / 6 + 1/2, 0, 1)")
Hardswish = _simple("Hardswish", F.hardswish, "y = x hardsigmoid(x)")
LogSigmoid = _simple("LogSigmoid", F.logsigmoid, "y = log sigmoid(x)")
Softsign = _simple("Softsign", F.softsign, "y = x / (1 + |x|)")
Tanhshrink = _simple("Tanhshrink", F.tanhshrink, "y = x - tanh(x)")


class GLU(Module):
    """y = a sigmoid(b), (a, b) the halves of x along dim"""

    def __init__(self, dim=-1):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.glu(input, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class Flatten(Module):
    """Flattens dims start_dim..end_dim into one (the batch dim 0 is kept by default)."""

    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):
        return _core.flatten(input, self.start_dim, self.end_dim)

    def extra_repr(self):
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    """Splits dim into unflattened_size (one entry may be -1)."""

    def __init__(self, dim, unflattened_size):
        super().__init__()
        if not isinstance(unflattened_size, (tuple, list)):
            raise TypeError(f"unflattened_size must be a tuple of ints, got "
                            f"{type(unflattened_size).__name__}")
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input):
        return _core.unflatten(input, self.dim, self.unflattened_size)

    def extra_repr(self):
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"
