"""torch.cuda as a CPU-only build of torch answers it: nothing is available, so a script
that asks (`device = 'cuda' if torch.cuda.is_available() else 'cpu'`) takes the CPU path.
Asking for a CUDA device anyway is a RuntimeError that names it."""
from microtensor import amp as _amp
from microtensor.core._core import check_device as _check_device

__all__ = ["is_available", "device_count", "is_bf16_supported", "manual_seed",
           "manual_seed_all", "synchronize", "empty_cache", "current_device",
           "get_device_name", "amp"]


def is_available():
    return False


def device_count():
    return 0


def is_bf16_supported(*args, **kwargs):
    return False


def manual_seed(seed):
    """Nothing to seed: there is no CUDA generator (torch does the same without CUDA)."""


manual_seed_all = manual_seed


def synchronize(device=None):
    """Nothing runs asynchronously on the CPU."""


def empty_cache():
    """There is no CUDA memory cache."""


def current_device():
    _check_device("cuda")


def get_device_name(device=None):
    _check_device("cuda")


class amp:
    """torch.cuda.amp's two names, as the pass-throughs of mt.amp."""
    autocast = _amp.autocast
    GradScaler = _amp.GradScaler
