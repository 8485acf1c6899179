"""genlm.backend internals that genlm's own tests (and some genlm code) reach, on genlm_fast.

`AsyncTransformer.walk_cache`, ``_caches`` (genlm's cache trie), ``add_query`` / ``queries``
(its query queue) and the async tries' ``_task`` read or feed genlm_fast's own structures
(the key/value trie, the auto-batcher). Checked against the real genlm-backend 0.3.1 running
the same operations, against a set-of-contexts model of what the key/value trie holds, and
against a plain transformers forward for the states and logits handed out.

The model is a small Llama of seeded random weights with SmolLM2's tokenizer (built here,
in a second: the tests are about bookkeeping, not about a trained model's answers).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer, QueriesResetError
from genlm_fast.models import smollm2_path

TOKENS = [[5, 17, 300, 41], [5, 17, 300, 41, 9, 9], [5, 17, 2000], [700, 1, 2]]


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path(quiet=True))


@pytest.fixture(scope="module")
def ref_vocab(tokenizer):
    """genlm's own decoding of the vocabulary (for its tries, the oracles)."""
    from genlm.backend.tokenization import decode_vocab

    return decode_vocab(tokenizer)[0]


@pytest.fixture(scope="module")
def reference():
    """The same weights, untouched by any backend (genlm_fast packs its model's layers)."""
    return _tiny_llama()


@pytest.fixture
def lm(tokenizer):
    model = AsyncTransformer(_tiny_llama(), tokenizer)
    yield model
    model.cleanup()


@pytest.fixture
def theirs(tokenizer):
    import genlm.backend.llm as genlm_llm

    model = genlm_llm.AsyncTransformer(_tiny_llama(), tokenizer, timeout=0.001)
    assert type(model).__module__.startswith("genlm.backend")
    return model


def _plain(model, ids):
    """Last-position logits and the key/value states ``[L, 2, H, T, D]`` of a forward."""
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=True)
    kv = torch.stack(
        [torch.stack((layer.keys[0], layer.values[0])) for layer in out.past_key_values.layers]
    )
    return out.logits[0, -1], kv


def _kv_of(cache):
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _walk_oracle(evaluated, ids):
    """(matched, base) from the set of contexts run so far (no eviction at this size):
    every prefix of an evaluated context is a node, and all its positions have states."""
    matched = max((_common(c, ids) for c in evaluated), default=0)
    return matched, min(matched, max(len(ids) - 1, 0))


@pytest.mark.asyncio
async def test_walk_cache_and_caches_follow_the_contexts_run(lm, reference):
    evaluated = []
    for ids in TOKENS[:3]:
        await lm.next_token_logprobs(ids)
        evaluated.append(tuple(ids))
    for ids in TOKENS + [TOKENS[1][:2] + [8], [], [5]]:
        node, matched, past, base = lm.walk_cache(ids)
        assert (matched, base) == _walk_oracle(evaluated, ids), ids
        assert node.prefix == tuple(ids[:matched])
        if base == 0:
            assert past is None
        else:  # the stored states of ids[:base], as a fresh forward computes them
            assert past.get_seq_length() == base
            torch.testing.assert_close(
                _kv_of(past), _plain(reference, ids[:base])[1], rtol=0, atol=1e-5
            )
    # _caches[None] is the root: children, has_token / get_token walk what was run
    root = lm._caches[None]
    assert sorted(root.children) == sorted({c[0] for c in evaluated})
    node = root
    for tok in TOKENS[1]:
        assert node.has_token(tok)
        node = node.get_token(tok)
    assert not node.has_token(12345) and node.children == {}
    with pytest.raises(KeyError):
        node.get_token(12345)
    torch.testing.assert_close(
        _kv_of(node.past_key_values), _plain(reference, TOKENS[1])[1], rtol=0, atol=1e-5
    )
    # log probabilities: those of the contexts asked for (from the output cache)
    want = torch.log_softmax(_plain(reference, TOKENS[1])[0], -1)
    torch.testing.assert_close(node.logprobs, want, rtol=0, atol=1e-4)
    assert root.get_token(5).logprobs is None  # [5] itself was never asked for
    # genlm's repr: '[token: child, ...]', '*' where the prefix has states
    assert repr(root) == "[5: *[17: *[300: *[41: *[9: *[9: *[]]]], 2000: *[]]]]"
    assert list(lm._caches) == [None] and len(lm._caches) == 1
    lm.clear_cache()
    assert repr(lm._caches[None]) == "[]"
    node, matched, past, base = lm.walk_cache(TOKENS[0])
    assert (node.prefix, matched, past, base) == ((), 0, None, 0)


