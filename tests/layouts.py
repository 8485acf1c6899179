"""Small compiled trie layouts for the op-level tests (no trie class in between)."""

import numpy as np

from genlm_fast.ops.layout import compile_layout
from genlm_fast.ops.trie_structure import build_structure


def make_layout(words, eos_positions=(), token_column=None):
    V = len(words)
    parent, first, leaf, ek, eos = build_structure(
        words, [(None, i) for i in range(V)], add_eos_node=True, eos_key=257
    )
    if token_column is None:
        token_column = np.arange(V)
    return compile_layout(
        parent,
        first,
        leaf,
        token_column=token_column,
        edge_key=ek,
        eos_node=eos,
        eos_positions=list(eos_positions),
    )


def random_words(rng, V, alphabet=b"abcd", max_len=7):
    words = [bytes(rng.choice(list(alphabet), size=rng.integers(0, max_len + 1))) for _ in range(V)]
    words += [b"ab" * k for k in range(1, 25)]  # a deep chain (depth 48)
    words += words[:10]  # duplicates: several leaves under one node
    return words
