"""One rank of the distributed tests: tests/test_distributed.py starts it as

    mpiexec -n 2 python tests/mpi_ddp_worker.py SCENARIO OUT_DIR

and checks what the ranks write to OUT_DIR (rank<r>.npz, rank<r>.json) against a
single process. The model and batch helpers below are imported by the test too, so
both sides build exactly the same model and the same data.

Scenarios:
  correctness   primitives, broadcast, gradients, no_sync, a loss curve (one launch);
                with --leaf-hooks, DDP's stand-in for a core without post-accumulate hooks
  stuck         rank 1 never reaches the collective that rank 0 waits in
  die           rank 1 exits abruptly in the middle of training
  raises        rank 1 ends with an uncaught exception
"""
import json
import os
import sys
import time

import numpy as np

VOCAB, BLOCK, B = 13, 8, 3      # a tiny GPT; B sequences per rank
STEPS = 4                       # optimizer steps of the loss-curve check
SEED = 1234


def small_gpt(seed):
    import microtensor as mt
    from models import GPT, GPTConfig
    mt.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16))


def global_batch(step, world_size):
    """The batch of `step` for the whole job: world_size * B rows. Rank r trains on rows
    r*B .. (r+1)*B; one process trains on all of them."""
    rng = np.random.default_rng([SEED, step])
    data = rng.integers(0, VOCAB, size=(world_size * B, BLOCK + 1))
    return data[:, :-1].astype(np.int64), data[:, 1:].astype(np.int64)


def rows(array, rank):
    return array[rank * B:(rank + 1) * B]


def make_optimizer(model):
    import microtensor as mt
    return mt.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def train_step(model, optimizer, x, y):
    """forward, backward, clip, AdamW; returns the loss of this (rank's) batch."""
    import microtensor as mt
    _, loss = model(mt.from_numpy(x), mt.from_numpy(y))
    loss.backward()
    mt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def grads(model):
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def params(model):
    return {n: p.numpy().copy() for n, p in model.named_parameters()}


# ---- scenarios --------------------------------------------------------------------

