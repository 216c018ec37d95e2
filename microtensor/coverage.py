"""Which of PyTorch's common names microtensor has: the table in docs/API.md.

    python -m microtensor.coverage            # print the table
    python -m microtensor.coverage --write    # rewrite docs/API.md (from a source checkout)
    python -m microtensor.coverage --check    # exit 1 when docs/API.md is stale

A name counts as implemented when it resolves in microtensor the way a torch script
spells it (`torch.X` -> `mt.X`, `Tensor.X` -> a Tensor method or attribute,
`F.X` -> `mt.nn.functional.X`, ...). A few rows are behaviours rather than names; each
has a probe that runs it. The list is what nanoGPT / minGPT / makemore-style code reaches
for, plus the neighbours a reader would look for next.
"""
import argparse
import os
import sys

# section -> names, as a torch script spells them after the section's prefix
NAMES = {
    "torch": """
        tensor as_tensor from_numpy zeros ones empty full zeros_like ones_like full_like
        empty_like rand randn randint rand_like randn_like randint_like randperm arange
        linspace logspace eye manual_seed seed initial_seed Generator default_generator
        get_rng_state set_rng_state
        cat concat stack hstack vstack column_stack split chunk tensor_split unbind reshape
        flatten unflatten squeeze unsqueeze permute transpose swapaxes movedim t narrow select
        index_select masked_select gather scatter scatter_add index_add take take_along_dim
        where nonzero argwhere tril triu tril_indices triu_indices diag diagonal diag_embed
        trace flip fliplr roll rot90 repeat_interleave tile broadcast_tensors broadcast_to
        broadcast_shapes meshgrid einsum matmul mm bmm mv dot inner outer tensordot addmm
        baddbmm cross kron cdist norm dist
        add sub mul div true_divide pow float_power neg abs exp exp2 expm1 log log2 log10
        log1p sqrt rsqrt sin cos tan asin acos atan atan2 sinh cosh tanh sigmoid logit relu
        erf erfc erfinv sign floor ceil round trunc frac clamp clip clamp_min clamp_max
        maximum minimum fmax fmin lerp xlogy reciprocal square floor_divide remainder fmod
        sum mean std var std_mean var_mean prod cumsum cumprod cummax logcumsumexp amax amin
        max min argmax argmin logsumexp softmax log_softmax sort argsort msort topk kthvalue
        median mode quantile unique unique_consecutive bincount histc count_nonzero any all
        allclose isclose equal isnan isinf isfinite isposinf isneginf nan_to_num eq ne lt le
        gt ge logical_and logical_or logical_not logical_xor multinomial bernoulli normal
        poisson no_grad enable_grad set_grad_enabled is_grad_enabled inference_mode
        is_inference_mode_enabled save load compile set_default_dtype get_default_dtype
        set_printoptions set_float32_matmul_precision use_deterministic_algorithms is_tensor
        is_floating_point numel float32 float64 float16 bfloat16 int64 int32 int16 int8
        uint8 bool long float double half device
        linalg.norm linalg.vector_norm linalg.matrix_norm linalg.inv linalg.solve linalg.det
        linalg.svd linalg.qr linalg.eigh linalg.cholesky
        autograd.grad autograd.backward autograd.Function autograd.function.once_differentiable
        autograd.gradcheck
        autograd.functional.jacobian autograd.functional.hessian
        cuda.is_available cuda.device_count cuda.manual_seed cuda.synchronize
        cuda.is_bf16_supported cuda.amp.GradScaler cuda.amp.autocast amp.autocast
        amp.GradScaler backends.cuda.matmul backends.cudnn backends.mps.is_available
        distributed.init_process_group distributed.destroy_process_group
        distributed.all_reduce distributed.barrier distributed.get_rank
        distributed.get_world_size utils.data.DataLoader utils.data.Dataset
        utils.checkpoint.checkpoint
    """,
    "Tensor": """
        shape dtype device ndim dim size numel nelement element_size item tolist numpy to
        cpu cuda float double long int bool half type type_as view view_as reshape
        reshape_as contiguous is_contiguous transpose permute t T mT unsqueeze squeeze
        flatten unflatten expand expand_as repeat repeat_interleave tile split chunk unbind narrow
        select gather scatter scatter_ scatter_add scatter_add_ index_select index_add_
        index_fill_ masked_fill masked_fill_ masked_select masked_scatter_ clone detach
        detach_ requires_grad requires_grad_ backward grad grad_fn is_leaf retain_grad
        register_hook data zero_ fill_ copy_ add_ sub_ mul_ div_ pow_ clamp_ normal_
        uniform_ bernoulli_ exponential_ random_ fill_diagonal_ exp log sqrt rsqrt abs pow
        sin cos tanh sigmoid relu sign floor ceil round clamp clamp_min sum mean std var
        prod max min amax amin argmax argmin logsumexp softmax log_softmax cumsum cumprod
        topk sort argsort kthvalue flip roll norm mm bmm mv dot outer matmul new_zeros
        new_ones new_full new_tensor new_empty tril triu diag diagonal trace all any
        nonzero unique bincount allclose isclose equal isnan isinf eq ne lt le gt ge
        is_floating_point pin_memory share_memory_ data_ptr stride apply_ where
    """,
    "F": """
        linear bilinear relu relu6 gelu silu sigmoid tanh softmax log_softmax softmin
        softplus leaky_relu elu selu celu mish hardtanh hardsigmoid hardswish logsigmoid
        softsign tanhshrink glu dropout embedding one_hot pad normalize layer_norm rms_norm
        batch_norm group_norm instance_norm cross_entropy nll_loss mse_loss l1_loss
        smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits
        kl_div cosine_similarity pairwise_distance scaled_dot_product_attention conv1d
        conv2d max_pool1d max_pool2d avg_pool1d avg_pool2d adaptive_avg_pool2d interpolate
        unfold gumbel_softmax
    """,
    "nn": """
        Module Parameter Buffer Linear Bilinear Embedding EmbeddingBag LayerNorm RMSNorm
        BatchNorm1d BatchNorm2d GroupNorm Dropout Identity Sequential ModuleList ModuleDict
        ParameterList ParameterDict ReLU GELU SiLU Tanh Sigmoid Softmax LogSoftmax Softmin
        LeakyReLU ELU SELU CELU Softplus Mish Hardtanh ReLU6 Hardsigmoid Hardswish
        LogSigmoid Softsign GLU Flatten Unflatten CrossEntropyLoss NLLLoss MSELoss L1Loss
        SmoothL1Loss HuberLoss BCELoss BCEWithLogitsLoss KLDivLoss MultiheadAttention
        TransformerEncoderLayer TransformerDecoderLayer TransformerEncoder TransformerDecoder
        Transformer Conv1d Conv2d MaxPool2d
        AvgPool2d LSTM GRU RNN
        init.normal_ init.uniform_ init.zeros_ init.ones_ init.constant_ init.xavier_uniform_
        init.xavier_normal_ init.kaiming_uniform_ init.kaiming_normal_ init.trunc_normal_
        init.orthogonal_ utils.clip_grad_norm_ utils.clip_grad_value_
        utils.parameters_to_vector parallel.DistributedDataParallel
    """,
    "optim": """
        Optimizer SGD Adam AdamW RMSprop Adagrad Adadelta Adamax NAdam RAdam LBFGS
        lr_scheduler.LambdaLR lr_scheduler.MultiplicativeLR lr_scheduler.StepLR
        lr_scheduler.MultiStepLR lr_scheduler.ConstantLR lr_scheduler.LinearLR
        lr_scheduler.ExponentialLR lr_scheduler.PolynomialLR lr_scheduler.CosineAnnealingLR
        lr_scheduler.CosineAnnealingWarmRestarts lr_scheduler.OneCycleLR
        lr_scheduler.CyclicLR lr_scheduler.SequentialLR lr_scheduler.ChainedScheduler
        lr_scheduler.ReduceLROnPlateau
    """,
}

