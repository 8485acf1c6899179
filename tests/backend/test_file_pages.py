"""`file_pages.release`: the pages of a tensor mapped from a file leave the process and come
back with the file's content; a page written since mapping keeps the write; memory that is no
file's is never dropped. The truth each check compares with is the file's bytes as numpy wrote
them, and residency is read from /proc/self/pagemap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_fast.backend.llm import file_pages

PAGE = 4096
FLOATS_PER_PAGE = PAGE // 4


@pytest.fixture
def mapped(tmp_path):
    """(a float32 tensor privately mapped from a 64-page file and read whole, the file's
    values)."""
    values = np.random.default_rng(0).standard_normal(64 * FLOATS_PER_PAGE).astype(np.float32)
    path = tmp_path / "weights.bin"
    values.tofile(path)
    t = torch.from_file(str(path), shared=False, size=values.size, dtype=torch.float32)
    assert float(t.sum()) == pytest.approx(float(values.sum()), rel=1e-4)  # every page read
    return t, torch.from_numpy(values.copy())


def test_pages_of_a_file_leave_and_come_back_with_its_content(mapped):
    t, want = mapped
    assert file_pages.resident_bytes(t) >= 60 * PAGE
    dropped = file_pages.release([t])
    assert dropped >= 60 * PAGE
    assert file_pages.resident_bytes(t) <= 2 * PAGE  # (a page it shares with its neighbours)
    assert torch.equal(t, want)  # read again: the file's values


def test_a_written_page_keeps_the_write(mapped):
    """Dropping a page the process wrote to would turn it back into the file's content: it
    stays, and the others go."""
    t, want = mapped
    at = 10 * FLOATS_PER_PAGE + 3
    t[at] = 42.0
    want[at] = 42.0
    file_pages.release([t])
    assert PAGE <= file_pages.resident_bytes(t) <= 3 * PAGE
    assert torch.equal(t, want)
    t.mul_(2.0)  # every page written: none may go
    file_pages.release([t])
    assert torch.equal(t, want * 2.0)
    assert file_pages.resident_bytes(t) >= 64 * PAGE


def test_spared_stretches_stay_resident(mapped):
    t, want = mapped
    spare = [(t.data_ptr() + 5 * PAGE + 8, 4), (t.data_ptr() + 40 * PAGE - 2, 4)]  # 3 pages
    file_pages.release([t], spare=spare)
    assert 3 * PAGE <= file_pages.resident_bytes(t) <= 5 * PAGE
    assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_of_no_file_is_never_dropped(dtype):
    a = torch.randn(300_000).to(dtype)
    want = a.clone()
    assert file_pages.release([a, a[::7], None]) == 0
    assert torch.equal(a, want)
    assert file_pages.resident_bytes(a) >= a.numel() * a.element_size() - 2 * PAGE


def test_views_and_empty_tensors(mapped):
    t, want = mapped
    rows = t.view(64, FLOATS_PER_PAGE)
    file_pages.release([rows[8:16].t(), t[:0]])  # a transposed view: its rows' pages
    assert file_pages.resident_bytes(rows[9:15]) == 0
    assert file_pages.resident_bytes(rows[20:30]) == 10 * PAGE
    assert torch.equal(t, want)
