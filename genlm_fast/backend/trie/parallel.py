"""genlm-backend's ``genlm.backend.trie.parallel`` module: ``ParallelTokenCharacterTrie``."""

from genlm_fast.backend.trie.base import ParallelTokenCharacterTrie

__all__ = ["ParallelTokenCharacterTrie"]
