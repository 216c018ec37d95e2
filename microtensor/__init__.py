"""microtensor: a readable autograd engine in Cython on numpy, in PyTorch's dialect.

    import microtensor as mt
    x = mt.randn(3, 4, requires_grad=True)
    (x.tanh() * 2).sum().backward()
    x.grad
"""
from microtensor import _core
from microtensor._core import (
    Tensor, Parameter, ShapeError, Node,
    float32, float64, int64, int32, uint8, bool_ as bool,
    tensor, from_numpy, zeros, ones, empty, full, zeros_like, ones_like, full_like,
    arange, linspace, randn, rand, randint, randperm, multinomial,
    manual_seed, get_rng_state, set_rng_state, default_generator,
    no_grad, enable_grad, set_grad_enabled, is_grad_enabled,
    add, sub, mul, div, pow, neg, exp, log, sqrt, tanh, sigmoid, relu, abs, clamp,
    where, masked_fill, lt, le, gt, ge, eq, ne, logical_not, logical_and, logical_or,
    isnan, isfinite, maximum, minimum,
    sum, mean, var, std, amax, amin, max, min, argmax, argmin, softmax, log_softmax,
    logsumexp, reshape, view, flatten, unsqueeze, squeeze, permute, transpose, expand,
    contiguous, split, chunk, cat, stack, tril, triu, getitem, index_select, matmul,
    set_num_threads, get_num_threads,
)
from microtensor import autograd
from microtensor.autograd import gradcheck
from microtensor import nn, optim
from microtensor import inspect
from microtensor.threads import set_blas_threads, get_blas_threads, blas_info, set_threads
from microtensor.serialization import save, load
# mt.distributed: importing it does not import mpi4py (only distributed.init() under MPI does)
from microtensor import distributed

clip = clamp
concat = cat
divide = div
multiply = mul
float = float32
double = float64
long = int64

__version__ = "0.1.0"


def is_tensor(obj):
    return isinstance(obj, Tensor)


def numel(t):
    return t.numel()
