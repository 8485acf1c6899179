"""genlm.backend-compatible tries over token vocabularies."""

from genlm_fast.backend.trie.async_impl import AsyncTokenCharacterTrie
from genlm_fast.backend.trie.base import ParallelTokenCharacterTrie, TokenCharacterTrie

__all__ = ["TokenCharacterTrie", "ParallelTokenCharacterTrie", "AsyncTokenCharacterTrie"]
