"""genlm.bytes-compatible byte-level tries (the byte-level beam builds on these)."""

from genlm_fast.bytes.trie import EOS, AsyncTokenByteTrie, TokenByteTrie, TrieMode, TrieOp

__all__ = ["EOS", "AsyncTokenByteTrie", "TokenByteTrie", "TrieMode", "TrieOp"]
