"""mt.distributed: several processes, one training run, over MPI.

    mpiexec -n 4 python train.py           # pip install "microtensor[mpi]" brings mpiexec

    import microtensor as mt
    import microtensor.distributed as dist
    dist.init()                            # rank and world size from MPI
    dist.get_rank(), dist.get_world_size() # (0..3, 4)
    dist.all_reduce(t, op="mean")          # in place: every rank ends with the mean
    dist.broadcast(t, src=0)               # in place: every rank ends with rank 0's values
    dist.barrier()

The names are torch.distributed's. The messages travel through mpi4py (MPI's Python
binding) straight from the tensors' numpy buffers; microtensor has no communication
layer of its own. mpi4py is imported only by init(), and only when the process was
started by an MPI launcher (mpiexec, srun): a plain `python train.py` is one process of
rank 0 in a world of size 1, every collective is then a no-op, and mpi4py need not be
installed at all.

Every collective has a deadline: a rank that died or hangs makes the others raise
DistributedError after MICROTENSOR_DIST_TIMEOUT seconds (default 300) instead of
waiting forever. The process then ends the whole job (MPI_Abort) when it exits, because
an MPI program cannot shut down cleanly while a peer is missing.
"""
import atexit
import contextlib
import os
import pickle
import sys
import time

import numpy as np

__all__ = ["init", "is_initialized", "get_rank", "get_world_size", "all_reduce", "broadcast",
           "barrier", "all_gather_object", "abort_on_error", "DistributedError", "get_timeout",
           "set_timeout", "init_process_group", "destroy_process_group"]

DEFAULT_TIMEOUT = 300.0   # seconds a collective may wait for the other ranks
TIMEOUT_ENV = "MICROTENSOR_DIST_TIMEOUT"

# Variables the common launchers put in each process's environment, with the world size.
# MPICH / Intel MPI / srun with PMI: PMI_SIZE; Open MPI: OMPI_COMM_WORLD_SIZE;
# MVAPICH: MV2_COMM_WORLD_SIZE; PMIx launchers: PMIX_RANK (the size comes from MPI).
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LAUNCHER_VARS = LAUNCHER_SIZE_VARS + ("PMIX_RANK",)

INSTALL_HINT = ('pip install "microtensor[mpi]" (mpi4py and the mpich wheel, which brings '
                'mpiexec)')


class DistributedError(RuntimeError):
    """A collective failed or timed out: some rank died, hangs, or called a different
    collective. The job cannot continue."""


class _State:
    initialized = False
    rank = 0
    world_size = 1
    MPI = None            # the mpi4py.MPI module, when running under MPI
    comm = None           # our own duplicate of COMM_WORLD (user MPI calls never mix in)
    timeout = None        # seconds; None = read the environment at init
    failed = False        # a collective failed: abort the job at exit
    uncaught = False      # an exception escaped to the top level of a multi-rank job
    exit_status = 1       # the status MPI_Abort ends the job with


_state = _State()


# ---- set-up -------------------------------------------------------------------------

def _launched_world_size():
    """The world size announced by an MPI launcher, or None outside one."""
    for var in LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                return int(value)
            except ValueError:
                pass
    if any(os.environ.get(var) for var in LAUNCHER_VARS):
        return 0   # launched, size unknown until MPI says
    return None


def _timeout_from_env():
    value = os.environ.get(TIMEOUT_ENV)
    if value is None or value == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


def init(timeout=None):
    """Join the job: rank and world size from MPI when the process was started by an MPI
    launcher (or mpi4py.MPI is already imported), else a single process (rank 0 of 1).
    `timeout` (seconds) bounds every collective; default: $MICROTENSOR_DIST_TIMEOUT or 300.
    Calling it again does nothing. Returns (rank, world_size)."""
    if timeout is not None:
        set_timeout(timeout)
    if _state.initialized:
        return _state.rank, _state.world_size
    if _state.timeout is None:
        _state.timeout = _timeout_from_env()
    announced = _launched_world_size()
    if announced is None and "mpi4py.MPI" not in sys.modules:
        _state.initialized = True         # plain `python script.py`: one process
        return 0, 1
    try:
        from mpi4py import MPI
    except ImportError as e:
        if announced in (None, 1):
            _state.initialized = True     # a world of one needs no MPI
            return 0, 1
        raise RuntimeError(
            f"this process was started by an MPI launcher for {announced or 'several'} "
            f"processes, but mpi4py cannot be imported ({e}); {INSTALL_HINT}") from None
    _state.MPI = MPI
    _state.comm = MPI.COMM_WORLD.Dup()
    _state.rank = _state.comm.Get_rank()
    _state.world_size = _state.comm.Get_size()
    _state.initialized = True
    if _state.world_size > 1:
        _install_exit_guard()
    return _state.rank, _state.world_size


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       **kwargs):
    """torch.distributed's name for init(): the backend is MPI whatever is asked (nanoGPT
    passes "nccl" or "gloo"); rank and world size come from the MPI launcher, and a
    rank or world size that disagrees with it is an error."""
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    r, n = init(seconds)
    if world_size not in (-1, None) and world_size != n:
        raise RuntimeError(f"init_process_group: world_size={world_size}, but the MPI launcher "
                           f"started {n} processes")
    if rank not in (-1, None) and rank != r:
        raise RuntimeError(f"init_process_group: rank={rank}, but MPI gave this process rank {r}")


