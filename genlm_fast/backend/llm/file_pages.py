"""Give back the resident pages of weights mapped from their checkpoint file.

transformers loads a safetensors checkpoint in its own dtype (``dtype="auto"``, what
`load_model_by_name` asks for) by mapping the file privately: each parameter is a view of the
mapping, and a page of it becomes resident when first read. Once the fused decoder has packed
the weights, every forward reads the packed copy, and the pages the packing read would only
double the memory the model takes. `release` drops them from the process (``madvise(...,
MADV_DONTNEED)``): the tensors stay valid, and whatever reads them later (an embedding's
rows, the weight watch's samples, a user, packing again) maps those pages again from the page
cache or the file.

Only pages that still are the file's are dropped. A page the process has written to (an
in-place edit of a weight, before or after loading) is a private copy of it that dropping
would turn back into the file's content, and memory that is no file's (a model converted to
another dtype while loading, or built in memory) would be lost: both are anonymous pages and
are kept, as ``/proc/self/pagemap`` tells page by page. Where that file cannot be read (not
Linux), nothing is dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

__all__ = ["release", "resident_bytes"]

PAGEMAP = "/proc/self/pagemap"
_PAGE = mmap.PAGESIZE
_PRESENT = np.uint64(1 << 63)
_FILE = np.uint64(1 << 61)  # a page of a file (or of shared memory), not a private copy
_MADV_DONTNEED = 4
_MADV_NOHUGEPAGE = 15
_MADV_RANDOM = 1


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The address range [start, end) that ``t``'s elements lie in."""
    if t.numel() == 0:
        return 0, 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _flags(fd: int, start: int, end: int) -> tuple[int, np.ndarray]:
    """(first page, each page's pagemap entry) of the pages that [start, end) touches."""
    first, last = start // _PAGE, (end - 1) // _PAGE
    data = os.pread(fd, 8 * (last - first + 1), 8 * first)
    return first, np.frombuffer(data, dtype=np.uint64)


def libc_madvise():
    """libc's ``madvise(address, length, advice) -> 0 | -1`` (errno kept for ctypes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def _pages(spare) -> np.ndarray:
    """The sorted page numbers that the ``(address, bytes)`` stretches of ``spare`` touch."""
    pages = [
        np.arange(a // _PAGE, (a + max(1, n) - 1) // _PAGE + 1, dtype=np.int64) for a, n in spare
    ]
    return np.unique(np.concatenate(pages)) if pages else np.zeros(0, dtype=np.int64)


def release(tensors, spare=()) -> int:
    """Drop the resident pages of ``tensors`` (CPU tensors; None is skipped) that are still
    their file's (module docstring), but for those holding any of the ``(address, bytes)``
    stretches of ``spare`` (memory read often, which a drop would only bring back). Returns
    the bytes dropped."""
    spare_pages = _pages(spare)
    try:
        fd = os.open(PAGEMAP, os.O_RDONLY)
    except OSError:
        return 0
    madvise = libc_madvise()
    dropped = 0
    try:
        for t in tensors:
            if t is None or t.device.type != "cpu":
                continue
            start, end = _extent(t)
            if end <= start:
                continue
            try:
                first, flags = _flags(fd, start, end)
            except OSError:
                return dropped
            droppable = (flags & (_PRESENT | _FILE)) == (_PRESENT | _FILE)
            lo, hi = np.searchsorted(spare_pages, [first, first + len(flags)])
            droppable[spare_pages[lo:hi] - first] = False
            # runs of droppable pages: [a, b) in page indices from ``first``
            edges = np.flatnonzero(np.diff(np.concatenate(([0], droppable.astype(np.int8), [0]))))
            for a, b in zip(edges[0::2], edges[1::2]):
                addr, length = (first + int(a)) * _PAGE, int(b - a) * _PAGE
                # a page read again later (a weight check's sample, an embedding row) is then
                # mapped alone, not with the 2 MB of file around it
                madvise(addr, length, _MADV_NOHUGEPAGE)
                madvise(addr, length, _MADV_RANDOM)
                if madvise(addr, length, _MADV_DONTNEED) == 0:
                    dropped += length
    finally:
        os.close(fd)
    return dropped


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages ``t`` lies in that are resident in this process (0 where pagemap
    cannot be read)."""
    start, end = _extent(t)
    if end <= start:
        return 0
    try:
        fd = os.open(PAGEMAP, os.O_RDONLY)
    except OSError:
        return 0
    try:
        _, flags = _flags(fd, start, end)
    finally:
        os.close(fd)
    return int(np.count_nonzero(flags & _PRESENT)) * _PAGE
