"""Dtypes and devices with torch's names: `mt.float32` prints as `mt.float32`,
`t.dtype == mt.float32` holds, and `device="cpu"` is accepted wherever torch takes it.

The engine itself computes with numpy dtypes. A `dtype` here is a thin name for one:
it compares equal to the numpy dtype (and to `np.float32`), hashes like it, and numpy
accepts it anywhere it takes a dtype (through its `.dtype` attribute).
"""
import numpy as np

from microtensor.core import _core

# The numpy dtypes the kernels compute in; `x.dtype in KERNEL_FLOATS` finds numpy's own
# dtype objects by identity, before any comparison.
KERNEL_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class dtype:
    """A tensor element type, named as torch names it."""
    __slots__ = ("_np", "_name")

    def __init__(self, np_dtype, name):
        self._np = None if np_dtype is None else np.dtype(np_dtype)
        self._name = name

    @property
    def dtype(self):
        """The numpy dtype (numpy reads this when it is handed an mt.dtype)."""
        if self._np is None:
            raise TypeError(f"mt.{self._name} is not supported on the CPU with numpy; "
                            f"use mt.float32 or mt.float64")
        return self._np

    @property
    def is_floating_point(self):
        return self._np is None or self._np.kind == "f"

    @property
    def is_complex(self):
        return False

    @property
    def is_signed(self):
        return self._np is None or self._np.kind in "fi"

    @property
    def itemsize(self):
        return 2 if self._np is None else self._np.itemsize

    def to_numpy(self):
        return self.dtype

    def __getattr__(self, name):
        # kind, char, name, type ...: the numpy dtype's answers
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dtype, name)

    def __eq__(self, other):
        if isinstance(other, dtype):
            return self._name == other._name
        if self._np is None:
            return False
        try:
            return self._np == np.dtype(other)
        except TypeError:
            return False

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._np) if self._np is not None else hash(self._name)

    def __repr__(self):
        return f"mt.{self._name}"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("microtensor dtypes are not pickled")


float32 = dtype(np.float32, "float32")
float64 = dtype(np.float64, "float64")
float16 = dtype(np.float16, "float16")
bfloat16 = dtype(None, "bfloat16")         # named so that torch code can mention it
int64 = dtype(np.int64, "int64")
int32 = dtype(np.int32, "int32")
int16 = dtype(np.int16, "int16")
int8 = dtype(np.int8, "int8")
uint8 = dtype(np.uint8, "uint8")
bool_ = dtype(np.bool_, "bool")

float, double, half = float32, float64, float16
long, int, short = int64, int32, int16

_BY_NUMPY = {d._np: d for d in (float32, float64, float16, int64, int32, int16, int8, uint8, bool_)}


class device:
    """mt.device("cpu"): the one device microtensor has. Any other raises RuntimeError."""
    __slots__ = ("type", "index")

    def __init__(self, type="cpu", index=None):
        if isinstance(type, device):
            type, index = type.type, type.index
        if not isinstance(type, str):
            raise TypeError(f"device() expects a string such as 'cpu', got {type!r}")
        kind, _, idx = type.partition(":")
        self.type = kind.strip()
        self.index = int(idx) if idx else index

    def __eq__(self, other):
        if isinstance(other, str):
            other = device(other)
        return isinstance(other, device) and other.type == self.type and other.index == self.index

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        inner = f"'{self.type}'" if self.index is None else f"'{self.type}', index={self.index}"
        return f"device(type={inner})"

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


_core.register_dtypes_and_device(_BY_NUMPY, device("cpu"))


def finfo(d=None):
    """numpy's finfo for a floating dtype (eps, max, min, tiny...)."""
    return np.finfo(np.dtype(d if d is not None else _core.get_default_float_dtype()))


def iinfo(d):
    return np.iinfo(np.dtype(d))
