"""The tries against genlm-backend 0.3.1 and genlm-bytes 0.2.0 on the same inputs:
structure (numbering, children, prefixes, leaves), return types, values, bad input."""

from __future__ import annotations

import contextlib
import gc
import pickle
import re
import warnings

import genlm.backend.trie as ref_trie
import genlm.bytes.trie as ref_bytes
import numpy as np
import pytest
import torch
from genlm.backend.tokenization import Token as RefToken

from bench.vocabs import byte_vocab
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from genlm_fast.bytes import EOS, AsyncTokenByteTrie, TokenByteTrie, TrieMode
from genlm_fast.ops import extension

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


@pytest.fixture(scope="module")
def gpt2():
    return byte_vocab("gpt2")


@pytest.fixture(scope="module")
def gpt2_reference_tries(gpt2):
    words = [t.byte_string for t in gpt2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (
            ref_trie.TokenCharacterTrie(theirs(words)),
            ref_bytes.TokenByteTrie(
                theirs(words), device="cpu", eos_byte_strings=[b"<|endoftext|>"]
            ),
        )


# ------------------------------------------------------------------ structure


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


# ------------------------------------------------------------------ values and types


def test_gpt2_values_match_genlm(gpt2, gpt2_reference_tries):
    ref_char, ref_byte = gpt2_reference_tries
    char = TokenCharacterTrie(gpt2)
    par = ParallelTokenCharacterTrie(gpt2, device="cpu")
    byte = TokenByteTrie(gpt2, device="cpu", eos_byte_strings=[b"<|endoftext|>"])
    assert char.children == ref_char.children
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, len(gpt2))) * 3
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)

    want = ref_char.batch_weight_sum(list(probs))
    got = char.batch_weight_sum(probs)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    got32 = par.batch_weight_sum(torch.tensor(probs, dtype=torch.float32))
    assert isinstance(got32, np.ndarray) and got32.dtype == np.float32
    np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(char.weight_max(probs[0]), ref_char.weight_max(probs[0]), rtol=1e-6)

    p32 = torch.tensor(probs, dtype=torch.float32)
    # the mode as our enum, its string, or genlm.bytes' enum (genlm modules imported before
    # the drop-in)
    for ours_mode, ref_mode in [
        (TrieMode.WITH_EOS, ref_bytes.TrieMode.WITH_EOS),
        (ref_bytes.TrieMode.WITH_EOS, ref_bytes.TrieMode.WITH_EOS),
        ("without_eos", ref_bytes.TrieMode.WITHOUT_EOS),
    ]:
        got_b = byte.batch_weight_sum(p32, mode=ours_mode)
        assert isinstance(got_b, torch.Tensor) and got_b.device.type == "cpu"
        want_b = ref_byte.batch_weight_sum(p32, mode=ref_mode)
        torch.testing.assert_close(got_b, want_b, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(byte.weight_max(p32[0]), ref_byte.weight_max(p32[0]))

    # the fused op equals log of the reference's mass of the softmax
    lm = byte.batch_log_mass(torch.tensor(logits, dtype=torch.float32), mode=TrieMode.WITH_EOS)
    ref_mass = ref_byte.batch_weight_sum(p32, mode=ref_bytes.TrieMode.WITH_EOS)
    keep = ref_mass > 1e-6
    torch.testing.assert_close(lm[keep], torch.log(ref_mass[keep]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("cls", [TokenCharacterTrie, ParallelTokenCharacterTrie])
def test_older_mass_sum_names(cls):
    """``mass_sum`` / ``batch_mass_sum`` (the names older genlm documentation shows) give
    genlm.backend's ``weight_sum`` / ``batch_weight_sum``: one row of node masses per input."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(len(SMALL)), size=3)
    mine = cls(ours(SMALL), cache=False)
    ref = ref_trie.TokenCharacterTrie(theirs(SMALL))
    expected = np.stack([ref.weight_sum(row) for row in p])
    np.testing.assert_allclose(mine.mass_sum(torch.tensor(p[1])), expected[1], rtol=1e-6)
    np.testing.assert_allclose(mine.batch_mass_sum(torch.tensor(p)), expected, rtol=1e-6)
    assert mine.mass_sum(p[0]).shape == (mine.num_nodes,)


def test_weight_max_allows_negative_log_weights():
    trie = TokenCharacterTrie(ours([b"a", b"ab", b"b"]), cache=False)
    out = trie.weight_max(np.array([-3.0, -1.0, -2.0]))
    assert out[trie.root] == -1.0  # genlm's sequential trie would clip this at 0


def test_log_mass_single_row_and_devices():
    trie = TokenByteTrie(ours(SMALL), device="cpu", cache=False)
    logits = torch.randn(len(SMALL) + 3)
    one = trie.log_mass(logits)
    batch = trie.batch_log_mass(logits[None])
    torch.testing.assert_close(one, batch[0])
    # the root holds the mass of the vocabulary's columns, not of the padding columns
    want_root = torch.logsumexp(logits[: len(SMALL)], 0) - torch.logsumexp(logits, 0)
    assert abs(float(one[trie.root]) - float(want_root)) < 1e-5
    # "auto" on a CPU tensor: the C++ kernels where they are built, else the reference
    built = extension.has("cpu")
    assert trie.last_kernel_backend == ("cpu" if built else "reference")


def test_gpu_results_reach_the_host_through_a_bounded_pinned_pool(monkeypatch):
    """genlm.backend's tries return numpy arrays; from a GPU they are views of pinned blocks
    (base._via_pinned; torch's caching host allocator reuses a block once its array is
    freed). At most PINNED_LIMIT bytes of those alive at once: past it, and when no pinned
    block can be had, a call takes the pageable copy; a freed array (once its last view is
    gone) gives its bytes back. The device copy itself runs on GPU machines (the GPU tests'
    ParallelTokenCharacterTrie(device="cuda")); here a CPU tensor stands in for the pinned
    block, the bookkeeping and the values being the same."""
    import gc

    from genlm_fast.backend.trie import base

    made = []

    def fake_pinned(like):
        made.append(like.shape)
        return torch.empty(like.shape, dtype=like.dtype)

    monkeypatch.setattr(base, "_pinned_empty", fake_pinned)
    monkeypatch.setattr(base, "PINNED_LIMIT", 3 * 400)
    monkeypatch.setattr(base, "_pinned_arrays", base._PinnedArrays())
    pool = base._pinned_arrays
    rows = [torch.arange(100, dtype=torch.float32) + 1000 * i for i in range(5)]
    a, b, c = (base._via_pinned(r) for r in rows[:3])
    for array, row in zip((a, b, c), rows):
        np.testing.assert_array_equal(array, row.numpy())
        assert not np.shares_memory(array, row.numpy())
    del array
    assert len(made) == 3 and pool.alive == 1200
    d = base._via_pinned(rows[3])  # over the limit: the pageable copy
    np.testing.assert_array_equal(d, rows[3].numpy())
    assert len(made) == 3 and pool.alive == 1200
    view = b[10:20].reshape(2, 5)
    del a, b
    gc.collect()
    assert pool.alive == 800  # b's view still holds its block
    e = base._via_pinned(rows[4])
    np.testing.assert_array_equal(e, rows[4].numpy())
    assert len(made) == 4 and pool.alive == 1200
    del view
    gc.collect()
    assert pool.alive == 800

    def no_pinned(like):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(base, "_pinned_empty", no_pinned)
    f = base._via_pinned(rows[0])
    np.testing.assert_array_equal(f, rows[0].numpy())
    assert pool.alive == 800
    del c, d, e, f
    gc.collect()
    assert pool.alive == 0
    # a CPU result is handed over as it is (no copy), as before
    cpu = torch.arange(4, dtype=torch.float32)
    assert np.shares_memory(base.to_host(cpu), cpu.numpy())


def test_numpy_views_are_read_as_numpy_reads_them():
    """Reversed views (negative strides) and big-endian arrays, as genlm's sequential trie
    reads the former."""
    words = [b"a", b"ab", b"b", b"ba"]
    ref = ref_trie.TokenCharacterTrie(theirs(words))
    ws = np.array([4.0, 3.0, 2.0, 1.0])[::-1]
    rows = np.arange(8.0).reshape(2, 4)[::-1]
    want, want_rows = ref.weight_sum(ws), ref.batch_weight_sum(rows)
    for trie in (
        TokenCharacterTrie(ours(words), cache=False),
        ParallelTokenCharacterTrie(ours(words), device="cpu", cache=False),
    ):
        np.testing.assert_allclose(trie.weight_sum(ws), want, rtol=1e-6)
        np.testing.assert_allclose(trie.weight_sum(ws.astype(">f8")), want, rtol=1e-6)
        np.testing.assert_allclose(trie.batch_weight_sum(rows), want_rows, rtol=1e-6)
    byte = TokenByteTrie(ours(words), device="cpu", cache=False)
    ref_byte = ref_bytes.TokenByteTrie(theirs(words), device="cpu")
    torch.testing.assert_close(
        byte.batch_weight_sum(rows), ref_byte.batch_weight_sum(np.ascontiguousarray(rows))
    )
    logits = np.array([0.5, -1.0, 2.0, 0.0])
    torch.testing.assert_close(byte.log_mass(logits[::-1]), byte.log_mass(logits[::-1].copy()))


def test_a_row_of_0d_tensors_is_one_row_as_in_genlm():
    """[w.sum(), ...] or list(tensor) (0-d tensors, or 0-d arrays) is one weight row, as
    genlm reads it; a list of such rows is a batch."""
    words = [b"a", b"ab", b"b"]
    row = [torch.tensor(0.25), torch.tensor(0.5, dtype=torch.float64), np.array(0.25)]
    plain = [0.25, 0.5, 0.25]
    par = ParallelTokenCharacterTrie(ours(words), device="cpu", cache=False)
    ref_par = ref_trie.ParallelTokenCharacterTrie(theirs(words), device="cpu")
    byte = TokenByteTrie(ours(words), device="cpu", cache=False)
    ref_byte = ref_bytes.TokenByteTrie(theirs(words), device="cpu")
    np.testing.assert_allclose(par.weight_sum(row), ref_par.weight_sum(list(torch.tensor(plain))))
    np.testing.assert_allclose(par.weight_sum(row), par.weight_sum(plain))
    torch.testing.assert_close(
        byte.weight_max(list(torch.tensor(plain))), ref_byte.weight_max(list(torch.tensor(plain)))
    )
    torch.testing.assert_close(
        byte.batch_weight_sum([row, plain]), byte.batch_weight_sum([plain, plain])
    )
    char = TokenCharacterTrie(ours(words), cache=False)
    np.testing.assert_allclose(char.weight_sum(row), char.weight_sum(plain))
    with pytest.raises(ValueError, match="batch item 0 must be a 1-D"):  # not all 0-d: rows
        byte.batch_weight_sum([torch.tensor(0.25), torch.tensor([0.5])])


def test_a_batch_is_any_iterable_of_rows_as_genlm_loops_over_it():
    """genlm loops over a batch: a generator, a map, a deque or dict.values() of rows is a
    batch; a row may mix 0-d tensors (bfloat16 too) and plain numbers."""
    from collections import deque

    V = len(SMALL)
    rows = np.random.default_rng(3).random((3, V)).round(3)  # bfloat16-exact below
    pairs = trie_pairs(SMALL)
    for mine, ref in pairs:
        want = np.asarray(ref.batch_weight_sum(list(rows)), dtype=np.float64)
        for batch in (
            map(np.asarray, rows),
            (r for r in rows),
            deque(rows),
            dict(enumerate(rows)).values(),
        ):
            got = mine.batch_weight_sum(batch)
            np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=1e-6)
        mixed = [torch.tensor(0.5, dtype=torch.bfloat16)] + rows[0, 1:].tolist()
        plain = [0.5] + rows[0, 1:].tolist()
        np.testing.assert_allclose(
            np.asarray(mine.weight_sum(mixed), dtype=np.float64),
            np.asarray(ref.weight_sum(plain), dtype=np.float64),
            rtol=1e-6,
        )
        eight = torch.from_numpy(rows[0]).to(torch.float8_e5m2)  # read as float32, exactly
        np.testing.assert_allclose(
            np.asarray(mine.weight_sum(eight), dtype=np.float64),
            np.asarray(ref.weight_sum(eight.float()), dtype=np.float64),
            rtol=1e-6,
        )
        for bad in ("abc", 3.0, {0: rows[0]}):
            with pytest.raises(TypeError, match=f"got {type(bad).__name__}"):
                mine.batch_weight_sum(bad)
        # a batch in that form is still no row (not its first row alone)
        with pytest.raises(ValueError, match="one weight vector"):
            mine.weight_sum(r for r in rows)
        with pytest.raises(ValueError, match=r"one \[vocab\] logit row"):
            mine.log_mass(r for r in rows)
        torch.testing.assert_close(mine.batch_log_mass(r for r in rows), mine.batch_log_mass(rows))


def test_the_sequential_trie_reads_the_first_V_weights_as_genlm():
    """genlm's TokenCharacterTrie reads entries 0..V-1 of a longer weight row (model
    padding); its parallel and byte tries take exactly V, and so do ours."""
    import asyncio

    V = len(SMALL)
    wide = np.random.default_rng(4).random((2, V + 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_trie.TokenCharacterTrie(theirs(SMALL))
    mine = TokenCharacterTrie(ours(SMALL), cache=False)
    np.testing.assert_allclose(mine.weight_sum(wide[0]), ref.weight_sum(wide[0]))
    np.testing.assert_allclose(mine.weight_max(wide[1]), ref.weight_max(wide[1]))
    np.testing.assert_allclose(mine.batch_weight_sum(wide), ref.batch_weight_sum(wide))

    async def run_async():
        atrie = AsyncTokenCharacterTrie(mine)
        try:
            return await asyncio.gather(atrie.weight_sum(wide[0]), atrie.weight_sum(wide[1, :V]))
        finally:
            await atrie.cleanup()

    for got, row in zip(asyncio.run(run_async()), wide):
        np.testing.assert_allclose(got, ref.weight_sum(row[:V]))
    for strict in (
        ParallelTokenCharacterTrie(ours(SMALL), device="cpu", cache=False),
        TokenByteTrie(ours(SMALL), device="cpu", cache=False),
    ):
        with pytest.raises(ValueError, match=rf"length {V} \(one entry per token id\)"):
            strict.weight_sum(wide[0])
    with pytest.raises(ValueError, match="length 10 .*got 9"):  # shorter: genlm reads past its end
        mine.weight_sum(wide[0, : V - 1])


def test_a_vocabulary_may_be_any_iterable_of_tokens():
    words = [b"a", b"ab", b"b", b"ba"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_char = ref_trie.TokenCharacterTrie(theirs(words))
    char = TokenCharacterTrie((t for t in ours(words)), cache=False)
    assert char.children == ref_char.children and len(char.decode) == len(words)
    byte = TokenByteTrie(iter(ours(words)), device="cpu", cache=False)
    assert byte.children == ref_bytes.TokenByteTrie(theirs(words), device="cpu").children


def test_preprocess_ws_is_genlms():
    """genlm's private batch preprocessing, which genlm's own test suites call."""
    rows = [np.arange(len(SMALL), dtype=np.float64), torch.ones(len(SMALL))]
    pairs = trie_pairs(SMALL)
    for mine, ref in pairs:
        for ws in (rows, torch.stack([torch.from_numpy(rows[0]), rows[1].double()])):
            got, want = mine._preprocess_ws(ws), ref._preprocess_ws(ws)
            assert type(got) is type(want), (type(mine).__name__, type(got), type(want))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and got.device == want.device


def test_integer_and_bool_weights_are_taken_as_genlm_takes_them():
    """Counts and masks as int/bool arrays, tensors and lists: the references sum and max
    them as numbers; so do we, for every trie, one row or a batch (sync and async)."""
    import asyncio

    V = len(SMALL)
    # non-negative: genlm's sequential weight_max floors every node at 0
    # (test_weight_max_allows_negative_log_weights)
    counts = np.arange(V, dtype=np.int64) * 7 % 11
    mask = np.arange(V) % 3 == 0
    forms = [
        counts,
        torch.from_numpy(counts),
        counts.tolist(),
        mask,
        torch.from_numpy(mask),
        counts.astype(np.int16),
        torch.from_numpy(counts).to(torch.uint8),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refs = [
            ref_trie.TokenCharacterTrie(theirs(SMALL)),
            ref_trie.ParallelTokenCharacterTrie(theirs(SMALL), device="cpu"),
        ]
    mine = [
        TokenCharacterTrie(ours(SMALL), cache=False),
        ParallelTokenCharacterTrie(ours(SMALL), device="cpu", cache=False),
    ]
    ref_byte = ref_bytes.TokenByteTrie(theirs(SMALL), device="cpu")
    byte = TokenByteTrie(ours(SMALL), device="cpu", cache=False)
    for ws in forms:
        floats = np.asarray(ws.numpy() if isinstance(ws, torch.Tensor) else ws, np.float64)
        for trie, ref in zip(mine, refs):
            for op in ("weight_sum", "weight_max"):
                got = getattr(trie, op)(ws)
                assert got.dtype == getattr(ref, op)(floats).dtype
                np.testing.assert_allclose(got, getattr(ref, op)(ws), rtol=1e-6)
            np.testing.assert_allclose(
                trie.batch_weight_sum([ws, ws]), ref.batch_weight_sum([floats, floats]), rtol=1e-6
            )
        for op in ("weight_sum", "weight_max"):
            got = getattr(byte, op)(ws)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, getattr(ref_byte, op)(floats).float())

    async def run_async():
        atrie = AsyncTokenByteTrie(byte)
        try:
            return await asyncio.gather(
                atrie.weight_sum(counts),
                atrie.weight_sum(counts * 0.5),
                atrie.weight_max(torch.from_numpy(mask)),
            )
        finally:
            await atrie.cleanup()

    whole, half, most = asyncio.run(run_async())
    torch.testing.assert_close(whole, ref_byte.weight_sum(counts.astype(np.float64)).float())
    torch.testing.assert_close(half, ref_byte.weight_sum(counts * 0.5).float())
    torch.testing.assert_close(most, ref_byte.weight_max(mask.astype(np.float64)).float())


def test_token_ids_with_gaps_index_the_rows():
    """Rows are indexed by token id: with ids 5, 2, 7 a weight row has 8 entries (genlm-bytes
    raised IndexError; we asked for 3 entries and then for 8)."""
    from tests import oracle

    vocab = [Token(5, b"a"), Token(2, b"ab"), Token(7, b"b")]
    trie = TokenByteTrie(vocab, device="cpu", cache=False)
    rows = np.random.default_rng(0).random((2, 8))
    members = oracle.members(trie)
    for op, reduction in (("batch_weight_sum", "sum"), ("batch_weight_max", "max")):
        want = oracle.reduce(members, trie.num_nodes, rows, reduction, columns=[5, 2, 7])
        got = getattr(trie, op)(torch.from_numpy(rows).float())
        oracle.assert_close(got.numpy(), want, reduction, op)
    assert float(trie.weight_sum(np.arange(8.0))[trie.root]) == 5 + 2 + 7
    with pytest.raises(ValueError, match=r"length 8 \(one entry per token id\), got 3"):
        trie.weight_sum(torch.ones(3))


def test_log_mass_rejects_a_batch_in_any_form():
    trie = TokenByteTrie(ours([b"a", b"b"]), device="cpu", cache=False)
    two_rows = np.array([[0.0, 0.0], [5.0, -5.0]])
    for batch in (two_rows, two_rows.tolist(), torch.from_numpy(two_rows), list(two_rows)):
        with pytest.raises(ValueError, match=r"one \[vocab\] logit row"):
            trie.log_mass(batch)
        with pytest.raises(ValueError, match="one weight vector"):
            trie.weight_sum(batch)
    for row in (two_rows[0], two_rows[0].tolist()):
        with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
            trie.batch_log_mass(row)
    leaves = [trie.word2leaf[(b"a", 0)], trie.word2leaf[(b"b", 1)]]
    got = trie.batch_log_mass(two_rows.tolist())[1, leaves]  # a list of rows is a batch
    torch.testing.assert_close(got, torch.log_softmax(torch.tensor([5.0, -5.0]), 0))


def test_character_trie_modes():
    """A character trie has no EOS node: only WITHOUT_EOS means anything (as the string,
    the enum or None); anything else is refused, as TokenByteTrie refuses unknown modes."""
    trie = TokenCharacterTrie(ours([b"a", b"b"]), cache=False)
    logits = torch.tensor([0.0, 1.0])
    want = trie.log_mass(logits)
    for mode in ("without_eos", TrieMode.WITHOUT_EOS, ref_bytes.TrieMode.WITHOUT_EOS):
        torch.testing.assert_close(trie.log_mass(logits, mode=mode), want)
        torch.testing.assert_close(trie.batch_log_mass(logits[None], mode=mode)[0], want)
    for mode in ("sideways", "with_eos", TrieMode.WITH_EOS, 0):
        with pytest.raises(ValueError, match="mode"):
            trie.log_mass(logits, mode=mode)
        with pytest.raises(ValueError, match="mode"):
            trie.batch_log_mass(logits[None], mode=mode)


# ------------------------------------------------------------------ construction


def test_layout_cache_round_trip(tmp_path):
    vocab = ours(SMALL)
    first = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert list(tmp_path.iterdir()), "the compiled layout was not cached"
    second = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert second.children == first.children
    w = torch.rand(len(vocab))
    torch.testing.assert_close(second.weight_sum(w), first.weight_sum(w))
    pickle.loads(pickle.dumps(first.layout))


@pytest.mark.parametrize("variant", ["eos", "atomic", "token_ids"])
def test_layout_cache_tells_vocabularies_apart(tmp_path, variant):
    """Tries that differ only in one option, or only in their token ids, share a cache
    directory: each must get its own layout (structure as genlm builds it, masses in both
    modes as the float64 oracle gives them), whichever was built first."""
    from tests import oracle

    words = SMALL
    if variant == "eos":
        configs = [{"eos_byte_strings": [b"<eos>"]}, {"eos_byte_strings": [b"ab"]}, {}]
        ids = [list(range(len(words)))] * 3
    elif variant == "atomic":
        configs = [{}, {"atomic_byte_strings": [b"abc"]}]
        ids = [list(range(len(words)))] * 2
    else:  # same bytes in the same order, other token ids
        configs = [{"eos_byte_strings": [b"<eos>"]}] * 2
        ids = [list(range(len(words))), [(7 * i + 3) % len(words) for i in range(len(words))]]
    rng = np.random.default_rng(0)
    for _ in range(2):  # the second round reads every layout back from the cache
        for kwargs, tids in zip(configs, ids):
            vocab = [Token(t, w) for t, w in zip(tids, words)]
            mine = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path), **kwargs)
            ref = ref_bytes.TokenByteTrie(
                [RefToken(t, w) for t, w in zip(tids, words)], device="cpu", **kwargs
            )
            assert mine.children == ref.children, kwargs
            np.testing.assert_array_equal(mine.token_id_to_leaf, ref.token_id_to_leaf)
            eos = set(kwargs.get("eos_byte_strings", ()))
            eos_positions = [i for i, w in enumerate(words) if w in eos]
            rows = rng.random((2, len(words)))
            for mode in (TrieMode.WITHOUT_EOS, TrieMode.WITH_EOS):
                want = oracle.reduce(
                    oracle.members(mine, eos_positions, with_eos=mode == TrieMode.WITH_EOS),
                    mine.num_nodes,
                    rows,
                    "sum",
                    columns=tids,
                )
                got = mine.batch_weight_sum(torch.from_numpy(rows), mode=mode)
                oracle.assert_close(got.numpy(), want, "sum", f"{variant} {kwargs} {mode}")
    assert len(list(tmp_path.glob("*.pkl"))) == len(configs)


def _foreign_pickle_with_a_valid_checksum(data):
    import hashlib

    from genlm_fast.ops import layout_cache

    payload = pickle.dumps({"root": 0})
    return layout_cache._CACHE_MAGIC + hashlib.sha256(payload).digest() + payload


def _one_array_rewritten(data):
    """A damaged file that still unpickles to a TrieLayout: the leaf order reversed in
    place (only the checksum can tell it from a good file)."""
    from genlm_fast.ops import layout_cache

    head = len(layout_cache._CACHE_MAGIC) + 32
    arr = pickle.loads(data[head:]).modes["without_eos"].leaf_token
    raw = arr.tobytes()
    assert len(set(arr.tolist())) > 1 and raw in data
    return data.replace(raw, arr[::-1].tobytes())


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:],  # one bit flipped
        lambda data: b"\xff\xfe not a layout",  # garbage
        lambda data: b"",  # empty
        lambda data: pickle.dumps(7),  # old/foreign format
        _foreign_pickle_with_a_valid_checksum,  # wrong object
        _one_array_rewritten,  # loads, wrong
    ],
    ids=[
        "truncated",
        "bit-flip",
        "garbage",
        "empty",
        "foreign-pickle",
        "wrong-object",
        "array-rewritten",
    ],
)
def test_damaged_layout_cache_is_rebuilt(tmp_path, damage):
    from genlm_fast.ops.layout import TrieLayout
    from genlm_fast.ops.layout_cache import load_cached

    vocab = ours(SMALL)
    w = torch.rand(len(vocab), dtype=torch.float64)
    want = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path / "clean")).weight_sum(w)
    TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.pkl")
    path.write_bytes(damage(path.read_bytes()))
    rebuilt = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    torch.testing.assert_close(rebuilt.weight_sum(w), want, rtol=0, atol=0)
    assert isinstance(load_cached(path.stem, str(tmp_path)), TrieLayout), "not rewritten"


@pytest.mark.parametrize("setting", ["LAYOUT_VERSION", "TILE"])
def test_layout_cache_key_covers_format_version_and_tile(tmp_path, monkeypatch, setting):
    """A layout cached under another layout format or tile size (the kernels read the
    current TILE, not the file's) must not be reused: the same vocabulary gets a new file."""
    from genlm_fast.ops import layout as layout_mod

    vocab = ours(SMALL)
    TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    monkeypatch.setattr(layout_mod, setting, getattr(layout_mod, setting) * 2)
    TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("*.pkl"))) == 2, (
        f"a layout cached under another {setting} was reused"
    )


def test_llama3_layout_is_cached_on_disk(tmp_path):
    """The Llama-3 trie's layout is written to the cache once and read back identical.
    (Construction time is a benchmark: ``python -m bench.kernels`` reports it.)"""
    vocab = byte_vocab("llama3")
    trie = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert trie.num_nodes == 403_618  # 403,617 genlm nodes + the EOS node
    cached = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert cached, "no layout written to the cache directory"
    again = TokenByteTrie(vocab, device="cpu", cache_dir=str(tmp_path))
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(cached)
    for mode in ("without_eos", "with_eos"):
        a, b = trie.layout.modes[mode], again.layout.modes[mode]
        assert np.array_equal(a.leaf_token, b.leaf_token)
        assert np.array_equal(a.leaf_end, b.leaf_end)
    assert np.array_equal(trie.layout.parent, again.layout.parent)


# ------------------------------------------------------------------ async


@pytest.mark.asyncio
async def test_async_batches_and_answers_every_caller():
    trie = TokenByteTrie(ours(SMALL), device="cpu", eos_byte_strings=[b"<eos>"], cache=False)
    atrie = AsyncTokenByteTrie(trie)
    import asyncio

    rows = [torch.rand(len(SMALL)) for _ in range(40)]
    modes = [TrieMode.WITH_EOS if i % 2 else None for i in range(40)]
    results = await asyncio.gather(
        *[atrie.weight_sum(r, m) for r, m in zip(rows, modes)],
        *[atrie.weight_max(r) for r in rows[:5]],
    )
    for r, m, got in zip(rows, modes, results):
        torch.testing.assert_close(got, trie.weight_sum(r, m))
    for r, got in zip(rows[:5], results[40:]):
        torch.testing.assert_close(got, trie.weight_max(r))
    await atrie.cleanup()


@pytest.mark.asyncio
async def test_async_errors_reach_their_own_callers_and_loop_survives():
    import asyncio

    atrie = AsyncTokenCharacterTrie.from_vocab(ours(SMALL), backend="sequential", cache=False)
    with pytest.raises(ValueError, match="length"):
        await atrie.weight_sum(np.ones(3))  # rejected before it is queued
    bad = [np.full(len(SMALL), np.nan) for _ in range(3)]
    outcomes = await asyncio.gather(*[atrie.weight_sum(b) for b in bad], return_exceptions=True)
    assert all(isinstance(o, ValueError) and "NaN" in str(o) for o in outcomes)
    good = await atrie.weight_sum(np.ones(len(SMALL)))
    assert good[atrie.trie.root] == len(SMALL)

    # a cancelled caller does not disturb the others
    tasks = [
        asyncio.ensure_future(atrie.weight_sum(np.full(len(SMALL), float(i)))) for i in range(20)
    ]
    tasks[3].cancel()
    tasks[11].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for i, d in enumerate(done):
        if i in (3, 11):
            assert isinstance(d, asyncio.CancelledError)
        else:
            assert d[atrie.trie.root] == pytest.approx(i * len(SMALL))
    await atrie.cleanup()
    atrie.shutdown()


@pytest.mark.asyncio
async def test_async_malformed_requests_fail_alone():
    """Concurrent good and bad requests: every good one gets genlm's values, every bad one
    its own clear error (raised before queueing, or found by the kernel in its batch)."""
    import asyncio

    V = len(SMALL)
    atrie = AsyncTokenByteTrie.from_vocab(
        ours(SMALL), device="cpu", eos_byte_strings=[b"<eos>"], cache=False
    )
    ref = ref_bytes.TokenByteTrie(theirs(SMALL), device="cpu", eos_byte_strings=[b"<eos>"])
    rng = np.random.default_rng(0)
    good = [torch.tensor(rng.random(V), dtype=torch.float32) for _ in range(30)]
    logits = [torch.tensor(rng.standard_normal(V), dtype=torch.float32) for _ in range(10)]
    nan = torch.rand(V)
    nan[2] = float("nan")
    bad = [  # (request, error type, message)
        (atrie.weight_sum(nan), ValueError, "NaN"),
        (atrie.weight_sum(nan, TrieMode.WITH_EOS), ValueError, "NaN"),
        (atrie.weight_max(torch.full((V,), float("nan"))), ValueError, "NaN"),
        (atrie.log_mass(torch.full((V,), float("nan"))), ValueError, "NaN"),
        (atrie.log_mass(torch.full((V,), float("inf"))), ValueError, r"\+inf"),
        (atrie.weight_sum(torch.ones(V, dtype=torch.complex64)), TypeError, "real"),
        (atrie.log_mass(torch.ones(V, dtype=torch.long)), TypeError, "floating"),
        (atrie.weight_sum(torch.ones(2, V)), ValueError, "one row"),
        (atrie.log_mass(torch.zeros(2, V)), ValueError, "one row"),
        (atrie.weight_sum(torch.ones(V + 1)), ValueError, "length"),
        (atrie.log_mass(torch.zeros(V - 1)), ValueError, "at least"),
        (atrie.weight_sum(torch.ones(V), mode="sideways"), ValueError, "mode"),
        (atrie.weight_sum("abc"), TypeError, "got str"),
    ]
    requests = (
        [atrie.weight_sum(w, TrieMode.WITH_EOS if i % 2 else None) for i, w in enumerate(good)]
        + [atrie.weight_max(w) for w in good[:5]]
        + [atrie.log_mass(x, TrieMode.WITH_EOS) for x in logits]
        + [atrie.log_mass(torch.cat([logits[0], torch.zeros(3)]))]
    )  # padded: fine
    outcomes = await asyncio.gather(*requests, *[b for b, _, _ in bad], return_exceptions=True)
    answers, errors = outcomes[: len(requests)], outcomes[len(requests) :]
    assert not [a for a in answers if isinstance(a, BaseException)], answers
    modes = [
        ref_bytes.TrieMode.WITH_EOS if i % 2 else ref_bytes.TrieMode.WITHOUT_EOS
        for i in range(len(good))
    ]
    for w, mode, got in zip(good, modes, answers):
        torch.testing.assert_close(got, ref.weight_sum(w, mode=mode))
    for w, got in zip(good[:5], answers[len(good) :]):
        torch.testing.assert_close(got, ref.weight_max(w))
    for x, got in zip(logits, answers[len(good) + 5 :]):
        want = ref.weight_sum(torch.softmax(x, 0), mode=ref_bytes.TrieMode.WITH_EOS)
        keep = want > 0
        torch.testing.assert_close(got[keep], torch.log(want[keep]), rtol=0, atol=1e-5)
    padded = torch.log(ref.weight_sum(torch.softmax(torch.cat([logits[0], torch.zeros(3)]), 0)[:V]))
    torch.testing.assert_close(answers[-1], padded, rtol=0, atol=1e-5)
    for (_, kind, message), error in zip(bad, errors):
        assert isinstance(error, kind) and re.search(message, str(error)), repr(error)

    # the same through the character trie and genlm's low-level entry
    char = AsyncTokenCharacterTrie.from_vocab(ours(SMALL), backend="sequential", cache=False)
    ref_char = ref_trie.TokenCharacterTrie(theirs(SMALL))
    rows = [rng.random(V) for _ in range(8)]
    futures = [await char._queue_request(r, "sum") for r in rows]
    got = await asyncio.gather(
        *futures, char.weight_sum(np.full(V, np.nan)), return_exceptions=True
    )
    for r, g in zip(rows, got):
        np.testing.assert_allclose(g, ref_char.weight_sum(r), rtol=1e-12)
    assert isinstance(got[-1], ValueError) and "NaN" in str(got[-1])
    with pytest.raises(ValueError, match="operation"):
        await char._queue_request(rows[0], "invalid-op")
    await atrie.cleanup()
    await char.cleanup()


@pytest.mark.asyncio
async def test_async_request_during_cleanup_is_served_and_the_trie_keeps_working():
    import asyncio

    atrie = AsyncTokenByteTrie.from_vocab(ours([b"a", b"b"]), device="cpu", cache=False)
    x = torch.tensor([0.25, 0.75])
    want = await atrie.weight_sum(x)
    torch.testing.assert_close(want[atrie.trie.root], torch.tensor(1.0))
    cleanup = asyncio.ensure_future(atrie.cleanup())
    racing = asyncio.ensure_future(atrie.weight_sum(x))  # made while cleanup() waits
    done = await asyncio.gather(cleanup, racing, return_exceptions=True)
    assert done[0] is None
    if isinstance(done[1], BaseException):  # a clear error is fine too
        assert isinstance(done[1], RuntimeError) and "shut down" in str(done[1])
    else:
        torch.testing.assert_close(done[1], want)
    for _ in range(3):
        torch.testing.assert_close(await asyncio.wait_for(atrie.weight_sum(x), 10), want)
    await atrie.cleanup()
    assert atrie._batcher._task is None


@pytest.mark.asyncio
async def test_async_batch_interrupted_by_a_base_exception_fails_its_waiters():
    """A batch that raises what is not an Exception (KeyboardInterrupt, here a stand-in)
    ends the serving task: every request it had taken fails with a clear error instead of
    waiting forever, and the next request is served by a fresh task."""
    import asyncio

    class Interrupt(BaseException):
        pass

    atrie = AsyncTokenByteTrie.from_vocab(ours(SMALL), device="cpu", cache=False)
    serve = atrie._batcher._run_batch

    def interrupted(op, mode, rows):
        atrie._batcher._run_batch = serve  # once
        raise Interrupt()

    atrie._batcher._run_batch = interrupted
    V = len(SMALL)
    rows = [torch.rand(V) for _ in range(4)]
    got = await asyncio.wait_for(
        asyncio.gather(
            *(atrie.weight_sum(r) for r in rows[:3]),
            atrie.weight_max(rows[3]),
            return_exceptions=True,
        ),
        10,
    )
    for error in got:
        assert isinstance(error, RuntimeError) and "interrupted (Interrupt)" in str(error)
    want = TokenByteTrie(ours(SMALL), device="cpu", cache=False).weight_sum(rows[0])
    torch.testing.assert_close(await asyncio.wait_for(atrie.weight_sum(rows[0]), 10), want)
    await atrie.cleanup()


def test_async_trie_across_event_loops():
    """A trie left on a closed loop cleans up and serves the next loop; one still serving on
    another thread's running loop refuses a second loop with a clear error (asyncio's queues
    belong to one loop), and serves again once that loop is gone."""
    import asyncio
    import threading

    V = len(SMALL)
    atrie = AsyncTokenByteTrie.from_vocab(ours(SMALL), device="cpu", cache=False)
    want = TokenByteTrie(ours(SMALL), device="cpu", cache=False).weight_sum(torch.ones(V))
    loop = asyncio.new_event_loop()
    torch.testing.assert_close(loop.run_until_complete(atrie.weight_sum(torch.ones(V))), want)
    loop.close()
    with _asyncio_errors() as logged:
        asyncio.run(atrie.cleanup())  # was: RuntimeError('Event loop is closed')
        gc.collect()
    assert not logged, logged  # was: "Task was destroyed but it is pending!"
    torch.testing.assert_close(asyncio.run(atrie.weight_sum(torch.ones(V))), want)

    served, release = threading.Event(), threading.Event()
    answers = []

    def other_thread():
        async def hold():
            answers.append(await atrie.weight_sum(torch.ones(V)))
            served.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)

        asyncio.run(hold())

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert served.wait(30)
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(atrie.weight_sum(torch.ones(V)))
    finally:
        release.set()
        thread.join(30)
    torch.testing.assert_close(answers[0], want)
    torch.testing.assert_close(asyncio.run(atrie.weight_sum(torch.ones(V))), want)
    atrie.shutdown()


