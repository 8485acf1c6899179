"""Shared by the MockAsyncLM tests (tests/backend/test_llm_*.py that drive the mock): the
model maker, the mock's distribution computed without the library, and the fixtures each of
those files imports: GPT-2's tokenizer, the mock's vocabulary size and ``decode_once``
(autouse where imported: the tests build many fresh models, each tokenizer is decoded once)."""

import functools

import numpy as np
import pytest
import torch

from genlm_fast.backend.llm import MockAsyncLM

_DECODED = {}


def memo_decode_vocab(tok):
    from genlm_fast.backend.tokenization import decode_vocab

    if id(tok) not in _DECODED:
        _DECODED[id(tok)] = (tok, decode_vocab(tok))
    return _DECODED[id(tok)][1]


def make(tokenizer, **kw):
    return MockAsyncLM(tokenizer, **kw)


def expected(ctx, vocab_size):
    """The mock's distribution, computed without the library."""
    return _expected(tuple(int(t) for t in ctx), vocab_size)


@functools.lru_cache(maxsize=4096)
def _expected(ctx, vocab_size):
    seed = sum((i + 1) * t for i, t in enumerate(ctx)) % 2**32
    scores = np.random.RandomState(seed).rand(vocab_size).astype(np.float32)
    return torch.log_softmax(torch.from_numpy(scores), dim=-1)


@pytest.fixture(scope="module")
def tokenizer():
    """GPT-2's tokenizer."""
    from bench.vocabs import gpt2_tokenizer

    return gpt2_tokenizer()


@pytest.fixture(autouse=True)
def decode_once(monkeypatch):
    from genlm_fast.backend.llm import base

    monkeypatch.setattr(base, "decode_vocab", memo_decode_vocab)


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    """The number of tokens of MockAsyncLM over ``tokenizer``."""
    return len(MockAsyncLM(tokenizer).byte_vocab)
