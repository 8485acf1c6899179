"""The tries against genlm-backend 0.3.1 and genlm-bytes 0.2.0 on the same inputs:
structure (numbering, children, prefixes, leaves), keyword names, the vocabularies they take
(generic iterables, tuple letters, genlm's Tokens, bytes with ids) and the EOS mass."""

from __future__ import annotations

import warnings

import genlm.backend.trie as ref_trie
import genlm.bytes.trie as ref_bytes
import numpy as np
import pytest
import torch
from genlm.backend.tokenization import Token as RefToken

from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import TokenCharacterTrie
from genlm_fast.bytes import EOS, TokenByteTrie, TrieMode
from tests.backend.trie_support import SMALL, ours, theirs


@pytest.mark.parametrize("words", [SMALL, [b"x"], [b"", b""], [b"abc" * 40, b"ab", b"a"]])
def test_character_trie_structure_matches_genlm(words):
    mine = TokenCharacterTrie(ours(words), cache=False)
    ref = ref_trie.TokenCharacterTrie(theirs(words))
    assert mine.root == ref.root
    assert mine.children == ref.children
    assert mine.node2prefix == ref.node2prefix
    assert {n: mine.prefix_of(n) for n in range(mine.num_nodes)} == ref.node2prefix
    assert mine.word2leaf == ref.word2leaf and mine.leaf2word == ref.leaf2word
    np.testing.assert_array_equal(mine.idx_to_leaf, ref.idx_to_leaf)
    assert [list(j) for j in mine.jump] == [list(j) for j in ref.jump]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"eos_byte_strings": [b"<eos>"]}, {"atomic_byte_strings": [b"abc"], "eot_sentinel": b"T"}],
)
def test_byte_trie_structure_matches_genlm(kwargs):
    mine = TokenByteTrie(ours(SMALL), device="cpu", cache=False, **kwargs)
    ref = ref_bytes.TokenByteTrie(theirs(SMALL), device="cpu", **kwargs)
    for attr in (
        "root",
        "eos_node",
        "children",
        "node2prefix",
        "word2leaf",
        "leaf2word",
        "leaf2token_id",
        "eos_token_ids",
        "lookup",
    ):
        assert getattr(mine, attr) == getattr(ref, attr), attr
    assert {n: mine.prefix_of(n) for n in range(mine.num_nodes)} == ref.node2prefix
    np.testing.assert_array_equal(mine.token_id_to_leaf, ref.token_id_to_leaf)
    assert mine.children[mine.root][EOS] == mine.eos_node


def test_old_keyword_names_are_accepted():
    new = TokenByteTrie(
        ours(SMALL),
        device="cpu",
        eos_byte_strings=[b"<eos>"],
        atomic_byte_strings=[b"abc"],
        eot_sentinel=b"T",
        cache=False,
    )
    old = TokenByteTrie(
        ours(SMALL),
        device="cpu",
        eos_tokens=[b"<eos>"],
        atomic_tokens=[b"abc"],
        eot_token=b"T",
        cache=False,
    )
    assert new.children == old.children and new.eos_token_ids == old.eos_token_ids
    with pytest.raises(TypeError, match="either"):
        TokenByteTrie(ours(SMALL), eos_tokens=[b"a"], eos_byte_strings=[b"a"])


def test_generic_iterables_and_strings():
    """genlm-control builds character tries over strings plus an EOS object."""

    class End:
        def __iter__(self):
            return iter([self])

        def __hash__(self):
            return 1

        def __eq__(self, other):
            return isinstance(other, End)

    vocab = ["a", "ab", "b", End()]
    mine = TokenCharacterTrie(vocab, cache=False)
    ref = ref_trie.TokenCharacterTrie(vocab)
    assert mine.children == ref.children
    ws = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(mine.weight_sum(ws), ref.weight_sum(ws))


def test_tuple_letters_are_letters_unless_they_start_with_none():
    """genlm.backend treats only ``(None, ...)`` edges as leaf edges in ``node2prefix``."""
    vocab = [((1, 2), (3,)), ((1, 2),), ("x", ())]
    mine = TokenCharacterTrie(vocab, cache=False)
    ref = ref_trie.TokenCharacterTrie(vocab[:2])  # genlm indexes letter[0]: () crashes it
    assert TokenCharacterTrie(vocab[:2], cache=False).node2prefix == ref.node2prefix
    assert mine.node2prefix[mine.word2leaf[((1, 2), (3,))]] == [(1, 2), (3,)]
    assert mine.node2prefix[mine.word2leaf[("x", ())]] == ["x", ()]
    assert all(mine.prefix_of(n) == mine.node2prefix[n] for n in range(mine.num_nodes))


