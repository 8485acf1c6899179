"""The byte-level LM of genlm.bytes (beam summing over tokenizations) on the fused path."""

from genlm_fast.bytes.byte_lm.beam import BeamParams, ByteBeamState, EmptyBeamError
from genlm_fast.bytes.byte_lm.heal import TokenHealer
from genlm_fast.bytes.byte_lm.lm_state import StatefulByteLM, StatefulTokenizedLM
from genlm_fast.bytes.byte_lm.trie_info import fused_stats
from genlm_fast.bytes.byte_lm.trie_state import EOS, LazyTrieState, TrieMode

__all__ = [
    "EOS",
    "BeamParams",
    "ByteBeamState",
    "EmptyBeamError",
    "LazyTrieState",
    "StatefulByteLM",
    "StatefulTokenizedLM",
    "TokenHealer",
    "TrieMode",
    "fused_stats",
]
