"""The caches of the LM backends: the output cache (alone, and as MockAsyncLM uses it: LRU)
and the key/value trie (match, gather, eviction, positions already held).

The model's rows are checked against an independent computation of the mock's distribution
(tests/backend/llm_mock_support.py); the caches' contents against the values put in."""

import pytest
import torch

from genlm_fast.backend.cache import KVTrie, OutputCache
from tests.backend.llm_mock_support import decode_once as decode_once  # autouse
from tests.backend.llm_mock_support import make
from tests.backend.llm_mock_support import tokenizer as tokenizer  # a fixture
from tests.backend.llm_mock_support import vocab_size as vocab_size  # a fixture

# the vocabulary is decoded once per tokenizer: the tests build many fresh models


def test_output_cache_semantics():
    c = OutputCache(maxsize=2)
    c["a"], c["b"] = torch.zeros(1), torch.ones(1)
    assert "a" in c and len(c) == 2
    c["a"]  # refresh
    c["c"] = torch.ones(2)
    assert "b" not in c and "a" in c and "c" in c
    c["a"] = torch.full((1,), 5.0)  # overwriting evicts nothing
    assert len(c) == 2 and c["a"].item() == 5.0
    with pytest.raises(KeyError):
        c["zzz"]
    c.clear()
    assert len(c) == 0
    off = OutputCache(maxsize=0)
    off["x"] = torch.zeros(1)
    assert len(off) == 0
    cpu = OutputCache(maxsize=4, move_to_cpu=True)
    cpu["x"] = torch.arange(3.0)
    assert cpu["x"].device == torch.device("cpu")


@pytest.mark.asyncio
async def test_output_cache_is_lru(tokenizer, vocab_size):
    lm = make(tokenizer, cache_size=3)
    for c in ([1], [2], [3], [1], [4]):  # [1] refreshed, so [2] goes first
        await lm.next_token_logprobs(c)
    assert lm.stats["rows"] == 4 and lm.stats["cache_hits"] == 1
    await lm.next_token_logprobs([2])
    assert lm.stats["rows"] == 5
    await lm.next_token_logprobs([1])
    assert lm.stats["rows"] == 5
    lm.clear_cache()
    await lm.next_token_logprobs([1])
    assert lm.stats["rows"] == 6


def kv(n, value, layers=2, heads=1, dim=3):
    return torch.full((layers, 2, heads, n, dim), float(value))


def test_kv_trie_match_gather_and_evict():
    trie = KVTrie(max_tokens=10)
    a = [1, 2, 3, 4]
    trie.insert(a, 0, kv(4, 1.0))
    depth, runs = trie.match(a + [9])
    assert depth == 4 and len(runs) == 1
    assert depth == trie.match(a, limit=3)[0] + 1
    trie.insert(a + [5, 6], 4, kv(2, 2.0), runs)
    depth, runs = trie.match(a + [5, 6, 7])
    assert depth == 6 and len(runs) == 2
    got = KVTrie.gather(runs)
    assert got.shape == (2, 2, 1, 6, 3)
    assert got[:, :, :, :4].eq(1).all() and got[:, :, :, 4:].eq(2).all()
    # a sibling branch: 3 + 4 + 2 positions held
    b = [1, 2, 7, 7, 7]
    d, r = trie.match(b)
    assert d == 2
    trie.insert(b, 2, kv(3, 3.0), r)
    assert trie.n_tokens == 9
    # over budget: the least recently used leaf goes, never a prefix still in use
    trie.insert([1, 2, 7, 7, 7, 8], 5, kv(1, 4.0), trie.match([1, 2, 7, 7, 7])[1])
    trie.insert([1, 2, 7, 7, 7, 8, 9], 6, kv(1, 5.0), trie.match([1, 2, 7, 7, 7, 8])[1])
    assert trie.n_tokens <= 10
    assert trie.match(a + [5, 6])[0] == 4  # the [5, 6] leaf segment was evicted
    assert trie.match([1, 2, 7, 7, 7, 8, 9])[0] == 7
    # nodes without KV are pruned
    assert 5 not in trie.root.children[1].children[2].children[3].children[4].children
    trie.clear()
    assert trie.n_tokens == 0 and trie.match(a)[0] == 0


def test_kv_trie_keeps_existing_positions():
    trie = KVTrie()
    trie.insert([1, 2, 3], 0, kv(3, 1.0))
    assert trie.insert([1, 2, 3], 2, kv(1, 9.0)) is None  # already held: dropped
    seg = trie.insert([1, 2, 3, 4], 2, kv(2, 7.0))
    assert seg is not None and len(seg.nodes) == 1
    got = KVTrie.gather(trie.match([1, 2, 3, 4])[1])
    assert got[:, :, :, :3].eq(1).all() and got[:, :, :, 3].eq(7).all()
