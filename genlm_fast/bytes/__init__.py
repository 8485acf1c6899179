"""genlm.bytes-compatible byte-level tries and the byte-level beam built on them."""

from genlm_fast.bytes.byte_lm import (
    BeamParams,
    ByteBeamState,
    EmptyBeamError,
    LazyTrieState,
    StatefulByteLM,
    StatefulTokenizedLM,
    TokenHealer,
    fused_stats,
)
from genlm_fast.bytes.trie import (
    EOS,
    AsyncTokenByteTrie,
    TokenByteTrie,
    TrieMode,
    TrieOp,
)
from genlm_fast.bytes.util import Chart, LazyByteProbs

__all__ = [
    "EOS",
    "AsyncTokenByteTrie",
    "BeamParams",
    "ByteBeamState",
    "Chart",
    "EmptyBeamError",
    "LazyByteProbs",
    "LazyTrieState",
    "StatefulByteLM",
    "StatefulTokenizedLM",
    "TokenByteTrie",
    "TokenHealer",
    "TrieMode",
    "TrieOp",
    "fused_stats",
]
