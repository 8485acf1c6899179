"""genlm.backend-compatible API: vocabulary decoding, tries and the async LMs."""

# name -> the module that defines it; loaded on first use, so that importing
# genlm_fast.backend stays cheap
_LAZY = {
    **dict.fromkeys(("AsyncLM", "AsyncTransformer", "AsyncVirtualLM", "MockAsyncLM",
                     "load_model_by_name"), "genlm_fast.backend.llm"),
    **dict.fromkeys(("decode_vocab", "Token"), "genlm_fast.backend.tokenization"),
    **dict.fromkeys(("TokenCharacterTrie", "ParallelTokenCharacterTrie",
                     "AsyncTokenCharacterTrie"), "genlm_fast.backend.trie"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
