"""Language-model backends with the genlm.backend ``llm`` API.

``AsyncTransformer`` (Hugging Face transformers) and ``MockAsyncLM`` are available
everywhere. ``AsyncVirtualLM`` (vLLM) is imported on first use; without vLLM installed it
still imports and raises ImportError when built. MLX and SGLang backends are not offered:
``AsyncMlxLM`` and ``AsyncSGLTransformer`` are stand-ins that raise `BackendNotProvidedError`
(an ImportError, as genlm raises where MLX or SGLang is not installed, and a
NotImplementedError).
"""

from __future__ import annotations

import importlib.util

from genlm_fast.backend.llm.base import AsyncLM
from genlm_fast.backend.llm.batched import BatchedAsyncLM
from genlm_fast.backend.llm.checks import (
    ModelClosedError,
    NonFiniteLogitsError,
    QueriesResetError,
    UnknownLoraError,
)
from genlm_fast.backend.llm.hf import AsyncTransformer
from genlm_fast.backend.llm.mock import MockAsyncLM

__all__ = [
    "AsyncLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "BackendNotProvidedError",
    "BatchedAsyncLM",
    "MockAsyncLM",
    "ModelClosedError",
    "NonFiniteLogitsError",
    "QueriesResetError",
    "UnknownLoraError",
    "load_model_by_name",
]

_UNSUPPORTED = {"mlx": "MLX (AsyncMlxLM)", "sgl": "SGLang (AsyncSGLTransformer)"}


class BackendNotProvidedError(ImportError, NotImplementedError):
    """A genlm backend that genlm_fast does not offer (MLX, SGLang). An ImportError, as
    genlm's own stand-ins raise where the backend's package is missing, so that an app's
    ``except ImportError`` fallback still runs."""


def _vllm_installed():
    return importlib.util.find_spec("vllm") is not None


def _not_supported(name, reason):
    """A class named ``name`` whose construction (or ``from_name``) raises
    BackendNotProvidedError(reason): imports of genlm's backend names keep working
    (genlm-control imports AsyncMlxLM), using one says why it cannot be used."""

    def refuse(*args, **kwargs):
        raise BackendNotProvidedError(reason)

    return type(
        name,
        (),
        {
            "__init__": refuse,
            "from_name": classmethod(refuse),
            "__doc__": f"Stand-in: {reason}",
            "__module__": __name__,
        },
    )


AsyncMlxLM = _not_supported(
    "AsyncMlxLM",
    "genlm_fast does not support the MLX backend; use AsyncTransformer, or genlm.backend for MLX",
)
AsyncSGLTransformer = _not_supported(
    "AsyncSGLTransformer",
    "genlm_fast does not support "
    "the SGLang backend; use AsyncTransformer or "
    "AsyncVirtualLM, or genlm.backend for SGLang",
)


def __getattr__(name):
    # imported on first use: the vllm module sets vLLM's environment and imports vllm
    if name == "AsyncVirtualLM":
        cls = importlib.import_module("genlm_fast.backend.llm.vllm").AsyncVirtualLM
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"AsyncVirtualLM"})


def load_model_by_name(name, backend=None, llm_opts=None):
    """Load a language model by name.

    Args:
        name (str): Hugging Face model name or local directory; ``"smollm2"`` is the
            offline SmolLM2-135M-Instruct copy (see `genlm_fast.models.smollm2_path`).
        backend (str, optional): ``"vllm"``, ``"hf"`` or ``"mock"``. Defaults to
            ``"vllm"`` when CUDA and vLLM are both available, else ``"hf"``.
        llm_opts (dict, optional): Keyword arguments for the backend's ``from_name``.

    Returns:
        (AsyncLM): The model.

    Raises:
        ValueError: Unknown backend.
        BackendNotProvidedError: ``"mlx"`` or ``"sgl"``, which genlm_fast does not
            support (an ImportError and a NotImplementedError).
    """
    if backend is None:
        import torch

        backend = "vllm" if torch.cuda.is_available() and _vllm_installed() else "hf"
    opts = dict(llm_opts or {})
    if backend == "vllm":
        return __getattr__("AsyncVirtualLM").from_name(name, **opts)
    if backend == "hf":
        return AsyncTransformer.from_name(name, **opts)
    if backend == "mock":
        return MockAsyncLM.from_name(name, **opts)
    if backend in _UNSUPPORTED:
        raise BackendNotProvidedError(
            f"genlm_fast does not support the {_UNSUPPORTED[backend]} backend; use "
            "backend='hf' or 'vllm', or genlm.backend for this one"
        )
    raise ValueError(f"Invalid backend: {backend!r} (expected 'vllm', 'hf' or 'mock')")
