"""Thread counts at run time: microtensor's own kernels and the BLAS under numpy.

microtensor's matmuls go through numpy, so through whatever BLAS numpy was built with
(usually OpenBLAS, shipped inside the numpy wheel as `scipy_openblas`). That library
reads OPENBLAS_NUM_THREADS once, when it is loaded; to change it afterwards one calls
its `openblas_set_num_threads`. threadpoolctl finds the OpenBLAS libraries loaded into
the process and calls it for us.

    from microtensor.threads import set_blas_threads, blas_info
    set_blas_threads(2)          # numpy's OpenBLAS (numpy's own `@`)
    mt.set_num_threads(2)        # microtensor's kernels and matmuls (OpenMP)
    set_threads(2)               # both at once
    set_threads()                # both, to default_num_threads(): the physical cores

The count set with mt.set_num_threads is the *configured* count: it fixes how each kernel
splits its work, so a given seed gives the same bits. The threads that run the pieces
(the *team*) are that count on a quiet machine and fewer while other processes keep the
CPUs busy (a build, a test run, a second training job), measured every 0.25 s from
/proc/stat: a thread that waits for a partner who lost its core is what made two threads
slower than one on a busy machine. team_size() says how many run now; adaptive_threads(False)
(or MICROTENSOR_ADAPTIVE_THREADS=0) always runs the configured count.
"""
import ctypes
import os

import numpy as np  # noqa: F401  (importing numpy is what loads its BLAS)
from threadpoolctl import ThreadpoolController

from microtensor.core import _core
from microtensor.runtime._omp_env import OMP_DEFAULTS, settings as omp_settings  # noqa: F401


def _loaded_blas():
    """The OpenBLAS libraries loaded into this process (threadpoolctl's controllers),
    numpy's first."""
    libs = ThreadpoolController().select(internal_api="openblas").lib_controllers
    return sorted(libs, key=lambda lib: "numpy" not in lib.filepath)


def _config(lib):
    """openblas_get_config(): the build line (version, DYNAMIC_ARCH, MAX_THREADS, ...)."""
    get = getattr(lib, "_get_symbol", lambda name: None)("openblas_get_config")
    if get is None:
        return None
    get.restype = ctypes.c_char_p
    return get().decode(errors="replace")


def set_blas_threads(n, library="numpy"):
    """Set the thread count of the OpenBLAS whose path contains `library` (default:
    numpy's, the one behind numpy's `@`); library="all" sets every OpenBLAS loaded.
    Returns how many libraries were set (0 when none was found, e.g. numpy on
    another BLAS).

    NOTE: scipy ships its own OpenBLAS, and microtensor's matmul and attention kernels
    call its gemm from inside their own OpenMP threads, pinned to one thread
    (microtensor.kernels._blas.pin_blas_threads); library="all" would undo that pin."""
    n = int(n)
    if n < 1:
        raise ValueError(f"number of threads must be at least 1, got {n}")
    libs = [lib for lib in _loaded_blas() if library == "all" or library in lib.filepath]
    for lib in libs:
        lib.set_num_threads(n)
    return len(libs)


def get_blas_threads():
    """The thread count of numpy's OpenBLAS (else the first one found), or None."""
    libs = _loaded_blas()
    return libs[0].num_threads if libs else None


def blas_info():
    """One dict per loaded OpenBLAS: path, num_threads, corename (the kernel that runs,
    e.g. 'Haswell' or 'SkylakeX' / 'Zen'), and its build config; numpy's first."""
    return [{"path": lib.filepath, "num_threads": lib.num_threads,
             "corename": getattr(lib, "architecture", None), "config": _config(lib)}
            for lib in _loaded_blas()]


# ---- the team: the threads that run now ------------------------------------------------

def team_size():
    """How many threads run microtensor's parallel kernels now: mt.get_num_threads() on a
    quiet machine, fewer while other processes hold the CPUs (see the module docstring).
    The split of the work, and so every result, follows mt.get_num_threads() only."""
    from microtensor.kernels import _blas
    return _blas.team(_core.get_num_threads())


def adaptive_threads(enabled=None):
    """Whether the team follows the machine's load (True by default). adaptive_threads(False)
    always runs mt.get_num_threads() threads, adaptive_threads(True) follows the load
    again; called without an argument it only answers. Returns the setting before."""
    from microtensor.kernels import _blas
    before = _blas.team_info()["adaptive"]
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"adaptive_threads takes True or False, got {enabled!r}")
        _blas.set_team(adaptive=enabled)
    return before


# ---- the default thread count ------------------------------------------------------

def _allowed_cpus():
    """The logical CPUs this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


_SYS_CPU = "/sys/devices/system/cpu"
# (quota file, period file or None when the quota file holds both): cgroup v2, then v1
_CGROUP_QUOTA = (("/sys/fs/cgroup/cpu.max", None),
                 ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def _cgroup_cpu_limit():
    """The container's CPU quota rounded up (cgroup v2 cpu.max, v1 cfs quota), or None."""
    import math
    for path, period_path in _CGROUP_QUOTA:
        try:
            with open(path) as f:
                fields = f.read().split()
            if period_path is not None:
                with open(period_path) as f:
                    fields.append(f.read().strip())
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):  # absent, or "max": no quota
            continue
        if quota > 0 and period > 0:
            return max(1, math.ceil(quota / period))
    return None


def physical_cores():
    """Physical cores among the CPUs this process may run on: SMT siblings of one core
    (same physical_package_id and core_id in /sys/devices/system/cpu/cpu*/topology)
    count once. Without that topology (not Linux): psutil's physical count when psutil
    is installed, else the number of logical CPUs."""
    cpus = _allowed_cpus()
    cores = set()
    for cpu in cpus:
        topo = f"{_SYS_CPU}/cpu{cpu}/topology/"
        try:
            with open(topo + "physical_package_id") as f:
                package = int(f.read())
            with open(topo + "core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):
            cores = None
            break
        cores.add((package, core))
    if cores:
        return len(cores)
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
        if n:
            return min(n, len(cpus))
    except ImportError:
        pass
    return max(1, len(cpus))


def usable_threads(n, what="threads"):
    """n, or the number of CPUs this process may run on when n is more: more OpenMP
    threads than CPUs only makes them wait for each other. Returns (count, warning),
    the warning a one-line message when n was lowered, else None; `what` names where n
    came from in that message (e.g. "--threads" or "OMP_NUM_THREADS")."""
    n = int(n)
    cpus = len(_allowed_cpus())
    if n > cpus:
        return cpus, (f"{what} {n} is more than the {cpus} CPU{'s' if cpus != 1 else ''} "
                      f"this process may run on; using {cpus}")
    return n, None


def default_num_threads():
    """The thread count `set_threads()` uses when given none: OMP_NUM_THREADS when it
    is set to a positive integer (at most the CPUs this process may run on: a larger
    value is lowered to that with a warning, never an error), else the physical cores
    this process may run on (`physical_cores()`, as PyTorch's default), capped by the
    container's CPU quota."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        n, warning = usable_threads(int(env), "OMP_NUM_THREADS=")
        if warning:
            import warnings
            warnings.warn(warning.replace("= ", "="), RuntimeWarning, stacklevel=2)
        return n
    n = physical_cores()
    limit = _cgroup_cpu_limit()
    return max(1, min(n, limit) if limit else n)


def set_threads(n=None):
    """Set both microtensor's kernel threads and numpy's BLAS threads to n (default:
    `default_num_threads()`, the physical cores). Returns the count set."""
    if n is None:
        n = default_num_threads()
    _core.set_num_threads(int(n))
    set_blas_threads(n)
    return int(n)
