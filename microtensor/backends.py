"""torch.backends as a CPU-only build has it: flags a training script sets
(`torch.backends.cuda.matmul.allow_tf32 = True`) are accepted and change nothing here;
`is_available()` is False for every accelerator."""
from types import SimpleNamespace

__all__ = ["cuda", "cudnn", "mps", "mkldnn", "openmp"]


def _unavailable():
    return False


cuda = SimpleNamespace(matmul=SimpleNamespace(allow_tf32=False,
                                              allow_fp16_reduced_precision_reduction=True,
                                              allow_bf16_reduced_precision_reduction=True),
                       is_built=_unavailable, flash_sdp_enabled=_unavailable,
                       enable_flash_sdp=lambda enabled: None)
cudnn = SimpleNamespace(allow_tf32=True, benchmark=False, deterministic=False, enabled=True,
                        is_available=_unavailable)
mps = SimpleNamespace(is_available=_unavailable, is_built=_unavailable)
mkldnn = SimpleNamespace(is_available=_unavailable, enabled=False)
openmp = SimpleNamespace(is_available=lambda: True)
