"""mt.nn: modules, layers and the functional API.

    import microtensor.nn as nn
    import microtensor.nn.functional as F

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(16, 64)
            self.c_proj = nn.Linear(64, 16)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))
"""
from microtensor.core._core import Parameter
from microtensor.nn import functional
from microtensor.nn import init
from microtensor.nn import utils
from microtensor.nn import parallel
from microtensor.nn.module import Module, StateDictError
from microtensor.nn.containers import (
    Sequential, ModuleList, ModuleDict, ParameterList, ParameterDict,
)
from microtensor.nn.layers import Linear, Embedding, Dropout, ReLU, GELU, SiLU, Tanh, Identity
from microtensor.nn.activations import (
    Sigmoid, Softmax, LogSoftmax, Softmin, LeakyReLU, ELU, SELU, CELU, Softplus, Mish,
    Hardtanh, ReLU6, Hardsigmoid, Hardswish, LogSigmoid, Softsign, Tanhshrink, GLU, Flatten,
    Unflatten,
)
from microtensor.nn.losses import (
    CrossEntropyLoss, NLLLoss, MSELoss, L1Loss, SmoothL1Loss, HuberLoss, BCELoss,
    BCEWithLogitsLoss, KLDivLoss,
)
from microtensor.nn.normalization import LayerNorm, RMSNorm, BatchNorm1d
from microtensor.nn.multihead_attention import MultiheadAttention
from microtensor.nn.transformer import (
    Transformer, TransformerEncoder, TransformerDecoder, TransformerEncoderLayer,
    TransformerDecoderLayer,
)

# F's ops are registry rows (scope "F"): the profiler times them and mt.compile records
# them by their rows; nn.init's fills are registered with the profiler by the package's
# __init__ (the profiler is a layer above nn)
# mt.compile replays a plan only while each module it called has the training flag it
# had when recorded
from microtensor import capture as _capture  # noqa: E402
_capture.register_guard(Module, "training")
from microtensor.capture import rewrites as _rewrites  # noqa: E402,F401  (mt.compile's rules for nn's ops)

__all__ = ["Parameter", "Module", "Sequential", "ModuleList", "ModuleDict", "StateDictError",
           "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "ReLU", "GELU", "SiLU",
           "Tanh", "Identity", "functional", "init", "utils", "parallel", "BatchNorm1d",
           "Sigmoid", "Softmax", "LogSoftmax", "Softmin", "LeakyReLU", "ELU", "SELU", "CELU",
           "Softplus", "Mish", "Hardtanh", "ReLU6", "Hardsigmoid", "Hardswish", "LogSigmoid",
           "Softsign", "Tanhshrink", "GLU", "Flatten", "Unflatten", "CrossEntropyLoss",
           "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "BCELoss",
           "BCEWithLogitsLoss", "KLDivLoss", "ParameterList", "ParameterDict",
           "MultiheadAttention", "Transformer", "TransformerEncoder", "TransformerDecoder",
           "TransformerEncoderLayer", "TransformerDecoderLayer"]
