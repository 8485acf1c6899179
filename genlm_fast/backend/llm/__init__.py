"""Language-model backends with the genlm.backend ``llm`` API.

``AsyncTransformer`` (Hugging Face transformers) and ``MockAsyncLM`` are available
everywhere. ``AsyncVirtualLM`` (vLLM) resolves lazily; without vLLM it is a stand-in
class whose construction raises ImportError. MLX and SGLang backends are not offered:
``AsyncMlxLM`` and ``AsyncSGLTransformer`` are stand-ins that raise NotImplementedError.
"""

from __future__ import annotations

import importlib.util

from genlm_fast.backend.llm.base import (
    AsyncLM,
    BatchedAsyncLM,
    MockAsyncLM,
    ModelClosedError,
    QueriesResetError,
    UnknownLoraError,
)
from genlm_fast.backend.llm.hf import AsyncTransformer

__all__ = [
    "AsyncLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "BatchedAsyncLM",
    "MockAsyncLM",
    "ModelClosedError",
    "QueriesResetError",
    "UnknownLoraError",
    "load_model_by_name",
]

_UNSUPPORTED = {"mlx": "MLX (AsyncMlxLM)", "sgl": "SGLang (AsyncSGLTransformer)"}


def _vllm_installed():
    return importlib.util.find_spec("vllm") is not None


def _stand_in(name, reason, error):
    """A class named ``name`` whose construction (or ``from_name``) raises ``error(reason)``:
    imports of genlm's backend names keep working, using one says why it cannot be used."""

    def refuse(*args, **kwargs):
        raise error(reason)

    cls = type(name, (), {"__init__": refuse, "from_name": classmethod(refuse),
                          "__doc__": f"Stand-in: {reason}", "__module__": __name__})
    return cls


AsyncMlxLM = _stand_in("AsyncMlxLM", "genlm_fast does not support the MLX backend; use "
                       "AsyncTransformer, or genlm.backend for MLX", NotImplementedError)
AsyncSGLTransformer = _stand_in("AsyncSGLTransformer", "genlm_fast does not support the "
                                "SGLang backend; use AsyncTransformer or AsyncVirtualLM, or "
                                "genlm.backend for SGLang", NotImplementedError)


def _load_vllm_class():
    if not _vllm_installed():
        return _stand_in(
            "AsyncVirtualLM",
            "vllm is not installed, so AsyncVirtualLM is unavailable; install vllm "
            "(`pip install vllm`, needs a CUDA GPU) or use backend='hf' (AsyncTransformer)",
            ImportError)
    return importlib.import_module("genlm_fast.backend.llm.vllm").AsyncVirtualLM


def __getattr__(name):
    if name == "AsyncVirtualLM":
        cls = _load_vllm_class()
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
        NotImplementedError: ``"mlx"`` or ``"sgl"``, which genlm_fast does not support.
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
        raise NotImplementedError(
            f"genlm_fast does not support the {_UNSUPPORTED[backend]} backend; use "
            "backend='hf' or 'vllm', or genlm.backend for this one"
        )
    raise ValueError(f"Invalid backend: {backend!r} (expected 'vllm', 'hf' or 'mock')")
