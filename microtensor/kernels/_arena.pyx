# cython: language_level=3
"""One block of memory for a replayed plan: numpy's data allocations, served by number.

A replay of a plan allocates the same arrays in the same order every time. The first
replay runs with logging on: each allocation's size, and when it was made and freed,
is written down (numpy hands every array's data allocation to the handler that is set,
NEP 49). microtensor/capture/memory.py then gives every allocation an offset in one
arena, so that allocations whose lifetimes do not overlap share memory. Later replays
run with the arena on: the k-th allocation gets its offset, free is a no-op.

Safety does not depend on the replay matching the log: the k-th allocation is served
from the arena only when its size is the planned one and every allocation planned to
share its memory is already freed; anything else (and anything still alive at the end
of the logged replay: results, gradients) comes from the C heap as usual. An array
remembers the handler that allocated it, so it is freed here whenever it dies.
"""
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_GetPointer
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memset, memcpy, strncpy

import numpy as np

cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyDataMemAllocator:
        void* ctx
        void* (*malloc)(void* ctx, size_t size) noexcept nogil
        void* (*calloc)(void* ctx, size_t nelem, size_t elsize) noexcept nogil
        void* (*realloc)(void* ctx, void* ptr, size_t new_size) noexcept nogil
        void (*free)(void* ctx, void* ptr, size_t size) noexcept nogil
    ctypedef struct PyDataMem_Handler:
        char name[127]
        uint8_t version
        PyDataMemAllocator allocator
    object PyDataMem_SetHandler(object handler)
    void import_array()

import_array()

DEF HEADER = 64          # bytes before each block: (kind, id); keeps 64-byte alignment
DEF HEAP = 0
DEF ARENA = 1
DEF PASS = 0             # modes: serve from the heap
DEF LOG = 1              #        serve from the heap, write the log
DEF SERVE = 2            #        serve planned allocations from the arena


cdef struct Ctx:
    PyDataMem_Handler handler
    int mode
    int64_t next                 # allocations so far in this replay
    int64_t clock                # events (allocations and frees) so far, when logging
    # the log: per allocation id, its size, and the clock at allocation and at free
    int64_t log_cap
    int64_t* log_size
    int64_t* log_alloc
    int64_t* log_free
    # the plan: per allocation id, its offset and size (0: not planned), and the ids it
    # shares memory with (CSR: conflicts[conflict_ptr[k] : conflict_ptr[k + 1]])
    int64_t n_plan
    int64_t* offset
    int64_t* size
    int64_t* conflict_ptr
    int64_t* conflicts
    char* live
    char* base
    int64_t capacity
    int64_t hits
    int64_t misses


cdef inline void* _heap(Ctx* c, size_t size, int64_t ident) noexcept nogil:
    cdef int64_t* h = <int64_t*>malloc(size + HEADER)
    if h == NULL:
        return NULL
    h[0] = HEAP
    h[1] = ident
    return <char*>h + HEADER


cdef void _log_grow(Ctx* c) noexcept nogil:
    cdef int64_t cap = c.log_cap * 2 if c.log_cap else 256
    c.log_size = <int64_t*>realloc(c.log_size, cap * sizeof(int64_t))
    c.log_alloc = <int64_t*>realloc(c.log_alloc, cap * sizeof(int64_t))
    c.log_free = <int64_t*>realloc(c.log_free, cap * sizeof(int64_t))
    c.log_cap = cap


cdef void* _malloc(void* ctx, size_t size) noexcept nogil:
    cdef Ctx* c = <Ctx*>ctx
    cdef int64_t k = c.next
    cdef int64_t i
    cdef int64_t* h
    if c.mode == PASS:
        return _heap(c, size, -1)
    c.next += 1
    if c.mode == LOG:
        if k >= c.log_cap:
            _log_grow(c)
        if c.log_size == NULL or c.log_alloc == NULL or c.log_free == NULL:
            c.mode = PASS
            return _heap(c, size, -1)
        c.log_size[k] = <int64_t>size
        c.log_alloc[k] = c.clock
        c.log_free[k] = -1
        c.clock += 1
        return _heap(c, size, k)
    # SERVE
    if k < c.n_plan and c.size[k] == <int64_t>size and size > 0 and not c.live[k]:
        for i in range(c.conflict_ptr[k], c.conflict_ptr[k + 1]):
            if c.live[c.conflicts[i]]:
                c.misses += 1
                return _heap(c, size, -1)
        h = <int64_t*>(c.base + c.offset[k])
        h[0] = ARENA
        h[1] = k
        c.live[k] = 1
        c.hits += 1
        return <char*>h + HEADER
    c.misses += 1
    return _heap(c, size, -1)


