# Dtypes and devices: the numpy dtypes the core computes with, and how torch code names
# them (`mt.float32` objects from microtensor.core.dtypes, `device='cpu'`).

float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int64 = np.dtype(np.int64)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
bool_ = np.dtype(np.bool_)

_DTYPE_NAMES = {float32: "float32", float64: "float64", int64: "int64", int32: "int32",
                uint8: "uint8", bool_: "bool", np.dtype(np.float16): "float16"}


def _dtype_name(dt):
    return _DTYPE_NAMES.get(np.dtype(dt), str(np.dtype(dt)))


# ---- dtypes and devices as torch code names them ------------------------------------
# The core works with numpy dtypes; `mt.float32` and friends are small objects that
# print as torch's do and compare equal to the numpy dtype (microtensor.core.dtypes makes
# them and registers them here, so that t.dtype returns them).

cdef dict _dtype_objects = {}
cdef object _default_float = float32      # the dtype of Python floats (set_default_dtype)


def set_default_float_dtype(dt):
    global _default_float
    dt = np.dtype(dt)
    if dt != float32 and dt != float64:
        raise TypeError(f"the default dtype must be float32 or float64, got {dt}")
    _default_float = float32 if dt == float32 else float64


def get_default_float_dtype():
    return _dtype_objects.get(_default_float, _default_float)
cdef object _cpu_device = "cpu"
_DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu", "meta", "hip", "xla", "vulkan", "ipu", "hpu")


def register_dtypes_and_device(dict dtype_objects, cpu_device):
    global _cpu_device
    _dtype_objects.update(dtype_objects)
    _cpu_device = cpu_device


cpdef object check_device(object device):
    """None or the CPU pass (returned as mt.device('cpu')); any other device is a
    RuntimeError that names it, as a CPU build of torch answers for CUDA."""
    if device is None:
        return None
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if isinstance(device, int) and not isinstance(device, bool):
        kind = "cuda"
    if not isinstance(kind, str):
        raise TypeError(f"not a device: {device!r}")
    if kind.split(":")[0].strip() == "cpu":
        return _cpu_device
    raise RuntimeError(f"device {str(device)!r} is not available: microtensor runs on the CPU "
                       f"only (mt.cuda.is_available() is False); use device='cpu'")


def parse_to_args(args, kwargs):
    """The arguments of Tensor.to / Module.to: (dtype or None, copy)."""
    dtype = kwargs.pop("dtype", None)
    check_device(kwargs.pop("device", None))
    kwargs.pop("non_blocking", None)
    kwargs.pop("memory_format", None)
    copy = bool(kwargs.pop("copy", False))
    if kwargs:
        raise TypeError(f"to() got unexpected arguments {sorted(kwargs)}")
    for arg in args:
        if isinstance(arg, Tensor):
            dtype = (<Tensor>arg)._data.dtype
        elif isinstance(arg, str) and arg.split(":")[0].strip() in _DEVICE_KINDS:
            check_device(arg)
        elif hasattr(arg, "type") and not hasattr(arg, "itemsize") and not isinstance(arg, type):
            check_device(arg)          # an mt.device (or torch.device-like) object
        elif isinstance(arg, bool):
            pass                       # non_blocking passed positionally
        elif isinstance(arg, int):
            check_device(arg)
        else:
            dtype = arg
    return (as_dtype(dtype) if dtype is not None else None), copy


cpdef object as_dtype(object dtype):
    """Accept mt.float32, np.float32, 'float32', float, int or bool as a dtype."""
    if dtype is None:
        return None
    if dtype is float:
        return float32
    if dtype is int:
        return int64
    if dtype is bool:
        return bool_
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"not a dtype: {dtype!r}") from None
