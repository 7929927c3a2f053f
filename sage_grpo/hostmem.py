"""Host memory that tensors free goes back to the operating system at once.

glibc's malloc serves an allocation below its mmap threshold from its heap, and each time a block it had mapped is
freed it raises that threshold to the block's size (up to 32 MiB). After the first few frees, tensors of a few MiB
(the weights of a gathered FSDP2 block, a real-width model's activations on the CPU) come from the heap, and what is
freed below the heap's top stays with the process. How much stays depends on the order in which threads free, so it
differs between ranks that run the same code: at the real 8.3B width on two FSDP2 CPU ranks, one rank's heap kept
3.4 GiB free (glibc's own count) through the rollout and that rank ran out of host memory first.

A fixed threshold turns the raising off: every allocation from the threshold up is its own mapping, unmapped when
freed. torch's CPU allocator calls malloc and has no such switch (torch.cpu has no call to release memory), so this
sets glibc's option itself.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "free_host_memory_eagerly", "users_threshold"]

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting threshold, now kept: smaller blocks are not worth a mapping each


def users_threshold(environ) -> bool:
    """Whether the environment sets glibc's mmap threshold: MALLOC_MMAP_THRESHOLD_, or the tunable
    glibc.malloc.mmap_threshold among GLIBC_TUNABLES' colon-separated name=value pairs (glibc reads both at
    start-up; the tunable is the newer spelling of the same option)."""
    if "MALLOC_MMAP_THRESHOLD_" in environ:
        return True
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    return any(t.partition("=")[0].strip() == "glibc.malloc.mmap_threshold" for t in tunables)


def free_host_memory_eagerly(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for the rest of this process -> whether it was set. Not set:
    with another C library (nothing to change), or when the environment sets the threshold (`users_threshold`: the
    user's own setting, which glibc read at start-up, wins)."""
    if users_threshold(os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl's C library has another name, macOS has none by that name)
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold)))
