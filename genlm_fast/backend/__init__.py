"""genlm.backend-compatible API: vocabulary decoding, tries and the async LMs."""

# name -> the module that defines it; loaded on first use, so that importing
# genlm_fast.backend stays cheap
_LAZY = {
    **dict.fromkeys(
        ("AsyncLM", "AsyncTransformer", "AsyncVirtualLM", "MockAsyncLM", "load_model_by_name"),
        "genlm_fast.backend.llm",
    ),
    **dict.fromkeys(("decode_vocab", "Token"), "genlm_fast.backend.tokenization"),
    **dict.fromkeys(
        ("TokenCharacterTrie", "ParallelTokenCharacterTrie", "AsyncTokenCharacterTrie"),
        "genlm_fast.backend.trie",
    ),
}


_SUBMODULES = ("cache", "llm", "tokenization", "trie")  # attributes, as in genlm.backend

__all__ = [
    "load_model_by_name",
    "AsyncVirtualLM",
    "AsyncTransformer",
    "decode_vocab",
    "Token",
    "TokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "AsyncTokenCharacterTrie",
]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
