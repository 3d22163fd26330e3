"""Loading on a GPU drops the checkpoint's pages from the page cache (tpserve/ranks/weights.py): on a
unified-memory GPU that cache is the memory the KV pool needs next. Seen here with mincore on a
model written for the test: its safetensors pages are resident after a read, and gone after a load
that drops them (on a CPU a load keeps them unless asked: a CPU's restart reads them again)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch
from tiny_models import write_tiny_model

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.sharding import pieces_of_rank
from tpserve.ranks.weights import read_rank_weights

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(path) -> int:
    """How many of the file's pages the page cache holds (mincore on a fresh mapping)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        base = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed here")
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        failed = LIBC.mincore(base, size, pages)
        LIBC.munmap(base, size)
    finally:
        os.close(fd)
    if failed:
        pytest.skip(f"mincore is refused here (errno {ctypes.get_errno()})")
    return sum(page & 1 for page in pages)


def cached_model(tmp_path):
    # The model's weights written out, synced (dirty pages are not dropped) and read back, so
    # every page is in the cache.
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
            handle.read()
    if any(resident_pages(path) == 0 for path in files):
        pytest.skip("this file system keeps no page cache for the test's files")
    return model_dir, files


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_a_load_that_drops_the_cache_leaves_none_of_the_files_pages(tmp_path):
    model_dir, files = cached_model(tmp_path)
    config = load_model_config(model_dir)
    # In bfloat16, so every weight is a copy of its own, as a GPU's are (a CPU load in the file's
    # own dtype may keep views of the mapped file, whose pages stay)
    pieces = pieces_of_rank(config, 0, 1)
    kept = read_rank_weights(model_dir, config, pieces, torch.bfloat16)
    assert all(resident_pages(path) > 0 for path in files)  # a CPU load leaves them
    weights = read_rank_weights(model_dir, config, pieces, torch.bfloat16, drop_cached=True)
    assert [resident_pages(path) for path in files] == [0] * len(files)
    assert all(torch.equal(weights.replicated[n], kept.replicated[n]) for n in kept.replicated)