cdef void* _calloc(void* ctx, size_t nelem, size_t elsize) noexcept nogil:
    cdef size_t n = nelem * elsize
    if elsize and n // elsize != nelem:
        return NULL
    cdef void* p = _malloc(ctx, n)
    if p != NULL:
        memset(p, 0, n)
    return p


cdef void _free(void* ctx, void* ptr, size_t size) noexcept nogil:
    cdef Ctx* c = <Ctx*>ctx
    if ptr == NULL:
        return
    cdef int64_t* h = <int64_t*>(<char*>ptr - HEADER)
    if h[0] == ARENA:
        if 0 <= h[1] < c.n_plan:
            c.live[h[1]] = 0
        return
    if c.mode == LOG and 0 <= h[1] < c.next and h[1] < c.log_cap:
        c.log_free[h[1]] = c.clock
        c.clock += 1
    free(h)


cdef void* _realloc(void* ctx, void* ptr, size_t new_size) noexcept nogil:
    cdef Ctx* c = <Ctx*>ctx
    cdef int64_t* h
    cdef void* fresh
    if ptr == NULL:
        return _malloc(ctx, new_size)
    h = <int64_t*>(<char*>ptr - HEADER)
    if h[0] == HEAP:
        h = <int64_t*>realloc(h, new_size + HEADER)
        return NULL if h == NULL else <char*>h + HEADER
    fresh = _heap(c, new_size, -1)           # an arena block does not grow: move it
    if fresh != NULL:
        memcpy(fresh, ptr, min(new_size, <size_t>c.size[h[1]]))
        c.live[h[1]] = 0
    return fresh


cdef void _release(object capsule) noexcept:
    """The capsule dies when the Arena and every array it served are gone."""
    cdef Ctx* c = <Ctx*>PyCapsule_GetPointer(capsule, "mem_handler")
    _drop_plan(c)
    free(c.log_size)
    free(c.log_alloc)
    free(c.log_free)
    free(c)


cdef void _drop_plan(Ctx* c) noexcept:
    free(c.offset)
    free(c.size)
    free(c.conflict_ptr)
    free(c.conflicts)
    free(c.live)
    free(c.base)
    c.offset = c.size = c.conflict_ptr = c.conflicts = NULL
    c.live = c.base = NULL
    c.n_plan = c.capacity = 0


