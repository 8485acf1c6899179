"""The packed weights' memory (genlm_fast/backend/llm/packed_pages.py): zeros that go back to
the system with their tensor, and the gathering into 2 MB pages, checked against the kernel's
own accounting (/proc/self/smaps) and against a copy of the contents made before."""

from __future__ import annotations

import gc
import os
import platform
import time

import pytest
import torch

from genlm_fast.backend.llm.packed_pages import HUGE, Gathering, collapse, empty


def _resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _huge_bytes(t):
    """AnonHugePages of the mappings ``t`` lies in, as /proc/self/smaps reports them (marking
    a stretch for huge pages splits a mapping in up to three)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _kernel_collapses() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            off = "[never]" in f.read()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and not off


@pytest.mark.parametrize("numel", [0, 1, 1000, (4 << 20) + 3])
def test_empty_is_zeros_and_goes_back_with_its_tensor(numel):
    t = empty(numel)
    assert t.dtype == torch.float32 and t.shape == (numel,)
    assert torch.equal(t, torch.zeros(numel))
    t += torch.arange(numel, dtype=torch.float32)
    assert torch.equal(t, torch.arange(numel, dtype=torch.float32))
    before = _resident()
    del t
    gc.collect()
    if numel >= 1 << 20:
        assert before - _resident() >= numel * 4 * 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_keeps_the_contents_and_makes_2mb_pages(dtype):
    numel = (9 * HUGE + 12345) // dtype.itemsize  # whole stretches and ragged ends
    t = empty(numel, dtype)
    t.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype))
    want = t.clone()
    assert _huge_bytes(t) == 0  # ordinary pages until gathered
    gathered = collapse(t)
    assert torch.equal(t, want)
    assert _huge_bytes(t) == gathered
    if _kernel_collapses():
        # every whole 2 MB stretch inside the mapping: 8 or 9 of them, by where it starts
        assert gathered >= 8 * HUGE
    t += 1  # still an ordinary writable tensor
    assert torch.equal(t, want + 1)


def test_gathering_in_the_background_ends_and_keeps_the_contents():
    t = empty(5 * HUGE // 4)
    t.copy_(torch.randn(t.numel(), generator=torch.Generator().manual_seed(1)))
    want = t.clone()
    gathering = Gathering(t)
    # (it runs only on idle CPUs: this thread sleeps in the wait, so one is)
    assert gathering.wait(timeout=120)
    assert torch.equal(t, want)
    assert _huge_bytes(t) == gathering.gathered
    if _kernel_collapses():
        assert gathering.gathered >= 4 * HUGE


def test_a_stopped_gathering_lets_go_of_its_tensor():
    """`stop` returns once the thread holds the tensor no more: its mapping goes back to the
    system when the caller drops it, at once."""
    t = empty(64 * HUGE // 4)
    t.fill_(1.0)
    gathering = Gathering(t)
    before = _resident()
    del t
    gathering.stop()
    assert gathering.wait(timeout=0)
    gc.collect()
    assert before - _resident() >= 0.9 * 64 * HUGE


def test_a_tensor_under_2mb_needs_no_thread():
    gathering = Gathering(empty(1000))
    assert gathering.wait(timeout=0) and gathering.gathered == 0
    start = time.perf_counter()
    gathering.stop()
    assert time.perf_counter() - start < 1.0


_FORKED = {}


def _wait_in_child():
    os._exit(0 if _FORKED["gathering"].wait(timeout=30) else 1)


def test_a_forked_child_does_not_wait_for_its_parents_gathering():
    """A process forked while a gathering runs (a worker pool's fork) has no such thread:
    waiting for it returns at once rather than waiting out its timeout (or hanging)."""
    import multiprocessing

    t = empty(256 * HUGE // 4)
    t.fill_(1.0)
    _FORKED["gathering"] = Gathering(t)
    try:
        child = multiprocessing.get_context("fork").Process(target=_wait_in_child)
        start = time.perf_counter()
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0 and time.perf_counter() - start < 20
    finally:
        _FORKED.pop("gathering").stop()
