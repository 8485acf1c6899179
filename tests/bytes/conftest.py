"""Fixtures shared by the byte-level beam tests: single-threaded torch, the GPT-2
tokenizer, the two peaked mock LMs (genlm_fast's and genlm.backend's) and genlm-bytes tries
over the latter."""

from __future__ import annotations

import warnings

import pytest
import torch

from bench.vocabs import gpt2_tokenizer
from tests.bytes.beam_support import PeakedMock, RefPeakedMock, RefTries


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Run single-threaded: these are small, latency-bound tensor ops, and on a shared
    2-core machine OpenMP hand-offs make them 10-100x slower (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def mock(tokenizer):
    return PeakedMock(tokenizer)


@pytest.fixture(scope="module")
def ref_mock(tokenizer):
    return RefPeakedMock(tokenizer)


@pytest.fixture(scope="module")
def ref_tries(ref_mock):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield RefTries(ref_mock)
