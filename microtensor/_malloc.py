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

So at import microtensor sets the mmap threshold to 32 MiB (blocks below it come from
the heap and are reused) and the trim threshold to 256 MiB (the heap keeps up to that
much free memory for the next step), through glibc's mallopt. The process keeps its
peak memory rather than giving it back between steps. An explicit MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ or MALLOC_TOP_PAD_ in the environment wins (nothing is changed),
and MICROTENSOR_MALLOC=default leaves glibc's defaults alone. Other C libraries (musl,
macOS, Windows) are left alone.
"""
import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20       # glibc's largest (its dynamic threshold's ceiling on 64-bit)
TRIM_THRESHOLD = 256 << 20
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

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


def apply():
    """Tune glibc's malloc as the module docstring says; returns (and keeps in `state`) a
    dict: tuned (bool), reason, and the two thresholds when tuned."""
    global state
    setting = os.environ.get("MICROTENSOR_MALLOC", "auto").strip().lower() or "auto"
    user = [v for v in USER_VARIABLES if v in os.environ]
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
