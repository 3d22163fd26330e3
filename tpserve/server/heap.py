"""Request bodies go back to the system once refused: the heap's setting that makes it so.

glibc serves an allocation over its mmap threshold with a mapping of its own, returned to the
system when freed; but the first such free raises the threshold to that size, so from then on
every 4 MiB body, its JSON text and its protobuf copy come from the heap's arenas (one per thread)
and stay there: rank 0 grew by hundreds of MB after a dozen refused big prompts and never shrank.
A fixed threshold turns that adjustment off, and after each large request the free memory of
every arena goes back too (malloc_trim: the smaller pieces a body was read in, which mmap never
served). Elsewhere than glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 << 10  # above this, an allocation is its own mapping
LARGE_REQUEST_BYTES = 1 << 20  # a request this large gives the heap's free memory back after it


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def give_back_free_memory() -> None:
    """Returns the heap's free memory to the system (glibc's malloc_trim; ctypes lets go of the
    GIL for the call)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim(0)


def return_large_frees_to_the_system() -> bool:
    """Fixes glibc's mmap threshold; True where it took effect."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("could not fix the heap's mmap threshold: refused large requests may keep memory")
        return False
    return True
