"""mt.nn.functional: the stateless layers of a Transformer, in PyTorch's dialect.

    import microtensor.nn.functional as F
    logits = F.linear(x, W, b)
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))

A face, as `mt.linalg` is: every function here lives in microtensor/ops/, one file per
family, beside its Backward node and its registry row:

    ops/layers.py          linear, embedding, dropout
    ops/activations.py     relu, sigmoid, tanh, softmax, log_softmax, gelu, silu
    ops/normalization.py   layer_norm, rms_norm
    ops/losses.py          cross_entropy, nll_loss, mse_loss
    ops/attention.py       scaled_dot_product_attention
    ops/functional_extra.py  the rest of torch.nn.functional (pad, one_hot, the other
                           losses and activations, normalize, batch_norm, ...)
    ops/rope.py            rotary_embedding
"""
from microtensor.ops import _kernels  # noqa: F401  (the build of the fused kernels: F._kernels)
from microtensor.ops._functional_common import (  # noqa: F401  (F._threads etc.)
    declare_saved, _cpu_has_avx2_fma, DtypeError, _tensor, _float_array,
    _same_dtype, _contig, _owned_indices, _grad_as, _PARALLEL_MIN, _PARALLEL_MIN_MEMORY_BOUND,
    _threads, _wants_grad, _check_reduction, _unbroadcast,
)
from microtensor.ops.layers import (  # noqa: F401
    LinearBackward, linear, EmbeddingBackward, embedding, DropoutBackward, dropout,
)
from microtensor.ops.activations import (
    relu, sigmoid, tanh, SoftmaxBackward, LogSoftmaxBackward, _rows_backward, _softmax_like,
    softmax, log_softmax, GeluBackward, gelu, SiluBackward, silu,
)
from microtensor.ops.normalization import (
    _norm_rows, _check_affine, _partials, LayerNormBackward, layer_norm, RMSNormBackward,
    rms_norm,
)
from microtensor.ops.losses import (
    _ce_rows, CrossEntropyBackward, cross_entropy, nll_loss, MSELossBackward, mse_loss,
)
from microtensor.ops.attention import (
    _ATTENTION_BLOCK_CAUSAL, _ATTENTION_BLOCK, _attention_mask, _mask_slabs,
    AttentionBackward, scaled_dot_product_attention,
)

# pad, one_hot, the other losses and activations, normalize, batch_norm
from microtensor.ops.functional_extra import *  # noqa: F401,F403
from microtensor.ops.rope import rotary_embedding  # noqa: F401

__all__ = [
    "linear", "relu", "gelu", "silu", "sigmoid", "tanh", "softmax", "log_softmax",
    "cross_entropy", "nll_loss", "mse_loss", "layer_norm", "rms_norm", "embedding",
    "dropout", "scaled_dot_product_attention",
]
