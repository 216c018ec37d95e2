"""Loss modules: each holds its options (reduction, ignore_index, ...) and calls the
matching F.* loss in forward, as torch's do: `criterion = nn.CrossEntropyLoss();
loss = criterion(logits, targets)`."""
from microtensor.nn import functional as F
from microtensor.nn.module import Module

__all__ = ["CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
           "BCELoss", "BCEWithLogitsLoss", "KLDivLoss"]

_REDUCTIONS = ("mean", "sum", "none")


class _Loss(Module):
    def __init__(self, reduction="mean", allowed=_REDUCTIONS):
        super().__init__()
        if reduction not in allowed:
            raise ValueError(f"{type(self).__name__}: reduction must be one of {allowed}, got "
                             f"{reduction!r}")
        self.reduction = reduction


class CrossEntropyLoss(_Loss):
    """-log softmax(logits)[target], averaged over targets that are not ignore_index"""

    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, input, target):
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class NLLLoss(_Loss):
    """-input[target], input holding log-probabilities"""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean"):
        from microtensor.ops.losses import _legacy_reduction
        super().__init__(_legacy_reduction(size_average, reduce, reduction))
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index

    def forward(self, input, target):
        return F.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                          reduction=self.reduction)


class MSELoss(_Loss):
    """(x - y)^2, reduced"""

    def forward(self, input, target):
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    """|x - y|, reduced"""

    def forward(self, input, target):
        return F.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
    """quadratic below beta, linear above"""

    def __init__(self, reduction="mean", beta=1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
    """quadratic below delta, delta-scaled linear above"""

    def __init__(self, reduction="mean", delta=1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class BCELoss(_Loss):
    """-w (t log x + (1-t) log(1-x)) for probabilities x"""

    def __init__(self, weight=None, reduction="mean"):
        super().__init__(reduction)
        self.weight = weight

    def forward(self, input, target):
        return F.binary_cross_entropy(input, target, self.weight, self.reduction)


class BCEWithLogitsLoss(_Loss):
    """BCE of sigmoid(x), computed stably from the logits x"""

    def __init__(self, weight=None, reduction="mean", pos_weight=None):
        super().__init__(reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input, target):
        return F.binary_cross_entropy_with_logits(input, target, self.weight, self.reduction,
                                                   self.pos_weight)


class KLDivLoss(_Loss):
    """target (log target - input), input holding log-probabilities"""

    def __init__(self, reduction="mean", log_target=False):
        super().__init__(reduction, _REDUCTIONS + ("batchmean",))
        self.log_target = log_target

    def forward(self, input, target):
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)
