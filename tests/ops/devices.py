"""Where each backend's test tensors live, and the check that the compiled CPU kernels are there."""

from __future__ import annotations

import pytest
import torch


def device_for(backend: str) -> str:
    """``"cuda"`` for the CUDA backend, and for Triton when there is a GPU (without one,
    Triton runs on CPU tensors under its interpreter: tests/conftest.py); else ``"cpu"``."""
    on_gpu = backend == "cuda" or (backend == "triton" and torch.cuda.is_available())
    return "cuda" if on_gpu else "cpu"


def require_cpu_extension():
    """Fail the calling test, naming why, when the compiled CPU kernels (genlm_fast._C) are
    missing: the test environment always builds them, so their absence is a broken build,
    never a reason to skip."""
    from genlm_fast.ops import extension

    if not extension.has("cpu"):
        pytest.fail(f"the CPU extension is not available: {extension.why_missing('cpu')}")


@pytest.fixture(scope="module", autouse=True)
def cpu_extension_required():
    """`require_cpu_extension` for every test of a module that imports this fixture (autouse
    there)."""
    require_cpu_extension()
