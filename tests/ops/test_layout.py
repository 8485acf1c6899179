"""The trie builder (``layout.build_structure``): its vectorised path for ``bytes`` words
against the insertion loop every other vocabulary takes, and both against genlm.backend's
own trie numbering."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import genlm.backend.trie as ref_trie
from genlm.backend.tokenization import Token as RefToken
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import TokenCharacterTrie
from genlm_fast.ops import layout
from tests.vocabs import byte_vocab

WORDS = st.lists(st.binary(max_size=9) | st.sampled_from([b"", b"a", b"ab", b"abc", b"\xff"]),
                 min_size=1, max_size=40)


def both_paths(words, add_eos_node):
    keys = [(None, i) for i in range(len(words))]
    vectorised = layout.build_structure(words, keys, add_eos_node, "EOS")
    loop = layout.build_structure([list(w) for w in words], keys, add_eos_node, "EOS")
    return vectorised, loop


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=WORDS, add_eos_node=st.booleans())
def test_bytes_path_equals_the_insertion_loop(words, add_eos_node):
    assert_same(*both_paths(words, add_eos_node))


@pytest.mark.parametrize("words", [[b""], [b"", b""], [b"a" * 200, b"a" * 3, b"a"],
                                   [bytes([i]) for i in range(256)]])
def test_bytes_path_edge_cases(words):
    assert_same(*both_paths(words, True))


def test_bytes_path_on_a_real_vocabulary():
    assert_same(*both_paths([bytes(t) for t in byte_vocab("gpt2")], False))


def test_long_words_take_the_loop(monkeypatch):
    words = [b"abc", b"ab", b"b"]
    expected = layout.build_structure(words, [(None, i) for i in range(3)])
    monkeypatch.setattr(layout, "_creation_order_of_bytes", None)  # must not be called
    monkeypatch.setattr(layout, "_MAX_PADDED_CELLS", 8)
    assert_same(layout.build_structure(words, [(None, i) for i in range(3)]), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=WORDS)
def test_numbering_matches_genlm(words):
    mine = TokenCharacterTrie([Token(i, w) for i, w in enumerate(words)], cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_trie.TokenCharacterTrie([RefToken(i, w) for i, w in enumerate(words)])
    assert mine.children == ref.children
    assert mine.word2leaf == ref.word2leaf