@pytest.mark.asyncio
async def test_walk_cache_after_cache_kv_agrees_with_genlm(lm, theirs, reference):
    """The sequence genlm's own tests run: a context, then cache_kv of a prefix of it,
    which (in both) forgets what was cached beyond that prefix."""
    base_prompt, extended = TOKENS[0], TOKENS[1]
    probes = (extended, base_prompt, TOKENS[2], base_prompt + [3])
    before = {}
    for model in (lm, theirs):
        model.clear_cache()
        before[model] = await model.next_token_logprobs(extended)
        model.cache_kv(base_prompt)
    for ids in probes:
        mine, genlm = lm.walk_cache(ids), theirs.walk_cache(ids)
        assert mine[1] == genlm[1], ids  # tokens matched
        if ids[: len(base_prompt)] == base_prompt and len(ids) > len(base_prompt):
            assert mine[3] == genlm[3] == len(base_prompt), ids  # past: the prompt's states
            torch.testing.assert_close(_kv_of(mine[2]), _kv_of(genlm[2]), rtol=0, atol=1e-5)
        else:  # genlm keeps the prompt's states whole; genlm_fast any prefix of them
            assert genlm[3] == 0 and genlm[2] is None
            assert mine[3] == min(_common(base_prompt, ids), len(ids) - 1), ids
    for model in (lm, theirs):
        after = await model.next_token_logprobs(extended)
        torch.testing.assert_close(after, before[model], rtol=0, atol=1e-4)
    # both cache the answer again; genlm_fast also keeps the new positions' states (genlm
    # only keeps those of cache_kv prompts), so its past reaches further
    for ids in probes:
        assert lm.walk_cache(ids)[1] == theirs.walk_cache(ids)[1], ids
    assert lm.walk_cache(extended)[3] == len(extended) - 1
    assert theirs.walk_cache(extended)[3] == len(base_prompt)
    node = lm.walk_cache(base_prompt)[0]
    torch.testing.assert_close(
        _kv_of(node.past_key_values), _plain(reference, base_prompt)[1], rtol=0, atol=1e-5
    )
    # a context extending a cached one: within rounding of a forward from scratch
    prompt = base_prompt + [77, 78]
    have = await lm.next_token_logprobs(prompt)
    torch.testing.assert_close(have, lm.next_token_logprobs_uncached(prompt), rtol=1e-5, atol=1e-5)


@pytest.mark.asyncio
async def test_add_query_and_queries(lm, reference):
    loop = asyncio.get_running_loop()
    ids = TOKENS[1]
    future = loop.create_future()
    lm.add_query(ids, future, None)
    assert [(q.prompt, q.future, q.lora_name) for q in lm.queries] == [(tuple(ids), future, None)]
    lm.batch_evaluate_queries()
    torch.testing.assert_close(await future, _plain(reference, ids)[0], rtol=0, atol=1e-4)
    assert lm.queries == []
    # with a past from walk_cache: the query is the rest of the context
    _, _, past, base = lm.walk_cache(ids + [4])
    assert base == len(ids)
    future = loop.create_future()
    lm.add_query([4], future, past)
    assert lm.queries[0].prompt == tuple(ids + [4])
    lm.batch_evaluate_queries()
    torch.testing.assert_close(await future, _plain(reference, ids + [4])[0], rtol=0, atol=1e-4)
    # a past that walk_cache did not hand out: genlm_fast cannot know its tokens
    from genlm_fast.backend.llm.cache_view import dynamic_cache

    for foreign in (dynamic_cache(_plain(reference, ids)[1]), object()):
        with pytest.raises(ValueError, match="walk_cache"):
            lm.add_query([4], loop.create_future(), foreign)
    # emptying the queue tells the waiting callers, as reset_async_queries does
    waiting = [loop.create_future(), loop.create_future()]
    lm.add_query(TOKENS[2], waiting[0], None)
    lm.add_query(TOKENS[2], waiting[1], None)  # an identical context: one row, two callers
    assert len(lm.queries) == 2
    lm.queries = []
    assert lm.queries == []
    for fut in waiting:
        with pytest.raises(QueriesResetError):
            await fut
    with pytest.raises(ValueError, match="emptied"):
        lm.queries = [1]
    # a future of another loop could never be woken here
    other = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="event loop"):
            lm.add_query(ids, other.create_future(), None)
    finally:
        other.close()
    with pytest.raises(ValueError):
        lm.add_query([], loop.create_future(), None)


