"""The memory the fused decoder's packed weights live in: small pages at once, 2 MB pages later.

A forward streams every packed weight once; on 4 KB pages each 4 KB of it is one more TLB
miss and a point where the hardware prefetcher stops, which 2 MB pages avoid. But asking for
2 MB pages as the memory is first written (``MADV_HUGEPAGE`` before the packing) makes the
kernel find free 2 MB blocks then, compacting memory where the page cache has fragmented it:
a wait that can take longer than the packing itself. So `empty` maps ordinary pages, the
packing fills them, and `Gathering` hands the filled range to a thread of the lowest
scheduling class (``SCHED_IDLE``: it runs only on a CPU nothing else wants) that asks the
kernel to gather it into 2 MB pages one aligned stretch at a time, pausing between them
(``MADV_COLLAPSE``, Linux 6.1+). The contents never change: collapsing copies the small pages
into a huge one and swaps the mapping under any reader. Where the kernel cannot collapse,
the range is left marked ``MADV_HUGEPAGE`` for the kernel's own background collapsing
(khugepaged).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading

import torch

from genlm_fast.backend.llm.file_pages import libc_madvise

__all__ = ["Gathering", "collapse", "empty"]


def _pmd_bytes() -> int:
    """The size of a huge page the kernel maps with one page-table entry (2 MB on x86-64)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE = _pmd_bytes()
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
# a stretch the kernel could not gather now (memory too fragmented, pages busy): skip it
_TRY_LATER = (errno.EAGAIN, errno.EBUSY, errno.ENOMEM)
# seconds between two stretches gathered in the background: a collapse holds the process's
# memory map while it swaps a stretch, and the process's own allocations and page faults,
# which need it too, get through in between rather than queueing behind stretch after stretch
PAUSE = 0.002


def empty(numel: int, dtype=torch.float32) -> torch.Tensor:
    """``numel`` zeros of ``dtype`` in an anonymous mapping of their own (unmapped when the
    tensor goes, not kept by the C heap), on ordinary pages until `collapse` gathers them."""
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (the tensor keeps the mapping alive)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


def collapse(t: torch.Tensor, stop: threading.Event | None = None, pause: float = 0.0) -> int:
    """Gather the whole 2 MB stretches of ``t``'s memory (a contiguous CPU tensor made by
    `empty`) into 2 MB pages, ``pause`` seconds apart, until done or ``stop`` is set. Returns
    the bytes gathered (0 on a kernel that cannot, and elsewhere than Linux)."""
    if t.numel() == 0 or not sys.platform.startswith("linux"):
        return 0
    madvise = libc_madvise()
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if first >= last:
        return 0
    # (a hint for khugepaged too, wherever a stretch is left small)
    madvise(first, last - first, _MADV_HUGEPAGE)
    gathered = 0
    stop = stop or threading.Event()
    for at in range(first, last, HUGE):
        if stop.wait(pause) if pause else stop.is_set():
            break
        if madvise(at, HUGE, _MADV_COLLAPSE) == 0:
            gathered += HUGE
        elif ctypes.get_errno() not in _TRY_LATER:
            break  # (EINVAL: this kernel has no MADV_COLLAPSE, or huge pages are off)
    return gathered


class Gathering:
    """`collapse` of one tensor (made by `empty`, filled) in a thread that runs only on
    otherwise idle CPUs. `stop` it when the tensor is no longer used: the thread holds the
    tensor, and with it the mapping, until it ends."""

    def __init__(self, t: torch.Tensor):
        self.gathered = 0  # bytes gathered into 2 MB pages (set when the thread ends)
        self._stop = threading.Event()
        self._thread = None
        if t.numel() * t.element_size() >= HUGE:
            self._thread = threading.Thread(
                target=self._run, args=(t,), name="genlm_fast-huge-pages", daemon=True
            )
            self._thread.start()

    def _run(self, t):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (this thread only)
        except (AttributeError, OSError):
            return  # (not Linux: nothing to gather)
        self.gathered = collapse(t, self._stop, PAUSE)

    def stop(self) -> None:
        """End the gathering after the stretch in hand, and wait for the thread to let go of
        the tensor."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the gathering ended (done, stopped, or not possible here), waiting up to
        ``timeout`` seconds for it. (In a process forked from the one that started it, it
        has: the thread stayed behind.)"""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
