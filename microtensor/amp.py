"""Mixed precision as a CPU-only torch build offers it to a float32 training script:
`autocast` and `GradScaler` exist so the script runs, and both are pass-throughs
(microtensor computes in the dtypes it is given; there is no float16 matmul to scale for).

    scaler = mt.amp.GradScaler(enabled=False)     # nanoGPT: enabled=(dtype == 'float16')
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
"""
import warnings

__all__ = ["autocast", "GradScaler"]


class autocast:
    """A context manager / decorator that leaves dtypes alone. Asking it to compute in a
    lower precision on an enabled autocast is refused, so a run never silently differs
    from what the script asked for."""

    def __init__(self, device_type="cpu", dtype=None, enabled=True, cache_enabled=None):
        if not isinstance(device_type, str):
            raise TypeError(f"autocast: device_type must be a str, got {type(device_type).__name__}")
        if device_type.split(":")[0] != "cpu":
            raise RuntimeError(f"autocast: device_type {device_type!r} is not available: "
                               "microtensor runs on the CPU only")
        name = getattr(dtype, "name", None) or str(dtype)
        if enabled and dtype is not None and "float32" not in name:
            raise NotImplementedError(f"autocast to {dtype} is not supported: microtensor "
                                      "computes in float32 or float64 (use dtype='float32')")
        self.enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper


class GradScaler:
    """Loss scaling for float16 training; disabled here (as torch disables it without
    CUDA, with a warning when asked to enable it). Every method is torch's no-op path."""

    def __init__(self, device="cuda", init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, enabled=True):
        if enabled:
            warnings.warn("GradScaler is enabled, but CUDA is not available. Disabling.",
                          stacklevel=2)
        self._enabled = False

    def is_enabled(self):
        return self._enabled

    def scale(self, outputs):
        return outputs

    def unscale_(self, optimizer):
        return None

    def step(self, optimizer, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None):
        return None

    def get_scale(self):
        return 1.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        return None