cdef class Arena:
    """The numpy allocation handler of one plan (see the module docstring)."""
    cdef Ctx* c
    cdef object capsule
    cdef object previous

    def __cinit__(self):
        self.c = <Ctx*>malloc(sizeof(Ctx))
        if self.c == NULL:
            raise MemoryError("Arena: no memory for its context")
        memset(self.c, 0, sizeof(Ctx))
        strncpy(self.c.handler.name, b"microtensor_arena", 126)
        self.c.handler.version = 1
        self.c.handler.allocator.ctx = self.c
        self.c.handler.allocator.malloc = _malloc
        self.c.handler.allocator.calloc = _calloc
        self.c.handler.allocator.realloc = _realloc
        self.c.handler.allocator.free = _free
        # numpy reads the handler struct through the capsule ("mem_handler"); the
        # context sits behind it, so the capsule's destructor frees both
        self.capsule = PyCapsule_New(<void*>self.c, "mem_handler", _release)

    def start(self, str mode):
        """Set this arena as numpy's handler (in this thread's context) for one replay:
        mode 'log' writes the log, 'serve' serves the plan."""
        if self.previous is not None:
            raise RuntimeError("Arena.start: already started")
        if mode == "log":
            self.c.mode = LOG
            self.c.clock = 0
        elif mode == "serve":
            if self.c.n_plan == 0:
                raise RuntimeError("Arena.start('serve'): no plan")
            self.c.mode = SERVE
        else:
            raise ValueError(f"Arena.start: mode must be 'log' or 'serve', got {mode!r}")
        self.c.next = 0
        self.previous = PyDataMem_SetHandler(self.capsule)

    def stop(self):
        """Put back the handler that was set before start()."""
        if self.previous is None:
            return
        PyDataMem_SetHandler(self.previous)
        self.previous = None
        self.c.mode = PASS

    def log(self):
        """(sizes, allocated at, freed at or -1) of the logged replay, as int64 arrays."""
        n = min(self.c.next, self.c.log_cap)
        sizes = np.empty(n, dtype=np.int64)
        alloc = np.empty(n, dtype=np.int64)
        freed = np.empty(n, dtype=np.int64)
        cdef int64_t i
        for i in range(n):
            sizes[i] = self.c.log_size[i]
            alloc[i] = self.c.log_alloc[i]
            freed[i] = self.c.log_free[i]
        return sizes, alloc, freed

    def set_plan(self, offsets, sizes, conflict_ptr, conflicts, long long capacity):
        """Give allocation k the block [offset[k], offset[k] + HEADER + size[k]) of one
        arena of `capacity` bytes; sizes[k] == 0 leaves k to the heap."""
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        conflict_ptr = np.ascontiguousarray(conflict_ptr, dtype=np.int64)
        conflicts = np.ascontiguousarray(conflicts, dtype=np.int64)
        n = len(sizes)
        if len(offsets) != n or len(conflict_ptr) != n + 1:
            raise ValueError("Arena.set_plan: offsets, sizes and conflict_ptr disagree in length")
        if capacity < 0 or (n and (offsets.min() < 0 or sizes.min() < 0)):
            raise ValueError("Arena.set_plan: negative offset, size or capacity")
        if n and ((offsets + sizes + HEADER) * (sizes > 0)).max() > capacity:
            raise ValueError("Arena.set_plan: a block ends past the arena's capacity")
        if conflict_ptr[0] != 0 or (n and (np.diff(conflict_ptr).min() < 0
                                           or conflict_ptr[n] != len(conflicts))):
            raise ValueError("Arena.set_plan: conflict_ptr is not a CSR row pointer")
        if len(conflicts) and (conflicts.min() < 0 or conflicts.max() >= n):
            raise ValueError("Arena.set_plan: a conflict names no allocation")
        if self.previous is not None:
            raise RuntimeError("Arena.set_plan: not while started")
        if self.c.n_plan:
            # arrays served from the arena may still be alive: its memory stays theirs
            raise RuntimeError("Arena.set_plan: a plan is set once (make a new Arena)")
        cdef Ctx* c = self.c
        c.offset = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
        c.size = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
        c.conflict_ptr = <int64_t*>malloc((n + 1) * sizeof(int64_t))
        c.conflicts = <int64_t*>malloc(max(len(conflicts), 1) * sizeof(int64_t))
        c.live = <char*>malloc(max(n, 1))
        c.base = <char*>malloc(max(capacity, 64) + 64)
        if (c.offset == NULL or c.size == NULL or c.conflict_ptr == NULL or c.conflicts == NULL
                or c.live == NULL or c.base == NULL):
            _drop_plan(c)
            raise MemoryError(f"Arena.set_plan: no memory for an arena of {capacity} bytes")
        cdef int64_t i
        cdef size_t shift = (64 - (<size_t>c.base) % 64) % 64
        for i in range(n):
            c.offset[i] = offsets[i] + <int64_t>shift
            c.size[i] = sizes[i]
            c.live[i] = 0
            c.conflict_ptr[i] = conflict_ptr[i]
        c.conflict_ptr[n] = conflict_ptr[n]
        for i in range(len(conflicts)):
            c.conflicts[i] = conflicts[i]
        c.n_plan = n
        c.capacity = capacity
        c.hits = c.misses = 0

    @property
    def capacity(self):
        return self.c.capacity

    @property
    def counts(self):
        """(allocations served from the arena, from the heap) since the plan was set."""
        return self.c.hits, self.c.misses

    def __dealloc__(self):
        if self.previous is not None:
            PyDataMem_SetHandler(self.previous)
            self.previous = None