def correctness(out_dir):
    import microtensor as mt
    import microtensor.distributed as dist
    from microtensor.nn.parallel import DistributedDataParallel

    rank, world = dist.init()
    report = dict(rank=rank, world=world, mpi4py_loaded="mpi4py.MPI" in sys.modules)
    arrays = {}

    # primitives
    t = mt.full((2, 3), float(rank + 1))
    report["all_reduce_returns_same"] = dist.all_reduce(t) is t
    report["all_reduce_sum"] = t.numpy().tolist()
    t = mt.full((4,), float(rank + 1))
    report["all_reduce_mean"] = dist.all_reduce(t, op="mean").numpy().tolist()
    t = mt.arange(6).reshape(2, 3) * (rank + 1)                 # int64
    report["all_reduce_int"] = dist.all_reduce(t).numpy().tolist()
    base = mt.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1))
    view = base.transpose(0, 1)                                  # not contiguous
    dist.all_reduce(view)
    report["all_reduce_view_base"] = base.numpy().tolist()
    t = mt.full((3,), float(10 * rank))
    report["broadcast_src1"] = dist.broadcast(t, src=1).numpy().tolist()
    try:
        dist.all_reduce(mt.zeros(2), op="max")
        report["bad_op"] = "no error"
    except ValueError as e:
        report["bad_op"] = str(e)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "text": "x" * (rank * 100)})
    report["gathered"] = [g["rank"] for g in gathered] + [len(g["text"]) for g in gathered]
    dist.barrier()

    # broadcast of the initial weights: each rank builds its model from its own seed
    model = small_gpt(SEED + rank)
    arrays.update({f"own_init/{n}": v for n, v in params(model).items()})
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)    # several buckets
    report["hook_mode"] = ddp.hook_mode
    report["buckets"] = ddp.stats["buckets"]
    arrays.update({f"init/{n}": v for n, v in params(model).items()})

    # gradients of one batch. A probe on the token embeddings' output, the last
    # non-leaf that backward reaches, counts the buckets already on the wire by then:
    # more than 0 means communication overlapped the rest of backward
    def probe(module, args, output):
        output.register_hook(lambda g: report.__setitem__("buckets_before_last_node",
                                                          ddp._next_bucket))
    handle = model.transformer.wte.register_forward_hook(probe)
    x, y = global_batch(0, world)
    _, loss = ddp(mt.from_numpy(rows(x, rank)), mt.from_numpy(rows(y, rank)))
    loss.backward()
    handle.remove()
    report["started_early"] = ddp.stats["started_early"]
    arrays.update({f"grad/{n}": v for n, v in grads(model).items()})

    # no_sync: the first micro-batch stays local, the second backward averages the sum
    model.zero_grad(set_to_none=True)
    xa, ya = global_batch(1, world)
    xb, yb = global_batch(2, world)
    with ddp.no_sync():
        _, loss = ddp(mt.from_numpy(rows(xa, rank)), mt.from_numpy(rows(ya, rank)))
        loss.backward()
    arrays.update({f"local/{n}": v for n, v in grads(model).items()})
    _, loss = ddp(mt.from_numpy(rows(xb, rank)), mt.from_numpy(rows(yb, rank)))
    loss.backward()
    arrays.update({f"accum/{n}": v for n, v in grads(model).items()})

    # a loss curve: STEPS AdamW steps, each rank on its rows of the global batch; the
    # curve is the mean of the ranks' losses (= the loss of the whole batch)
    model = small_gpt(SEED + rank)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    curve = []
    for step in range(STEPS):
        x, y = global_batch(100 + step, world)
        loss = train_step(ddp, optimizer, rows(x, rank), rows(y, rank))
        curve.append(dist.all_reduce(loss.detach(), op="mean").item())
    report["curve"] = curve
    arrays.update({f"final/{n}": v for n, v in params(model).items()})

    # a parameter that takes no part in the loss: the next forward says which
    model = small_gpt(SEED)
    model.unused = mt.nn.Parameter(mt.zeros(3))
    ddp = DistributedDataParallel(model)
    _, loss = ddp(mt.from_numpy(rows(x, rank)), mt.from_numpy(rows(y, rank)))
    loss.backward()
    try:
        ddp(mt.from_numpy(rows(x, rank)), mt.from_numpy(rows(y, rank)))
        report["unused"] = "no error"
    except RuntimeError as e:
        report["unused"] = str(e)

    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def stuck(out_dir):
    """Rank 1 sleeps instead of joining the all-reduce: rank 0 must give up."""
    import microtensor as mt
    import microtensor.distributed as dist
    rank, _ = dist.init()
    dist.barrier()
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(mt.ones(4))
    print("rank 0 was not stopped", flush=True)


def die(out_dir):
    """Rank 1 dies abruptly after two training steps; rank 0 trains on."""
    import microtensor as mt
    import microtensor.distributed as dist
    from microtensor.nn.parallel import DistributedDataParallel
    rank, world = dist.init()
    model = small_gpt(SEED)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    for step in range(1000):
        if rank == 1 and step == 2:
            os._exit(3)
        x, y = global_batch(step, world)
        train_step(ddp, optimizer, rows(x, rank), rows(y, rank))
    print("rank 0 trained on alone", flush=True)


def raises(out_dir):
    """Rank 1 stops with an uncaught exception; rank 0 waits in a collective."""
    import microtensor as mt
    import microtensor.distributed as dist
    rank, _ = dist.init()
    dist.barrier()
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(mt.ones(4))
    print("rank 0 was not stopped", flush=True)


if __name__ == "__main__":
    scenario, out = sys.argv[1], sys.argv[2]
    if "--leaf-hooks" in sys.argv:
        # DDP's stand-in for cores without post-accumulate hooks, tested on this core too
        import microtensor.nn.parallel
        microtensor.nn.parallel._has_post_accumulate_hooks = lambda: False
    {"correctness": correctness, "stuck": stuck, "die": die, "raises": raises}[scenario](out)
