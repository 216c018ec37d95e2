"""DistributedDataParallel: one replica of the model per rank, gradients averaged in backward.

    import microtensor.distributed as dist
    dist.init()
    model = mt.nn.parallel.DistributedDataParallel(GPT(config))  # rank 0's weights everywhere
    logits, loss = model(x, y)       # x, y: this rank's own batch
    loss.backward()                  # every .grad = the mean over ranks of the rank gradients
    optimizer.step()                 # the same step on every rank: the replicas stay equal

Averaging the gradients of N ranks that each ran a batch of B is exactly the gradient of
one batch of N*B (for a loss that is a mean over the batch), so N processes train like
one process with an N times larger batch, in about 1/N of the time.

How the averaging overlaps backward. The parameters are grouped into buckets of at most
`bucket_cap_mb`, in reverse order of registration: backward reaches the last layers
first, so the first bucket is the first to be complete. Each bucket is one contiguous
float32 buffer. A hook on each parameter fires once its gradient is complete and copies
it into its bucket; when a bucket holds all its gradients, a non-blocking MPI all-reduce
(Iallreduce) of that buffer starts while backward carries on with the layers below.
When the last gradient has arrived, DDP waits for the reductions, divides by the world
size and writes the means back into the .grad tensors, all before backward() returns.

    NOTE: the buckets start in bucket order on every rank (MPI needs the collectives of
    a communicator in the same order everywhere); a bucket that completes early waits
    for the ones before it.

no_sync() skips the averaging for gradient accumulation: the gradients of the
micro-batches run inside it add up locally, and the first backward outside it averages
the sum. DDP supports loss.backward() (gradients into .grad), not mt.autograd.grad, and
every parameter that requires grad must receive a gradient in every synchronised
backward (as torch's DDP without find_unused_parameters).
"""
import contextlib

import numpy as np

from microtensor import distributed as dist
from microtensor.core._core import Tensor, from_numpy, is_grad_enabled
from microtensor.nn.module import Module

__all__ = ["DistributedDataParallel"]

FIRST_BUCKET_BYTES = 1024 * 1024


def _has_post_accumulate_hooks():
    return hasattr(Tensor, "register_post_accumulate_grad_hook")


class _Bucket:
    """Some parameters' gradients in one contiguous buffer, all-reduced as one message."""

    def __init__(self, index, params, dtype):
        self.index = index
        self.params = params                   # [(name, param)]
        self.slots = []                        # (offset, numel) of each param in flat
        offset = 0
        for _, p in params:
            self.slots.append((offset, p.numel()))
            offset += p.numel()
        self.flat = np.zeros(offset, dtype=dtype)
        self.missing = len(params)             # gradients still to arrive this backward

    @property
    def nbytes(self):
        return self.flat.nbytes


