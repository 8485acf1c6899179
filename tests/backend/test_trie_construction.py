"""The tries' construction against genlm-bytes 0.2.0 and the float64 oracle (tests/oracle.py):
the on-disk layout cache (round trip, keys, damaged files, Llama-3), and bad input at
construction and at call time, each refused with an error that names it."""

from __future__ import annotations

import pickle

import genlm.bytes.trie as ref_bytes
import numpy as np
import pytest
import torch
from genlm.backend.tokenization import Token as RefToken

from bench.vocabs import byte_vocab
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import TokenCharacterTrie
from genlm_fast.bytes import TokenByteTrie, TrieMode
from tests.backend.trie_support import SMALL, ours


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
