"""Fixtures shared by the byte-level beam tests: one torch thread, the GPT-2
tokenizer, the two peaked mock LMs (genlm_fast's and genlm.backend's) and genlm-bytes tries
over the latter."""

from __future__ import annotations

import warnings

import pytest

from bench.vocabs import gpt2_tokenizer
from tests.bytes.beam_support import PeakedMock, RefPeakedMock, RefTries


@pytest.fixture(autouse=True, scope="module")
def single_thread(one_torch_thread):
    """Every beam test runs on one torch thread (tests/conftest.py)."""


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
