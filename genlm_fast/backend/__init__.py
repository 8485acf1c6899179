"""genlm.backend-compatible API: vocabulary decoding and tries."""

_LLM_NAMES = ("AsyncLM", "AsyncTransformer", "AsyncVirtualLM", "MockAsyncLM", "load_model_by_name")


def __getattr__(name):
    # Loaded on first use, so that importing genlm_fast.backend stays cheap.
    if name in _LLM_NAMES:
        import importlib

        value = getattr(importlib.import_module("genlm_fast.backend.llm"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LLM_NAMES))