@contextlib.contextmanager
def _asyncio_errors():
    """The messages asyncio's logger reports at ERROR while the block runs."""
    import logging

    messages = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_named():
    trie = TokenByteTrie(ours(SMALL), device="cpu", cache=False)
    V = len(SMALL)
    with pytest.raises(ValueError, match="length"):
        trie.weight_sum(torch.ones(V + 1))
    with pytest.raises(TypeError, match="real"):
        trie.batch_weight_sum(torch.ones(2, V, dtype=torch.complex64))
    with pytest.raises(TypeError, match="floating"):
        trie.batch_log_mass(torch.ones(2, V, dtype=torch.int64))
    with pytest.raises(ValueError, match="item 1 has length 3"):
        trie.batch_weight_sum([np.ones(V), np.ones(3)])
    for call in (trie.batch_weight_sum, trie.batch_weight_max, trie.batch_log_mass):
        with pytest.raises(ValueError, match="cpu or cuda, got one on meta"):
            call(torch.zeros(1, V, device="meta"))
    with pytest.raises(ValueError, match="NaN"):
        trie.batch_log_mass(torch.full((1, V), float("nan")))
    with pytest.raises(ValueError, match=r"\+inf"):
        trie.batch_log_mass(torch.tensor([[float("inf")] + [0.0] * (V - 1)]))
    with pytest.raises(ValueError, match="finite"):
        trie.batch_log_mass(torch.full((1, V), float("-inf")))
    with pytest.raises(ValueError, match="at least"):
        trie.batch_log_mass(torch.zeros(1, V - 1))
    with pytest.raises(ValueError, match="shape"):
        trie.log_mass(torch.zeros(2, V))
    with pytest.raises(ValueError, match="mode"):
        trie.weight_sum(torch.ones(V), mode="sideways")
    with pytest.raises(ValueError, match="empty"):
        TokenByteTrie([])
    with pytest.raises(ValueError, match="empty"):
        TokenCharacterTrie([])
    with pytest.raises(TypeError, match="Token"):
        TokenByteTrie([Token(0, b"a"), "b"])
    with pytest.raises(TypeError, match="iterable"):
        TokenCharacterTrie([b"a", 3])
    with pytest.raises(ValueError, match="Duplicate"):
        TokenCharacterTrie([b"a", b"a"])
    with pytest.raises(ValueError, match=r"item 1 \(.*b'b'.*\) has a negative token_id -1"):
        TokenByteTrie([Token(0, b"a"), Token(-1, b"b")])
    with pytest.raises(ValueError, match="items 0 and 2 are two Tokens with the same token_id 4"):
        TokenByteTrie([Token(4, b"a"), Token(1, b"b"), Token(4, b"c")])
    with pytest.raises(ValueError, match=r"sum past the float range.*magnitude 1\.7e\+308"):
        # no inf given: the subtrees' sums overflow, "a" to +inf, "b" to -inf
        TokenCharacterTrie(ours([b"a", b"ab", b"b", b"ba"]), cache=False).weight_sum(
            np.array([1.7e308, 1.7e308, -1.7e308, -1.7e308])
        )
    with pytest.raises(ValueError, match=r"both \+inf and -inf"):
        TokenCharacterTrie(ours([b"a", b"b"]), cache=False).weight_sum(np.array([np.inf, -np.inf]))
    with pytest.raises(ValueError, match="not in vocabulary"):
        TokenByteTrie(ours(SMALL), eos_byte_strings=[b"nope"])
    with pytest.raises(ValueError, match="Invalid device"):
        TokenByteTrie(ours(SMALL), device="tpu")
    with pytest.raises(ValueError, match="backend"):
        t = TokenCharacterTrie(ours(SMALL), kernel_backend="fortran", cache=False)
        t.weight_sum(np.ones(V))
    with pytest.raises(ValueError, match="cpu"):
        t = TokenCharacterTrie(ours(SMALL), kernel_backend="cuda", cache=False)
        t.weight_sum(np.ones(V))


def test_visualize_optional_graphviz():
    import graphviz

    trie = TokenCharacterTrie(ours([b"a", b"ab"]), cache=False)
    dot = trie.visualize(trie.weight_sum(np.array([0.25, 0.75])))
    assert isinstance(dot, graphviz.Digraph) and "0.7500" in dot.source
    with pytest.raises(ValueError, match="nodes"):
        trie.visualize(np.ones(2))
