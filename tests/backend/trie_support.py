"""Shared by the trie tests (tests/backend/test_trie_*.py): a small vocabulary, the same
words as our Tokens and as genlm's, and ours next to genlm's for each of the three tries."""

from __future__ import annotations

import warnings

import genlm.backend.trie as ref_trie
import genlm.bytes.trie as ref_bytes
from genlm.backend.tokenization import Token as RefToken

from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from genlm_fast.bytes import TokenByteTrie

SMALL = [b"a", b"ab", b"abc", b"b", b"ab", b"", b"<eos>", b"ba", b"\xff\x00", b"abd"]


def ours(words):
    return [Token(i, w) for i, w in enumerate(words)]


def theirs(words):
    return [RefToken(i, w) for i, w in enumerate(words)]


def trie_pairs(words):
    """(ours, genlm's) for each of the three tries over ``words``, on the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            (
                TokenCharacterTrie(ours(words), cache=False),
                ref_trie.TokenCharacterTrie(theirs(words)),
            ),
            (
                ParallelTokenCharacterTrie(ours(words), device="cpu", cache=False),
                ref_trie.ParallelTokenCharacterTrie(theirs(words), device="cpu"),
            ),
            (
                TokenByteTrie(ours(words), device="cpu", cache=False),
                ref_bytes.TokenByteTrie(theirs(words), device="cpu"),
            ),
        ]