# behaviours a torch script relies on that are not a single name: (row, probe)
def _probe_format():
    import microtensor as mt
    return format(mt.tensor(1.25), ".3f") == "1.250"


def _probe_device_arg():
    import microtensor as mt
    return mt.arange(0, 3, dtype=mt.long, device="cpu").tolist() == [0, 1, 2]


def _probe_module_to_device():
    import microtensor as mt
    return mt.nn.Linear(2, 2).to("cpu") is not None


def _probe_dtype_str():
    import microtensor as mt
    return str(mt.float32) == "mt.float32" and mt.zeros(1).dtype == mt.float32


def _probe_floordiv_mod():
    import microtensor as mt
    t = mt.tensor([7, -7])
    return (t // 2).tolist() == [3, -4] and (t % 3).tolist() == [1, 2]


def _probe_nested_save():
    import io
    import microtensor as mt
    buf = io.BytesIO()
    mt.save({"model": {"w": mt.ones(2)}, "iter_num": 3, "args": {"bias": False}}, buf)
    buf.seek(0)
    return mt.load(buf, map_location="cpu")["iter_num"] == 3


def _probe_no_grad_decorator():
    import microtensor as mt

    @mt.no_grad()
    def f(x):
        return x * 2
    return not f(mt.ones(1, requires_grad=True)).requires_grad


def _probe_keepdims_alias():
    import microtensor as mt
    return mt.ones(2, 3).sum(1, keepdims=True).shape == (2, 1)


FEATURES = [
    ("f-strings of 0-d tensors: f\"{loss:.4f}\"", _probe_format),
    ("device='cpu' on creation functions", _probe_device_arg),
    ("model.to('cpu') / model.to(device)", _probe_module_to_device),
    ("dtypes print as mt.float32 and compare with t.dtype", _probe_dtype_str),
    ("operators // and % (floor semantics)", _probe_floordiv_mod),
    ("save/load of nested checkpoints with map_location", _probe_nested_save),
    ("@no_grad() as a decorator", _probe_no_grad_decorator),
    ("numpy-style keepdims= alias", _probe_keepdims_alias),
]

_TITLES = {"torch": "`torch.*` (as `mt.*`)", "Tensor": "`Tensor` methods and attributes",
           "F": "`torch.nn.functional` (as `mt.nn.functional`)", "nn": "`torch.nn` (as `mt.nn`)",
           "optim": "`torch.optim` (as `mt.optim`)"}


def _resolve(section, dotted):
    """The object a torch script would reach, or None."""
    import microtensor as mt
    if section == "Tensor":
        if dotted in mt.Tensor.__dict__ or any(dotted in k.__dict__ for k in mt.Tensor.__mro__):
            return getattr(mt.Tensor, dotted, True)
        rows = {row.name: row for row in mt.core._core.registered_ops()}
        row = rows.get(dotted)
        return None if row is None or row.method is None else row.method
    obj = {"torch": mt, "F": mt.nn.functional, "nn": mt.nn, "optim": mt.optim}[section]
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except Exception:           # noqa: BLE001 - a missing name is the answer
            return None
    return obj


def _where(obj):
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str) or not module.startswith("microtensor"):
        return ""
    return module


