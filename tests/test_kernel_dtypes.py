"""Every op that runs a Cython kernel, fed a dtype its kernels were not compiled for.

The kernels take float32 and float64. Anything else (float16, integers, bool) must come
out either as torch's result (its dtype and values, and for float16 its gradient) or as
a TypeError that names the dtype: never a "No matching signature found" from Cython's
dispatch, never numbers cast from the wrong type, never a crash.
"""
import numpy as np
import pytest

import microtensor as mt
import microtensor.nn.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

pytestmark = pytest.mark.usefixtures("one_thread")

_x = np.array([[-2.0, -0.5, 0.0, 0.5, 1.0, 3.0], [4.0, -1.0, 2.0, 0.25, -3.0, 1.5]])


def _rows():
    return np.array([1, 4])


# name: (microtensor op, torch op), each taking one tensor made from _x
OPS = {
    "relu": (F.relu, TF.relu),
    "sigmoid": (F.sigmoid, torch.sigmoid),
    "tanh": (F.tanh, torch.tanh),
    "exp": (mt.exp, torch.exp),
    "log": (lambda x: mt.log(mt.exp(x)), lambda x: torch.log(torch.exp(x))),
    "sqrt": (lambda x: mt.sqrt(mt.exp(x)), lambda x: torch.sqrt(torch.exp(x))),
    "abs": (mt.abs, torch.abs),
    "clamp": (lambda x: mt.clamp(x, -1, 2), lambda x: torch.clamp(x, -1, 2)),
    "amax_dim": (lambda x: mt.amax(x, 1), lambda x: torch.amax(x, 1)),
    "max_dim": (lambda x: mt.max(x, 1)[0], lambda x: torch.max(x, 1)[0]),
    "index_rows": (lambda x: x[mt.tensor(np.array([1, 0, 1]))],
                   lambda x: x[torch.tensor([1, 0, 1])]),
    "softmax": (lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1)),
    "log_softmax": (lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1)),
    "gelu": (F.gelu, TF.gelu),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda x: TF.gelu(x, approximate="tanh")),
    "silu": (F.silu, TF.silu),
    "layer_norm": (lambda x: F.layer_norm(x, (6,)), lambda x: TF.layer_norm(x, (6,))),
    "rms_norm": (lambda x: F.rms_norm(x, (6,), eps=1e-5), lambda x: TF.rms_norm(x, (6,), eps=1e-5)),
    "linear": (lambda x: F.linear(x, x), lambda x: TF.linear(x, x)),
    "cross_entropy": (lambda x: F.cross_entropy(x, mt.tensor(_rows())),
                      lambda x: TF.cross_entropy(x, torch.from_numpy(_rows()))),
    "mse_loss": (lambda x: F.mse_loss(x, x * 0), lambda x: TF.mse_loss(x, x * 0)),
    "embedding": (lambda x: F.embedding(mt.tensor(np.array([1, 0])), x),
                  lambda x: TF.embedding(torch.tensor([1, 0]), x)),
    "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False),
                     lambda x: TF.dropout(x, 0.5, training=False)),
    "attention": (lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),
                  lambda x: TF.scaled_dot_product_attention(x[None], x[None], x[None])),
}

DTYPES = ["float16", "int32", "int64", "bool"]


def _refused(err, dtype):
    """A TypeError (microtensor's DtypeError is one) whose message names the dtype."""
    return isinstance(err, TypeError) and dtype in str(err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_kernel_op_gives_torch_result_or_names_the_dtype(op, dtype):
    mt_fn, torch_fn = OPS[op]
    x = _x.astype(dtype)
    grad = dtype == "float16"
    t_in = torch.tensor(x, requires_grad=grad)
    try:
        expected = torch_fn(t_in)
    except (RuntimeError, TypeError, NotImplementedError):
        expected = None
    try:
        ours_in = mt.tensor(x, requires_grad=grad)
    except TypeError as e:                                # microtensor's policy: float16
        assert dtype in str(e)                            # data, no float16 gradients
        ours_in, grad = mt.tensor(x), False
    try:
        out = mt_fn(ours_in)
    except Exception as e:                                # noqa: BLE001 - judged below
        assert _refused(e, dtype), f"{op}({dtype}) raised {type(e).__name__}: {e}"
        return
    assert expected is not None, f"{op}({dtype}) gave a result where torch refuses the dtype"
    assert str(out.dtype).replace("mt.", "") == str(expected.dtype).replace("torch.", ""), \
        f"{op}({dtype}): dtype {out.dtype}, torch {expected.dtype}"
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == "float16" else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.numpy().astype(np.float64),
                               expected.detach().numpy().astype(np.float64), **tol,
                               err_msg=f"{op}({dtype})")
    if grad:
        up = np.random.default_rng(0).standard_normal(expected.shape).astype(dtype)
        out.backward(mt.tensor(up))
        expected.backward(torch.from_numpy(up))
        assert ours_in.grad.dtype == out.dtype
        np.testing.assert_allclose(ours_in.grad.numpy().astype(np.float64),
                                   t_in.grad.numpy().astype(np.float64), rtol=1e-2, atol=1e-2,
                                   err_msg=f"{op}({dtype}) gradient")


@pytest.mark.parametrize("op", ["relu", "sigmoid", "exp", "tanh"])
def test_complex_tensors_are_refused_by_name(op):
    """Casting a complex tensor to float would drop its imaginary part without a word."""
    x = mt.tensor(np.array([1 + 2j, -1 - 1j], np.complex64))
    with pytest.raises(TypeError, match="complex64"):
        OPS[op][0](x)
