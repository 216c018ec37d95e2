"""DistributedDataParallel's arithmetic without MPI: a world of two ranks whose other rank
is this one's mirror (the same model, the same batches), so every all-reduce doubles its
buffer. The mean over ranks is then the single process's own gradient, and a scale bug
(dividing by the world size twice, or not at all, or scaling only some buckets) shows as
a factor of two. With mpi4py installed, tests/test_distributed.py runs real ranks."""
import numpy as np
import pytest

import microtensor as mt
import microtensor.distributed as dist
from microtensor.nn.parallel import DistributedDataParallel


class _Request:
    pass


class _MirrorMPI:
    """What DistributedDataParallel and mt.distributed call of mpi4py.MPI."""
    IN_PLACE = object()
    SUM = "sum"
    BYTE = "byte"

    class Exception(Exception):
        pass

    class Request:
        @staticmethod
        def Testall(requests):
            return True


class _MirrorComm:
    def __init__(self, world_size):
        self.world_size = world_size
        self.allreduces = 0

    def Iallreduce(self, inplace, buffer, op):
        assert inplace is _MirrorMPI.IN_PLACE and op == _MirrorMPI.SUM
        buffer *= buffer.dtype.type(self.world_size)     # every rank sent the same numbers
        self.allreduces += 1
        return _Request()

    def Ibcast(self, buffer, root=0):
        return _Request()                                # the mirror already holds them

    def Ibarrier(self):
        return _Request()

    def Dup(self):
        return self


@pytest.fixture(params=[2, 3])
def mirror_world(request, monkeypatch):
    world = request.param
    comm = _MirrorComm(world)
    state = dist._state
    for name, value in dict(initialized=True, rank=0, world_size=world, MPI=_MirrorMPI,
                            comm=comm, timeout=30.0).items():
        monkeypatch.setattr(state, name, value)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj: out.__setitem__(slice(None), [obj] * len(out)))
    return comm


def _model(seed):
    mt.manual_seed(seed)
    return mt.nn.Sequential(mt.nn.Linear(7, 13), mt.nn.GELU(), mt.nn.Linear(13, 5))


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("bucket_cap_mb", [25, 1e-4])          # one bucket, or one per param
def test_the_mean_over_mirror_ranks_is_the_single_process_gradient(mirror_world, bucket_cap_mb):
    rng = np.random.default_rng(0)
    x, y = mt.tensor(rng.standard_normal((9, 7)), dtype=mt.float32), mt.tensor(rng.standard_normal((9, 5)), dtype=mt.float32)
    alone, wrapped = _model(1), _model(1)
    ddp = DistributedDataParallel(wrapped, bucket_cap_mb=bucket_cap_mb)
    _loss(alone, x, y).backward()
    _loss(ddp, x, y).backward()
    assert mirror_world.allreduces >= 1, "no all-reduce ran: the test proves nothing"
    for (name, p), q in zip(alone.named_parameters(), wrapped.parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


def test_no_sync_accumulates_and_the_next_sync_averages_the_sum(mirror_world):
    rng = np.random.default_rng(1)
    batches = [(mt.tensor(rng.standard_normal((4, 7)), dtype=mt.float32),
                mt.tensor(rng.standard_normal((4, 5)), dtype=mt.float32))
               for _ in range(3)]
    alone, wrapped = _model(2), _model(2)
    ddp = DistributedDataParallel(wrapped)
    for x, y in batches:
        _loss(alone, x, y).backward()
    with ddp.no_sync():
        for x, y in batches[:2]:
            _loss(ddp, x, y).backward()
    assert mirror_world.allreduces == 0
    _loss(ddp, *batches[2]).backward()
    assert mirror_world.allreduces >= 1
    for p, q in zip(alone.parameters(), wrapped.parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-6, atol=1e-7)