@pytest.mark.asyncio
async def test_add_query_is_answered_by_the_timer(tokenizer, reference):
    lm = AsyncTransformer(_tiny_llama(), tokenizer, timeout=0.01, flush_when_idle=False)
    try:
        future = asyncio.get_running_loop().create_future()
        lm.add_query(TOKENS[3], future, None)
        await asyncio.sleep(0.05)
        assert future.done()
        torch.testing.assert_close(
            future.result(), _plain(reference, TOKENS[3])[0], rtol=0, atol=1e-4
        )
    finally:
        lm.cleanup()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["character", "byte"])
async def test_async_trie_task(kind, tokenizer, ref_vocab):
    import genlm.backend.trie as ref_trie
    import genlm.bytes.trie as ref_bytes

    from genlm_fast.backend.tokenization import decode_vocab
    from genlm_fast.backend.trie import AsyncTokenCharacterTrie
    from genlm_fast.bytes.trie import AsyncTokenByteTrie

    byte_vocab, _ = decode_vocab(tokenizer)
    vocab = byte_vocab[:300]
    ref_vocab = ref_vocab[:300]
    # the oracle: genlm's own trie over the same tokens, not our sync trie
    ref = (
        ref_trie.TokenCharacterTrie(ref_vocab)
        if kind == "character"
        else ref_bytes.TokenByteTrie(ref_vocab, device="cpu")
    )
    trie = (
        AsyncTokenCharacterTrie.from_vocab(vocab)
        if kind == "character"
        else AsyncTokenByteTrie.from_vocab(vocab)
    )
    assert trie._task is None
    trie.start()
    task = trie._task
    assert isinstance(task, asyncio.Task) and not task.done()
    row = torch.rand(len(vocab), dtype=torch.float64)
    want = ref.weight_sum(row.numpy() if kind == "character" else row)
    torch.testing.assert_close(
        torch.as_tensor(await trie.weight_sum(row), dtype=torch.float64),
        torch.as_tensor(want, dtype=torch.float64),
        rtol=1e-5,  # sums of up to 300 float32 weights
        atol=1e-6,
    )
    await trie.cleanup()
    assert trie._task is None and task.done()


def test_kv_trie_walk_and_drop_extensions():
    """The KVTrie reads the walk is built on, and cache_kv's drop, against a brute-force
    model: the set of stored (context, segment) pairs and what they cover."""
    from genlm_fast.backend.cache import KVTrie

    def kv(n, value):
        return torch.full((2, 2, 1, n, 3), float(value))

    trie = KVTrie(max_tokens=100)
    trie.insert([1, 2, 3, 4], 0, kv(4, 1))  # one forward: positions 0-3
    trie.insert([1, 2, 3, 4, 5, 6], 4, kv(2, 2))  # extends it
    trie.insert([1, 2, 7], 2, kv(1, 3))  # a sibling branch
    trie.insert([8], 0, kv(1, 4))
    assert trie.n_tokens == 8 and len(trie) == 4
    assert [trie.walk(ids) for ids in ([1, 2, 3, 4, 5, 6, 0], [1, 2, 9], [], [0])] == [6, 2, 0, 0]
    assert trie.next_tokens([1, 2]) == [3, 7] and trie.next_tokens([]) == [1, 8]
    assert trie.next_tokens([1, 9]) == [] and trie.next_tokens([8]) == []
    trie.drop_extensions([1, 2, 3])
    # [1, 2, 3, 4] and what extends it are gone; the first segment still holds [1, 2, 3]
    assert trie.walk([1, 2, 3, 4, 5]) == 3 and trie.next_tokens([1, 2]) == [3, 7]
    assert trie.match([1, 2, 3])[0] == 3 and trie.match([1, 2, 7])[0] == 3
    assert trie.n_tokens == 6 and len(trie) == 3  # the [5, 6] segment is freed
    got = KVTrie.gather(trie.match([1, 2, 7])[1])
    assert got[:, :, :, :2].eq(1).all() and got[:, :, :, 2].eq(3).all()
    trie.drop_extensions([1])
    assert trie.next_tokens([]) == [1, 8] and trie.walk([1, 2]) == 1
    assert trie.n_tokens == 5 and len(trie) == 2  # the [7] segment freed, the first kept
    trie.drop_extensions([])
    assert trie.n_tokens == 0 and len(trie) == 0 and trie.next_tokens([]) == []
    trie.drop_extensions([4, 4])  # nothing there: nothing happens
    # eviction after a drop still balances the books
    trie.insert([1, 2], 0, kv(2, 5))
    assert trie.n_tokens == 2 and trie.match([1, 2])[0] == 2
