"""genlm_fast: fused GPU/CPU trie kernels and a genlm.backend / genlm.bytes compatible API.

    from genlm_fast.backend.tokenization import decode_vocab
    from genlm_fast.backend.trie import TokenCharacterTrie
    from genlm_fast.bytes import TokenByteTrie, TrieMode

Every trie offers genlm's ``weight_sum`` / ``weight_max`` (and batch forms) plus the fused
``log_mass`` / ``batch_log_mass`` (logits in, log-mass of every node out, on the device).
"""

__version__ = "0.1.0"