class DistributedDataParallel(Module):
    """Wrap `module` so that backward() averages its gradients over the ranks of the job.

    The parameters and buffers of rank 0 are copied to every rank here, so all replicas
    start equal. Outside an MPI job (world size 1) this is a plain pass-through."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got "
                            f"{type(module).__name__}")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.stats = dict(syncs=0, wait_s=0.0, bytes_per_sync=0, buckets=0, started_early=0)
        self._sync_enabled = True
        self._armed = False
        self._hooks = []
        self._buckets = []
        self.hook_mode = None      # 'post_accumulate' | 'leaf_hook' | None (world size 1)
        if self.world_size == 1:
            return

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check_same_model(named)
        self._comm = dist.new_communicator()
        for _, p in named:
            dist.broadcast(p, src=0)
        for _, b in module.named_buffers():
            if b is not None:
                dist.broadcast(b, src=0)

        # buckets: reverse registration order, at most bucket_cap_mb each (a larger
        # parameter gets a bucket of its own), one dtype per bucket. The first bucket
        # holds at most 1 MiB (torch's choice too): it is complete early in backward,
        # so some communication starts even when the whole model fits one bucket.
        cap = bucket_cap_mb * 1024 * 1024
        current, size = [], 0
        for name, p in reversed(named):
            nbytes = p.numel() * p.numpy().itemsize
            limit = min(cap, FIRST_BUCKET_BYTES) if not self._buckets else cap
            if current and (size + nbytes > limit or p.dtype != current[0][1].dtype):
                self._buckets.append(_Bucket(len(self._buckets), current, current[0][1].dtype))
                current, size = [], 0
            current.append((name, p))
            size += nbytes
        if current:
            self._buckets.append(_Bucket(len(self._buckets), current, current[0][1].dtype))
        self._slot_of = {}          # id(param) -> (bucket, offset, numel)
        for b in self._buckets:
            for (_, p), (offset, numel) in zip(b.params, b.slots):
                self._slot_of[id(p)] = (b, offset, numel)
        self._names = {id(p): n for n, p in named}
        self._n_params = len(named)
        self.stats.update(bytes_per_sync=sum(b.nbytes for b in self._buckets),
                          buckets=len(self._buckets))

        if _has_post_accumulate_hooks():
            self.hook_mode = "post_accumulate"
            for _, p in named:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        else:
            self.hook_mode = "leaf_hook"
            for _, p in named:
                self._hooks.append(p.register_hook(self._make_leaf_hook(p)))

    # -- the wrapped module ----------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.world_size > 1 and is_grad_enabled():
            self._check_previous_sync()
            if self._sync_enabled:
                self._arm()
            else:
                self._armed = False
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this block keep their gradients local
        (they add up in .grad); the next synchronised backward averages the sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- set-up checks ----------------------------------------------------------------
    def _check_same_model(self, named):
        """Every rank must wrap the same parameters, or the all-reduces would mix
        unrelated numbers (or wait forever for a message of another size)."""
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                diff = next((f"{a} vs {b}" for a, b in zip(mine, theirs) if a != b),
                            f"{len(mine)} vs {len(theirs)} parameters")
                raise RuntimeError(f"DistributedDataParallel: rank {self.rank} and rank {r} "
                                   f"wrap different models ({diff})")

    # -- one backward -----------------------------------------------------------------
    def _arm(self):
        """Expect one gradient for every parameter in the coming backward."""
        for b in self._buckets:
            b.missing = len(b.params)
        self._ready = set()
        self._requests = []
        self._next_bucket = 0
        self._armed = True

    def _check_previous_sync(self):
        if self._armed and self._ready:
            missing = [self._names[k] for k in self._names if k not in self._ready]
            self._armed = False
            raise RuntimeError(
                "DistributedDataParallel: the previous backward gave no gradient to "
                f"{len(missing)} parameter(s) ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}), so their all-reduce never "
                "started. Every parameter that requires grad must take part in the loss "
                "(set requires_grad=False on the unused ones)")

    def _make_leaf_hook(self, param):
        """Without post-accumulate hooks in the core, a gradient hook on the leaf stands
        in for one: it adds the incoming gradient into param.grad itself, reports the
        parameter ready, and hands the engine zeros to add (so nothing is counted twice).
        NOTE: a core that runs leaf hooks only after its traversal gives no overlap this
        way (correct results, all-reduces after backward)."""
        def hook(grad):
            if not self._armed:
                return None
            g = grad.numpy()
            if param.grad is None:
                param.grad = from_numpy(np.array(g, dtype=param.dtype, copy=True))
            else:
                gd = param.grad.numpy()
                if gd.flags.writeable:
                    np.add(gd, g, out=gd, casting="unsafe")
                else:
                    param.grad = from_numpy((gd + g).astype(param.dtype))
            self._grad_ready(param)
            return np.broadcast_to(np.zeros((), dtype=g.dtype), g.shape)
        return hook

    def _grad_ready(self, param):
        """param.grad is complete for this backward: copy it into its bucket; start the
        bucket's all-reduce when it is full; after the last parameter, finish."""
        if not self._armed:
            return
        key = id(param)
        if key in self._ready:
            raise RuntimeError(f"DistributedDataParallel: parameter {self._names[key]} received "
                               "its gradient twice in one backward")
        bucket, offset, numel = self._slot_of[key]
        np.copyto(bucket.flat[offset:offset + numel], param.grad.numpy().reshape(-1),
                  casting="same_kind")
        self._ready.add(key)
        if len(self._ready) == self._n_params:
            # how many buckets were already on the wire when backward delivered its last
            # gradient: 0 means no overlap at all
            self.stats["started_early"] = self._next_bucket
        bucket.missing -= 1
        if bucket.missing == 0:
            self._start_complete_buckets()
        elif self._requests:
            # NOTE: MPI moves a non-blocking message along only inside MPI calls (no
            # progress thread by default); testing now and then keeps it going
            dist._state.MPI.Request.Testall(self._requests)
        if len(self._ready) == self._n_params:
            self.finish_gradient_synchronization()

    def _start_complete_buckets(self):
        MPI = dist._state.MPI
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].missing == 0):
            b = self._buckets[self._next_bucket]
            self._requests.append(self._comm.Iallreduce(MPI.IN_PLACE, b.flat, op=MPI.SUM))
            self._next_bucket += 1

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce and write the means into .grad. Runs by
        itself at the end of each synchronised backward; calling it again does nothing."""
        if not self._armed or len(self._ready) != self._n_params:
            return
        self._armed = False
        waited = dist.wait(self._requests, f"gradient all-reduce ({len(self._buckets)} "
                                           f"bucket(s), {self.stats['bytes_per_sync']:,} bytes)")
        self._requests = []
        self.stats["syncs"] += 1
        self.stats["wait_s"] += waited
        for b in self._buckets:
            b.flat *= b.flat.dtype.type(1.0 / self.world_size)
            for (_, p), (offset, numel) in zip(b.params, b.slots):
                mean = b.flat[offset:offset + numel].reshape(p.shape)
                gd = p.grad.numpy()
                if gd.flags.writeable and gd.dtype == mean.dtype:
                    np.copyto(gd, mean)
                else:
                    p.grad = from_numpy(mean.astype(p.dtype, copy=True))

    def extra_repr(self):
        return (f"world_size={self.world_size}, buckets={len(self._buckets)}, "
                f"bucket_cap_mb={self.bucket_cap_mb}")
