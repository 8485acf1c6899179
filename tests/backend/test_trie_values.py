"""The tries against genlm-backend 0.3.1 and genlm-bytes 0.2.0 on the same inputs: return
types and values (GPT-2's vocabulary, older method names, log masses, the pinned host pool,
every weight form genlm reads: numpy views, 0-d tensors, iterables, integers and bools,
token ids with gaps) and modes."""

from __future__ import annotations

import warnings

import genlm.backend.trie as ref_trie
import genlm.bytes.trie as ref_bytes
import numpy as np
import pytest
import torch

from bench.vocabs import byte_vocab
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from genlm_fast.bytes import AsyncTokenByteTrie, TokenByteTrie, TrieMode
from genlm_fast.ops import extension
from tests.backend.trie_support import SMALL, ours, theirs, trie_pairs


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
