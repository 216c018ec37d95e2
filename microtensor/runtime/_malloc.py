"""Freed memory kept for the next step: glibc's malloc tuned once, at import.

A training step allocates the same arrays every step (activations, gradients, the
outputs of every matmul) and frees them before the next. With glibc's defaults a
freed block above the mmap threshold (128 KiB, raised as blocks are freed, at most
32 MiB) goes back to the kernel at once, and the top of the heap is handed back
whenever more than twice that is free. The next step gets the memory again as fresh
pages: a page fault and a zeroed page per 4 KiB. Measured on a 2-core Intel Xeon
(Sapphire Rapids class, KVM guest) at one thread, one GPT training step:

  config   page faults per step   ms per step
           glibc default  tuned   glibc default  tuned
  tiny         1,595        115        20.9        16.2
  cpu         10,704        817       112.2        90.4

(/proc's minor-fault count, median of 6 alternating rounds of 8 steps in one process;
benchmarks/bench_malloc.py.) PyTorch's own allocations did not fault in the same loop.

So at import microtensor sets, through glibc's mallopt (which fixes both: glibc's own
thresholds stop moving):

  mmap threshold  8 MiB   a block of 8 MiB or more is mapped on its own and given back
                          to the kernel when it is freed: never kept. Smaller blocks
                          come from the heap, and a freed one is reused by the next.
  trim threshold 64 MiB   when more than 64 MiB is free at the top of the heap, glibc
                          gives the top back (down to 128 KiB, its top pad).

So what the process keeps after freeing is: (a) at most 64 MiB free at the heap's top,
and (b) freed blocks under 8 MiB that lie below a block still in use, which no heap can
give back by moving its top; glibc's own defaults keep those too (for blocks up to its
moving threshold, 32 MiB at most). (b) is never more than the peak of what the process
held in blocks under 8 MiB at once; `trim()` (glibc's malloc_trim) hands those pages
back. Freeing 29 of 30 arrays of 20 MiB keeps nothing of them (tests/test_malloc.py
measures that and (a) and (b) in a child process). This applies to every malloc of the
process, numpy's own arrays included.

The environment's own settings win: when any of MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or MALLOC_MMAP_MAX_ is set, or GLIBC_TUNABLES
names a glibc.malloc tunable, nothing is changed. MICROTENSOR_MALLOC=default (or off, 0)
leaves glibc's defaults alone; auto (or unset, or empty) tunes; the value's case does not
matter, and another value warns and means auto. Other C libraries (musl, macOS, Windows)
are left alone.
"""
import ctypes
import os
import sys
import warnings

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20        # a block at least this big is mapped alone, never kept
TRIM_THRESHOLD = 64 << 20       # free memory at the heap's top kept at most
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
CHOICES = {"auto": "auto", "": "auto", "default": "default", "off": "default", "0": "default"}

state = {"tuned": False, "reason": "not applied yet"}


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc
    except (OSError, AttributeError):       # musl and the like: no mallopt of glibc's
        return None


def user_settings(environ=None):
    """The allocator settings the user made in the environment (names), if any."""
    env = os.environ if environ is None else environ
    found = [v for v in USER_VARIABLES if v in env]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        found.append("GLIBC_TUNABLES (glibc.malloc.*)")
    return found


def request(environ=None):
    """MICROTENSOR_MALLOC read: 'auto' or 'default' (an unknown value warns: auto)."""
    env = os.environ if environ is None else environ
    raw = env.get("MICROTENSOR_MALLOC", "auto")
    value = CHOICES.get(raw.strip().lower())
    if value is None:
        warnings.warn(f"MICROTENSOR_MALLOC={raw!r} is not one of auto, default (off, 0); "
                      "using auto", RuntimeWarning, stacklevel=3)
        value = "auto"
    return value


def apply():
    """Tune glibc's malloc as the module docstring says; returns (and keeps in `state`) a
    dict: tuned (bool), reason, and the two thresholds when tuned."""
    global state
    setting = request()
    user = user_settings()
    if setting == "default":
        state = {"tuned": False, "reason": "MICROTENSOR_MALLOC=default"}
    elif user:
        state = {"tuned": False, "reason": f"{', '.join(user)} set in the environment"}
    else:
        libc = _glibc()
        if libc is None:
            state = {"tuned": False, "reason": "not glibc"}
        elif (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1):
            state = {"tuned": True, "reason": "glibc: freed memory kept for reuse",
                     "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
        else:
            state = {"tuned": False, "reason": "glibc refused mallopt"}
    return state


def trim():
    """Give every free page of the heap back to the kernel (glibc's malloc_trim(0)),
    those below blocks still in use included. True when memory was given back; False
    too where the C library is not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
