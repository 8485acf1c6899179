"""Where each backend's test tensors live."""

from __future__ import annotations

import torch


def device_for(backend: str) -> str:
    """``"cuda"`` for the CUDA backend, and for Triton when there is a GPU (without one,
    Triton runs on CPU tensors under its interpreter: tests/conftest.py); else ``"cpu"``."""
    on_gpu = backend == "cuda" or (backend == "triton" and torch.cuda.is_available())
    return "cuda" if on_gpu else "cpu"
