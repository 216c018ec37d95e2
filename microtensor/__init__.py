"""microtensor: a readable autograd engine in Cython on numpy, in PyTorch's dialect.

    import microtensor as mt
    x = mt.randn(3, 4, requires_grad=True)
    (x.tanh() * 2).sum().backward()
    x.grad
"""


def _explain_missing_core(error):
    """The error for a failed import of the compiled core. Run from a source folder that
    was never built (a fresh clone, at its root), the folder hides any installed copy and
    Python would only say 'cannot import name _core from partially initialized module':
    say instead what to do."""
    import os
    from importlib.machinery import EXTENSION_SUFFIXES
    here = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(here, "core", "_core" + s)) for s in EXTENSION_SUFFIXES):
        return error             # built, yet it failed: the original error says why
    root = os.path.dirname(here)
    installed = [os.path.join(p, "microtensor") for p in __import__("sys").path
                 if os.path.abspath(p or ".") != root and any(
                     os.path.exists(os.path.join(p, "microtensor", "core", "_core" + s))
                     for s in EXTENSION_SUFFIXES)]
    found = (f" (an installed microtensor is in {installed[0]})" if installed else "")
    return ImportError(
        f"microtensor is being imported from its source folder {here}, where the compiled "
        f"core (_core{EXTENSION_SUFFIXES[0]}) has not been built. Python looks in the "
        f"current directory first, so this folder hides an installed copy{found}.\n"
        "Either install microtensor and run Python from another directory:\n"
        "    pip install .      (then leave this folder: cd elsewhere)\n"
        "or build it here, in place, for development:\n"
        '    pip install -e ".[test]"\n'
        "    or: python setup.py build_ext --inplace   (needs Cython, numpy, scipy and "
        'setuptools: pip install -e ".[dev]" brings them)')


# a MICROTENSOR_* variable microtensor does not read (a typo) warns, naming the nearest
import os as _os
from microtensor.runtime import _variables
_variables.check_names(_os.environ)
# OpenMP's waiting policy, before the first extension loads the OpenMP runtime
from microtensor.runtime import _omp_env
_omp_env.apply_defaults()
# glibc's malloc keeps freed memory for the next step (microtensor/runtime/_malloc.py says why)
from microtensor.runtime import _malloc
_malloc.apply()

try:
    from microtensor.core import _core
except ImportError as _error:
    raise _explain_missing_core(_error) from None
from microtensor.core._core import (
    Tensor, Parameter, ShapeError, Node,
    float32, float64, int64, int32, uint8, bool_ as bool,
    tensor, from_numpy, zeros, ones, empty, full, zeros_like, ones_like, full_like,
    arange, linspace, randn, rand, randint, randperm, multinomial,
    manual_seed, get_rng_state, set_rng_state, default_generator,
    no_grad, enable_grad, set_grad_enabled, is_grad_enabled,
    set_num_threads, get_num_threads, register_op, registered_ops,
)
# The core's ops (mt.add, mt.exp, mt.matmul, ...) are not listed here: each op's registry
# row (register_op, beside its rule in ops/*.pxi, compiled into the core) made it a function of this
# package, and a Tensor method, when the core was imported above.
from microtensor.core.dtypes import (
    dtype, device, float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8,
    bool_ as bool, finfo, iinfo,
)
from microtensor.core.generator import (Generator, default_generator, manual_seed, seed, initial_seed,
                                  set_rng_state)
from microtensor import autograd
from microtensor.autograd import gradcheck, gradgradcheck
from microtensor import nn, optim
from microtensor import inspect
from microtensor.threads import (set_blas_threads, get_blas_threads, blas_info, set_threads,
                                 default_num_threads, physical_cores)
# the kernels' threads: the one policy (OMP_NUM_THREADS, else the physical cores)
set_num_threads(default_num_threads())
from microtensor.buildinfo import show_config, config
from microtensor.serialization import save, load
# mt.distributed: importing it does not import mpi4py (only distributed.init() under MPI does)
from microtensor import distributed

concat = cat
divide = div
multiply = mul
float = float32
double = float64
half = float16
long = int64
int = int32
short = int16

__version__ = "0.1.0"


def is_tensor(obj):
    return isinstance(obj, Tensor)


def numel(t):
    return t.numel()


# -- PyTorch's wider surface: the op families written in Python, every module of ops/
# (a new family file too: nothing to add here). Importing a family runs its registry rows
# (at the bottom of each file), which make its mt.<name> functions and Tensor methods;
# the registry is the only list of them.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402
from microtensor import ops  # noqa: E402
for _family in sorted(m.name for m in _pkgutil.iter_modules(ops.__path__)):
    if not _family.startswith("_"):
        _importlib.import_module(f"microtensor.ops.{_family}")
del _importlib, _pkgutil, _family
true_divide = div
from microtensor.capture import compile  # noqa: E402  (mt.compile: capture and replay)
# the layers above wire themselves into those below here, so that no import runs back up:
# a custom Function's apply is one call of a recording, nn.init's random fills are timed
# (and drawn again at replay) as calls
from microtensor.capture import recorder as _recorder  # noqa: E402
from microtensor import profiler as _profiler  # noqa: E402
autograd.function.set_call_recorder(_recorder.record_call)
_profiler.register_ops(nn.init, "nn.init.")
del _recorder, _profiler
from microtensor import compiler  # noqa: E402
from microtensor import linalg, backends, amp, cuda
from microtensor.core.dialect import (
    set_default_dtype, get_default_dtype, set_printoptions, inference_mode,
    is_inference_mode_enabled, set_float32_matmul_precision, get_float32_matmul_precision,
    use_deterministic_algorithms, are_deterministic_algorithms_enabled,
)