def destroy_process_group(group=None):
    """The end of the job: wait for every rank (MPI itself is finalised at exit)."""
    if _state.initialized and _state.world_size > 1:
        barrier()


def is_initialized():
    """True once init() has run (also after a single-process init)."""
    return _state.initialized


def get_rank():
    """This process's rank, 0 .. world_size - 1 (initialises on first use)."""
    if not _state.initialized:
        init()
    return _state.rank


def get_world_size():
    """The number of processes in the job (initialises on first use)."""
    if not _state.initialized:
        init()
    return _state.world_size


def get_timeout():
    """Seconds a collective waits for the other ranks before raising DistributedError."""
    if _state.timeout is None:
        _state.timeout = _timeout_from_env()
    return _state.timeout


def set_timeout(seconds):
    seconds = float(seconds)
    if not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds}")
    _state.timeout = seconds


@contextlib.contextmanager
def abort_on_error():
    """Leaving this block by an exception (SystemExit with a non-zero status included)
    ends every rank of the job when this process exits (MPI_Abort with that status),
    instead of leaving the other ranks to wait for the timeout. For a script whose
    ranks may stop on their own, e.g. after an error only rank 0 can see."""
    try:
        yield
    except SystemExit as e:
        if e.code not in (None, 0) and _state.world_size > 1:
            _state.failed = True
            _state.exit_status = e.code if isinstance(e.code, int) else 1
        raise
    except BaseException:
        if _state.world_size > 1:
            _state.failed = True
        raise


def _install_exit_guard():
    """A multi-rank job must not reach MPI_Finalize after a failure: Finalize waits for
    the missing rank forever. So after a failed collective, or an exception that ends
    the program, the exiting rank calls MPI_Abort, which ends every rank of the job
    (this is what `python -m mpi4py script.py` does for uncaught exceptions)."""
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        _state.uncaught = True
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook

    # NOTE: atexit runs last-registered first, and mpi4py finalizes MPI after the
    # atexit handlers, so this runs while MPI is still usable.
    def abort_if_broken():
        if _state.failed or _state.uncaught:
            sys.stdout.flush()
            sys.stderr.flush()
            # NOTE: the launcher forwards each rank's output through its own pipes, and
            # MPI_Abort tears those down at once: without a pause the end of the error
            # (its last line, the one that says what happened) was lost now and then
            time.sleep(0.5)
            _state.MPI.COMM_WORLD.Abort(_state.exit_status)

    atexit.register(abort_if_broken)


# ---- waiting with a deadline ------------------------------------------------------

def _fail(message):
    _state.failed = True
    raise DistributedError(message)


def wait(requests, what):
    """Wait for non-blocking MPI requests, polling with Test so a missing rank becomes
    a DistributedError after the timeout instead of a hang. Returns seconds waited.

    NOTE: polling is what moves the message along: without a progress thread, MPI
    copies the next piece of a large message only inside an MPI call, on both sides.
    So the first 2 s poll without pause, as MPI's own blocking calls do (a rank that
    naps between tests throttles its peer too); after that a rank that waits for a
    slow peer (rank 0 writing a checkpoint) naps up to 1 ms per test and leaves the
    CPU to others."""
    MPI = _state.MPI
    timeout = get_timeout()
    start = time.perf_counter()
    deadline = start + timeout
    busy_until = start + 2.0
    nap = 1e-5
    while True:
        try:
            if MPI.Request.Testall(requests):
                return time.perf_counter() - start
        except MPI.Exception as e:
            _fail(f"{what} failed on rank {_state.rank} of {_state.world_size}: {e}")
        now = time.perf_counter()
        if now > deadline:
            _fail(f"{what} timed out on rank {_state.rank} of {_state.world_size}: no "
                  f"answer from the other ranks after {timeout:g} s. A rank has probably "
                  f"died, hangs, or is running a different collective. (The limit is "
                  f"{TIMEOUT_ENV}, in seconds.)")
        if now < busy_until:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)


