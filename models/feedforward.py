"""The position-wise MLP: widen, apply a nonlinearity, project back."""
from microtensor import nn
from microtensor.nn import functional as F

from models.config import check_choice, MLPS


class FeedForward(nn.Module):
    """gelu/gelu_tanh/relu:  y = c_proj(act(c_fc(x)));   swiglu:  y = c_proj(silu(a) * b), [a, b] = c_fc(x).

    For SwiGLU, c_fc is Linear(d_model, 2 * d_ff): the gate and the value projections
    fused into one matmul, split afterwards (as attention's c_attn fuses q, k, v).
    gelu is the exact x * Phi(x); gelu_tanh its tanh approximation, which GPT-2 was
    trained with (Hugging Face's 'gelu_new').
    """

    def __init__(self, d_model, d_ff, activation="gelu", bias=True, dropout=0.0):
        super().__init__()
        check_choice("activation", activation, MLPS)
        self.activation, self.d_ff = activation, d_ff
        width = 2 * d_ff if activation == "swiglu" else d_ff
        self.c_fc = nn.Linear(d_model, width, bias=bias)
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, d_ff), or (B, T, 2 * d_ff) for swiglu
        if self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        elif self.activation == "relu":
            h = F.relu(h)
        else:
            gate, value = h.split(self.d_ff, dim=-1)  # 2 x (B, T, d_ff)
            h = F.silu(gate) * value
        return self.dropout(self.c_proj(h))
