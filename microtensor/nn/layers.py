"""The layers: each holds its parameters and calls the matching F.* op in forward.

Parameters are float32 unless `dtype=` says otherwise; `module.double()` casts them
in place for float64 gradient checks. Initialisations are torch's defaults.
"""
import math

import numpy as np

from microtensor.core._core import Parameter, as_dtype
from microtensor.nn import functional as F
from microtensor.nn import init
from microtensor.nn.module import Module


def _parameter(shape, dtype):
    dtype = as_dtype(dtype) or np.dtype(np.float32)
    if dtype.kind != "f":
        raise TypeError(f"parameters must have a floating point dtype, got {dtype}")
    return Parameter(np.empty(shape, dtype=dtype))


def _size(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class Identity(Module):
    """y = x (arguments are accepted and ignored, as torch does)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):
        return input


class Linear(Module):
    """y = x @ W^T + b, with W (out_features, in_features) and b (out_features,),
    both ~ U(-1/sqrt(in_features), 1/sqrt(in_features)) at first (torch's default)."""

    def __init__(self, in_features, out_features, bias=True, dtype=None):
        super().__init__()
        self.in_features = _size(in_features, "in_features")
        self.out_features = _size(out_features, "out_features")
        self.weight = _parameter((self.out_features, self.in_features), dtype)
        if bias:
            self.bias = _parameter((self.out_features,), dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # torch's kaiming_uniform_(a=sqrt(5)) works out to this bound, for weight and bias
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """y = W[idx], a lookup table W (num_embeddings, embedding_dim) ~ N(0, 1) at first;
    the row padding_idx (if given) starts at zero and gets no gradient."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, dtype=None):
        super().__init__()
        self.num_embeddings = _size(num_embeddings, "num_embeddings")
        self.embedding_dim = _size(embedding_dim, "embedding_dim")
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings "
                                 f"({self.num_embeddings})")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.weight = _parameter((self.num_embeddings, self.embedding_dim), dtype)
        self.reset_parameters()

    def reset_parameters(self):
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight._data[self.padding_idx] = 0

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s if self.padding_idx is None else s + f", padding_idx={self.padding_idx}"


class Dropout(Module):
    """Zeroes each element with probability p and scales the rest by 1/(1-p) while
    training; the identity in eval mode."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) \
                or not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = float(p)
        self.inplace = inplace

    def forward(self, input):
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"


class ReLU(Module):
    """y = max(x, 0)"""

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):
        return F.relu(input)

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""


class GELU(Module):
    """y = x * Phi(x) (approximate='none') or its tanh approximation ('tanh')."""

    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input):
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate='{self.approximate}'"


class SiLU(Module):
    """y = x * sigmoid(x)"""

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):
        return F.silu(input)

    def extra_repr(self):
        return "inplace=True" if self.inplace else ""


class Tanh(Module):
    """y = tanh(x)"""

    def forward(self, input):
        return F.tanh(input)