def _check_tensor(t, what):
    from microtensor.core._core import Tensor
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} expects a Tensor, got {type(t).__name__}")
    return t.numpy()


class _Contiguous:
    """The tensor's own buffer when it is contiguous and writable, else a copy that is
    written back on exit (MPI needs one contiguous block of memory)."""

    def __init__(self, array):
        self.array = array
        self.direct = array.flags.c_contiguous and array.flags.writeable
        self.buffer = array if self.direct else np.ascontiguousarray(array)

    def write_back(self):
        if not self.direct:
            if not self.array.flags.writeable:
                raise RuntimeError("the tensor's memory is read-only; a collective cannot "
                                   "write its result into it")
            np.copyto(self.array, self.buffer)


def _mpi_buffer(array):
    """numpy bool has no MPI type: send its bytes."""
    return array.view(np.uint8) if array.dtype == np.bool_ else array


# ---- collectives --------------------------------------------------------------------

REDUCE_OPS = ("sum", "mean")


def all_reduce(tensor, op="sum"):
    """In place: every rank ends with the sum (or mean) of `tensor` over all ranks.
    Returns `tensor`."""
    array = _check_tensor(tensor, "all_reduce")
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: op={op!r} is not supported; choose one of "
                         + ", ".join(repr(o) for o in REDUCE_OPS))
    if op == "mean" and array.dtype.kind not in "fc":
        raise TypeError(f"all_reduce: op='mean' needs a floating-point tensor, got {array.dtype}")
    if array.dtype == np.bool_:
        raise TypeError("all_reduce: bool tensors cannot be summed; convert to an integer dtype")
    if get_world_size() == 1:
        return tensor
    MPI = _state.MPI
    block = _Contiguous(array)
    request = _state.comm.Iallreduce(MPI.IN_PLACE, block.buffer, op=MPI.SUM)
    wait([request], f"all_reduce of a tensor of shape {tuple(array.shape)}")
    if op == "mean":
        block.buffer *= block.buffer.dtype.type(1.0 / _state.world_size)
    block.write_back()
    return tensor


def broadcast(tensor, src=0):
    """In place: every rank ends with rank `src`'s values of `tensor`. Returns `tensor`."""
    array = _check_tensor(tensor, "broadcast")
    world = get_world_size()
    if not isinstance(src, (int, np.integer)) or not 0 <= src < world:
        raise ValueError(f"broadcast: src={src!r} is not a rank of this job (0..{world - 1})")
    if world == 1:
        return tensor
    block = _Contiguous(array)
    request = _state.comm.Ibcast(_mpi_buffer(block.buffer), root=int(src))
    wait([request], f"broadcast of a tensor of shape {tuple(array.shape)} from rank {src}")
    block.write_back()
    return tensor


def barrier():
    """Return once every rank has called barrier()."""
    if get_world_size() == 1:
        return
    wait([_state.comm.Ibarrier()], "barrier")


def all_gather_object(object_list, obj):
    """torch's all_gather_object: object_list[r] = rank r's `obj` (any picklable value;
    pickle is fine here: the peers are this job's own processes).
    `object_list` must have world_size entries."""
    world = get_world_size()
    if len(object_list) != world:
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries, "
                         f"the world has {world} ranks")
    if world == 1:
        object_list[0] = obj
        return
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.zeros(world, dtype=np.int64)
    wait([_state.comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)],
         "all_gather_object (sizes)")
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait([_state.comm.Iallgatherv(payload, [gathered, sizes, offsets, _state.MPI.BYTE])],
         "all_gather_object")
    for r in range(world):
        object_list[r] = pickle.loads(gathered[offsets[r]:offsets[r] + sizes[r]].tobytes())


def new_communicator():
    """A private duplicate of the job's communicator (DistributedDataParallel keeps its
    gradient all-reduces on one, so they never interleave with the user's collectives).
    None in a single-process job."""
    if get_world_size() == 1:
        return None
    return _state.comm.Dup()
