"""Memory planning: one arena per plan, sized from a logged replay.

The first replay of a plan logs every array allocation: its size, and when it was
made and freed (microtensor/kernels/_arena.pyx). An allocation still alive when the replay
ends (the result, the parameters' gradients) stays on the heap. The others are placed
in one arena, largest first, each at the lowest offset where it overlaps in memory no
placed allocation that is alive at the same time: allocations whose lifetimes do not
overlap share memory. Later replays take their allocations from the arena by number.
"""
import numpy as np

from microtensor.kernels._arena import Arena

HEADER = 64          # the arena's per-block header (see kernels/_arena.pyx)


def _block(size):
    return HEADER + ((int(size) + 63) // 64) * 64


def place(sizes, alloc, freed):
    """(offsets, planned sizes, capacity) for the logged allocations: an allocation
    never freed gets planned size 0 (the heap keeps it)."""
    n = len(sizes)
    offsets = np.zeros(n, dtype=np.int64)
    planned = np.where(freed >= 0, sizes, 0).astype(np.int64)
    order = sorted((k for k in range(n) if planned[k] > 0), key=lambda k: (-sizes[k], k))
    placed = []                       # (offset, end, alloc, freed)
    capacity = 0
    for k in order:
        start, end = alloc[k], freed[k]
        size = _block(sizes[k])
        busy = sorted((o, e) for o, e, a, f in placed if a < end and start < f)
        offset = 0
        for o, e in busy:             # the lowest gap that fits
            if offset + size <= o:
                break
            offset = max(offset, e)
        offsets[k] = offset
        placed.append((offset, offset + size, start, end))
        capacity = max(capacity, offset + size)
    return offsets, planned, capacity


def conflicts(offsets, planned):
    """CSR (row pointer, ids): for each planned allocation, the others that share any
    of its memory (each must be freed before it is served)."""
    n = len(planned)
    used = planned > 0
    ends = offsets + np.array([_block(s) for s in planned], dtype=np.int64)
    ptr, ids = [0], []
    for k in range(n):
        if used[k]:
            hit = used & (offsets < ends[k]) & (offsets[k] < ends)
            hit[k] = False
            ids.extend(np.flatnonzero(hit).tolist())
        ptr.append(len(ids))
    return np.array(ptr, dtype=np.int64), np.array(ids, dtype=np.int64)


class Memory:
    """A plan's arena: logged on the first replay, serving from the second on."""

    def __init__(self):
        self.arena = Arena()
        self.state = "log"            # then "serve", or "off" when there is nothing to plan
        self.allocations = 0
        self.unshared = 0             # bytes the planned allocations take without sharing
        self.persistent = 0           # allocations left on the heap (alive at the end)

    def begin(self):
        if self.state != "off":
            self.arena.start(self.state)

    def end(self):
        if self.state == "off":
            return
        self.arena.stop()
        if self.state == "log":
            sizes, alloc, freed = self.arena.log()
            offsets, planned, capacity = place(sizes, alloc, freed)
            self.allocations = len(sizes)
            self.unshared = int(sum(_block(s) for s in planned if s))
            self.persistent = int((planned == 0).sum())
            if capacity == 0:
                self.state = "off"
                return
            ptr, ids = conflicts(offsets, planned)
            self.arena.set_plan(offsets, planned, ptr, ids, capacity)
            self.state = "serve"

    def describe(self):
        if self.state == "log":
            return "memory: planned after the first replay"
        if self.state == "off":
            return "memory: nothing to plan (every allocation outlives the call)"
        hits, misses = self.arena.counts
        return (f"memory: one arena of {_mib(self.arena.capacity)} for {self.allocations} "
                f"allocations ({_mib(self.unshared)} without sharing; {self.persistent} "
                f"outlive the call and stay on the heap); served {hits} from the arena, "
                f"{misses} from the heap so far")


def _mib(n):
    return f"{n / 2**20:.2f} MiB"