def rows():
    """[(section, name, implemented, where)] for every name, then the feature probes."""
    out = []
    for section, text in NAMES.items():
        for name in text.split():
            obj = _resolve(section, name)
            out.append((section, name, obj is not None, _where(obj) if obj is not None else ""))
    for label, probe in FEATURES:
        try:
            ok = bool(probe())
        except Exception:           # noqa: BLE001 - a failing probe means "not yet"
            ok = False
        out.append(("features", label, ok, ""))
    return out


def render():
    table = rows()
    lines = [
        "# API coverage: PyTorch names in microtensor",
        "",
        "Generated by `python -m microtensor.coverage --write` from the code; a test "
        "(`tests/test_dialect.py`) fails when this file differs from what the code gives. "
        "A name is implemented when it resolves in microtensor the way a torch script spells "
        "it (`torch.X` as `mt.X`, `Tensor.X` as a method or attribute, `F.X` as "
        "`mt.nn.functional.X`); each implemented function follows PyTorch's semantics and is "
        "compared with torch in the tests (gradients checked in float64 where it is "
        "differentiable). `where` is the module that defines it; a **no** is a name a "
        "torch script may reach for that is not there yet.",
        "",
        "| section | implemented | of |",
        "| --- | ---: | ---: |",
    ]
    sections = list(NAMES) + ["features"]
    for section in sections:
        got = [r for r in table if r[0] == section]
        title = _TITLES.get(section, "behaviours")
        lines.append(f"| {title} | {sum(r[2] for r in got)} | {len(got)} |")
    total = len(table)
    lines.append(f"| **all** | **{sum(r[2] for r in table)}** | **{total}** |")
    for section in sections:
        title = _TITLES.get(section, "Behaviours a torch script relies on")
        lines += ["", f"## {title}", "", "| name | | where |", "| --- | --- | --- |"]
        for _, name, ok, where in (r for r in table if r[0] == section):
            shown = f"`{name}`" if section != "features" else name
            lines.append(f"| {shown} | {'yes' if ok else '**no**'} | {where} |")
    return "\n".join(lines) + "\n"


def default_path():
    """docs/API.md of the source checkout this module sits in."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "docs", "API.md")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m microtensor.coverage",
                                     description="PyTorch API coverage table (docs/API.md)")
    parser.add_argument("--write", action="store_true", help="rewrite the file")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    parser.add_argument("--path", default=None, help="default: docs/API.md of this checkout")
    args = parser.parse_args(argv)
    path = args.path or default_path()
    text = render()
    if args.write:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path}")
        return 0
    if args.check:
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 1
        if current != text:
            print(f"error: {path} is stale; run python -m microtensor.coverage --write",
                  file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
