"""Every op of the op table against PyTorch: values and gradients (optional oracle)."""
import numpy as np
import pytest

import microtensor as mt
from test_ops import OPS, make_inputs

torch = pytest.importorskip("torch")

# the same op written for torch (most table entries use methods torch shares)
TORCH = {
    "matmul_batched": torch.matmul, "matmul_3d_2d": torch.matmul, "matmul_vec": torch.matmul,
    "matmul_mat_vec": torch.matmul, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "abs": torch.abs,
    "var_correction0": lambda x: torch.var(x, 0, keepdim=True, correction=0),
    "softmax_dim0": lambda x: torch.softmax(x, 0),
    "masked_fill": lambda x: x.masked_fill(torch.tensor([[True, False, True]]), -1.5),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "cat": lambda a, b: torch.cat([a, b], dim=1),
    "stack": lambda a, b: torch.stack([a, b], dim=-1),
    "tril": lambda x: torch.tril(x, diagonal=-1), "triu": torch.triu,
    "index_gather": lambda x: x[torch.tensor([0, 2, 0, 0])],
    "index_gather_2d": lambda x: x[:, torch.tensor([[1, 1], [0, 3]])],
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_values_and_gradients_equal_torch(name):
    fn = OPS[name][0]
    tfn = TORCH.get(name, fn)
    arrays = make_inputs(name)
    ours = [mt.tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, tout = fn(*ours), tfn(*theirs)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-10, atol=1e-12)
    upstream = np.random.default_rng(1).standard_normal(out.shape)
    out.backward(mt.tensor(upstream))
    tout.backward(torch.tensor(upstream))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=f"{name}: gradient of input {i}")