def test_eot_sentinel_is_the_callers_own_object_and_is_never_pickled(tmp_path):
    class Sentinel:  # a local class: instances cannot be pickled; compared by identity
        pass

    first, second = Sentinel(), Sentinel()
    tries = [
        TokenByteTrie(ours(SMALL), device="cpu", eot_sentinel=s, cache_dir=str(tmp_path))
        for s in (first, second)
    ]  # the second reads the layout the first cached
    assert list(tmp_path.iterdir()), "the layout was not cached"
    for sentinel, mine in zip((first, second), tries):
        ref = ref_bytes.TokenByteTrie(theirs(SMALL), device="cpu", eot_sentinel=sentinel)
        assert mine.children == ref.children and mine.node2prefix == ref.node2prefix
        leaf_keys = [k for kids in mine.children for k in kids if isinstance(k, tuple)]
        assert len(leaf_keys) == len(SMALL) and all(k[0] is sentinel for k in leaf_keys)
    with pytest.raises(TypeError, match="hashable"):
        TokenByteTrie(ours(SMALL), device="cpu", eot_sentinel=[], cache_dir=str(tmp_path))


class _IdBytes(bytes):
    """A bytes subclass that carries a token id but is no Token."""

    def __new__(cls, token_id, data):
        self = super().__new__(cls, data)
        self.token_id = token_id
        return self


class _GenlmTokenSubclass(RefToken):
    pass


@pytest.mark.parametrize("token_type", [RefToken, _GenlmTokenSubclass])
def test_genlm_tokens_are_tokens(token_type):
    """genlm's own ``Token`` (and subclasses) keep their ids."""
    words = [b"b", b"a", b"ab", b"a"]
    ids = [3, 0, 2, 1]  # ids are not list positions
    vocab = [token_type(i, w) for i, w in zip(ids, words)]
    ref_vocab = [RefToken(i, w) for i, w in zip(ids, words)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # not taken for plain bytes
        byte = TokenByteTrie(vocab, device="cpu", cache=False)
        char = TokenCharacterTrie(vocab, cache=False)
    ref_byte = ref_bytes.TokenByteTrie(ref_vocab, device="cpu")
    ref_char = ref_trie.TokenCharacterTrie(ref_vocab)
    for attr in ("children", "lookup", "word2leaf", "leaf2token_id"):
        assert getattr(byte, attr) == getattr(ref_byte, attr), attr
    assert char.word2leaf == ref_char.word2leaf and char.children == ref_char.children
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])  # indexed by token id
    torch.testing.assert_close(byte.weight_sum(w), ref_byte.weight_sum(w))
    np.testing.assert_allclose(char.weight_sum(w), ref_char.weight_sum(w.numpy()))


def test_eos_mass_comes_from_the_eos_tokens_whatever_their_ids():
    """WITH_EOS moves the EOS tokens' weight (indexed by their ids) to the EOS node.
    genlm-bytes 0.2.0 finds EOS tokens as ``decode[token_id]``, so with ids that are not
    list positions it moves another token's weight: we keep the meaning (checked by hand)."""
    vocab = [Token(1, b"a"), Token(0, b"b"), Token(2, b"ab")]
    w = torch.tensor([0.25, 0.5, 0.125])  # by id: b"b" 0.25, b"a" 0.5, b"ab" 0.125
    trie = TokenByteTrie(vocab, device="cpu", eos_byte_strings=[b"a"], cache=False)
    for mode in (TrieMode.WITH_EOS, "with_eos"):  # the string is the mode too
        got = trie.weight_sum(w, mode=mode)
        assert float(got[trie.eos_node]) == 0.5
        assert float(got[trie.children[trie.root][ord("a")]]) == 0.125  # b"ab" only
        assert float(got[trie.root]) == 0.875
    plain = trie.weight_sum(w, mode=TrieMode.WITHOUT_EOS)
    assert float(plain[trie.eos_node]) == 0 and float(plain[trie.root]) == 0.875
    assert float(plain[trie.children[trie.root][ord("a")]]) == 0.625


def test_bytes_with_a_token_id_attribute_are_bytes_as_in_genlm():
    """Only Tokens carry ids: other bytes, whatever their attributes, are numbered by
    position (with genlm's deprecation warning), and duplicates are duplicates."""
    vocab = [_IdBytes(i, w) for i, w in zip([3, 0, 2, 1], [b"b", b"a", b"ab", b"a"])]
    with pytest.warns(DeprecationWarning):
        byte = TokenByteTrie(vocab, device="cpu", cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_byte = ref_bytes.TokenByteTrie(vocab, device="cpu")
    for attr in ("children", "lookup", "word2leaf", "leaf2token_id"):
        assert getattr(byte, attr) == getattr(ref_byte, attr), attr
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.testing.assert_close(byte.weight_sum(w), ref_byte.weight_sum(w))
    with pytest.raises(ValueError, match="Duplicate"):
        ref_trie.TokenCharacterTrie(vocab)
    with pytest.raises(ValueError, match="Duplicate"):
        TokenCharacterTrie(vocab, cache=False)
