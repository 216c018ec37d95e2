"""mt.nn.functional: the stateless layers of a Transformer, in PyTorch's dialect.

    import microtensor.nn.functional as F
    logits = F.linear(x, W, b)
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))

A face, as `mt.linalg` is: every function here lives in microtensor/ops/, one file per
family, beside its Backward node and its registry row:

    ops/layers.py          linear, embedding, dropout
    ops/activations.py     relu, sigmoid, tanh, softmax, log_softmax, gelu, silu, and the
                           rest of torch's (elu, leaky_relu, softplus, glu, softmin, ...)
    ops/normalization.py   layer_norm, rms_norm, batch_norm
    ops/losses.py          cross_entropy, nll_loss, mse_loss, and the rest of torch's
                           (binary_cross_entropy, l1_loss, kl_div, ...)
    ops/attention.py       scaled_dot_product_attention
    ops/distance.py        normalize, cosine_similarity, pairwise_distance
    ops/padding.py         pad, one_hot
    ops/rope.py            rotary_embedding
"""
from microtensor.ops import _kernels  # noqa: F401  (the build of the fused kernels: F._kernels)
from microtensor.ops._functional_common import (  # noqa: F401  (F._threads etc.)
    declare_saved, _cpu_has_avx2_fma, DtypeError, _tensor, _float_array,
    _same_dtype, _contig, _owned_indices, _grad_as, _PARALLEL_MIN, _PARALLEL_MIN_MEMORY_BOUND,
    _threads, _wants_grad, _check_reduction,
)
from microtensor.ops.layers import (  # noqa: F401
    LinearBackward, linear, EmbeddingBackward, embedding, DropoutBackward, dropout,
)
from microtensor.ops.activations import (  # noqa: F401
    relu, sigmoid, tanh, SoftmaxBackward, LogSoftmaxBackward, _rows_backward, _softmax_like,
    softmax, log_softmax, GeluBackward, gelu, SiluBackward, silu,
    softplus, leaky_relu, elu, selu, celu, relu6, hardtanh, hardsigmoid, hardswish, mish,
    logsigmoid, softsign, softmin, tanhshrink, glu, gumbel_softmax,
)
from microtensor.ops.normalization import (  # noqa: F401
    _norm_rows, _check_affine, _partials, LayerNormBackward, layer_norm, RMSNormBackward,
    rms_norm, batch_norm,
)
from microtensor.ops.losses import (  # noqa: F401
    _ce_rows, CrossEntropyBackward, cross_entropy, nll_loss, MSELossBackward, mse_loss,
    BinaryCrossEntropyBackward, binary_cross_entropy, binary_cross_entropy_with_logits,
    l1_loss, smooth_l1_loss, huber_loss, kl_div,
)
from microtensor.ops.attention import (
    _ATTENTION_BLOCK_CAUSAL, _ATTENTION_BLOCK, _attention_mask, _mask_slabs,
    AttentionBackward, scaled_dot_product_attention,
)
from microtensor.ops.distance import normalize, cosine_similarity, pairwise_distance  # noqa: F401
from microtensor.ops.padding import ConstantPadBackward, pad, one_hot  # noqa: F401
from microtensor.ops.rope import rotary_embedding  # noqa: F401

__all__ = [
    "linear", "relu", "gelu", "silu", "sigmoid", "tanh", "softmax", "log_softmax",
    "cross_entropy", "nll_loss", "mse_loss", "layer_norm", "rms_norm", "embedding",
    "dropout", "scaled_dot_product_attention",
]
