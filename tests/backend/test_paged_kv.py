"""The paged key/value pool (`genlm_fast.backend.llm.paged_kv`) and `AsyncTransformer`'s
forwards over it (``paged_kv=True``, `genlm_fast.backend.llm.paged_forward`).

The trie is checked against a brute-force record of what every position's states should
be; the LM against a float64 forward of each whole context (on a CPU the model computes in
float64 with the plain-torch attention, and in float32 with the Triton kernel under its
interpreter; on a GPU, float32 with CUDA graphs recorded and replayed).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.backend.llm.checks import NonFiniteLogitsError
from genlm_fast.backend.llm.paged_kv import PagedKVPool, PagedKVTrie, PagedPoolFull
from tests.backend.small_models import DEVICE, DTYPE, ON_GPU, small_model, smc_rounds, tokenizer

__all__ = ["tokenizer"]  # (a fixture)
# against float64: a float64 model's answers are rounded once to the float32 rows handed out
# (half an ulp of log-probabilities up to ~30 nats); a float32 model on a GPU, its rounding
TOL = 1e-4 if ON_GPU else 4e-6

# ---- the trie over the pool, without a model ---------------------------------------------


def fake_forward(trie, plan, truth):
    """Write each new position's states as the forward would: a value that names its
    context (``truth[prefix]``, one float per layer, key/value, head and dim)."""
    pool = trie.pool
    for row in plan.rows:
        for i, slot in enumerate(row.slots):
            prefix = tuple(row.ids[: row.depth + i + 1])
            value = truth.setdefault(prefix, float(len(truth) + 1))
            pool.kv[:, :, slot] = value


def stored_states(trie, ids):
    """The states of context ``ids`` read through its block table, one value a position."""
    depth, node = trie.match(ids)
    assert depth == len(ids)
    kv = trie.gather(node)  # [layers, 2, heads, length, dim]
    assert kv.shape[3] == len(ids)
    first = kv[0, 0, 0, :, 0]
    assert (kv == first[None, None, None, :, None]).all()
    return first.tolist()


def drive(trie, rows, truth):
    plan = trie.plan(rows)
    trie.pool.copy_prefixes(plan.copies)
    fake_forward(trie, plan, truth)
    trie.commit(plan)
    return plan


def check_every_context(trie, contexts, truth):
    for ids in contexts:
        depth, _ = trie.match(ids)
        if depth == len(ids):
            assert stored_states(trie, ids) == [truth[tuple(ids[: n + 1])] for n in range(len(ids))]


def blocks_accounted(trie):
    """Every block is free, scratch, or holds a node's states: none is lost."""
    pool = trie.pool
    assert len(set(pool.free)) == len(pool.free)
    assert 0 not in pool.free
    assert len(pool.free) + trie.blocks_used == pool.blocks - 1


@pytest.mark.parametrize("page", [1, 3, 4, 16])
def test_block_tables_read_every_path_back_through_forks_and_evictions(page):
    """SMC-like growth (a token a row a step, rows duplicated and dropped: forks in the
    middle of a block are copied on write) in a pool small enough to evict: every stored
    context reads back its own states through its block table."""
    pool = PagedKVPool(2, 1, 2, torch.float32, "cpu", blocks=260 // page + 8, page=page)
    trie = PagedKVTrie(pool)
    rng = random.Random(page)
    truth, seen = {}, []
    rows = [[1, 2, 3, 4, 5], [1, 2, 3, 9]]
    copies = 0
    for step in range(60):
        plan = drive(trie, rows, truth)
        copies += len(plan.copies)
        seen.extend(rows)
        rows = [r + [rng.randrange(50)] for r in rows]
        if rng.random() < 0.6:
            rows.append(list(rng.choice(rows)[:-1]) + [rng.randrange(50, 60)])
        if len(rows) > 6:
            rows.pop(rng.randrange(len(rows)))
        if step % 10 == 9:  # a fresh context: old ones age out of the pool
            rows[rng.randrange(len(rows))] = [rng.randrange(60, 90) for _ in range(5)]
        check_every_context(trie, seen, truth)
        blocks_accounted(trie)
    if page > 1:
        assert copies > 0  # forks inside a block happened and were copied on write
    assert any(trie.match(ids)[0] < len(ids) for ids in seen)  # and evictions


def test_a_batch_too_large_for_the_pool_names_the_budget_and_takes_nothing():
    pool = PagedKVPool(1, 1, 1, torch.float32, "cpu", blocks=4, page=4)
    trie = PagedKVTrie(pool)
    truth = {}
    drive(trie, [[1, 2, 3, 4, 5, 6]], truth)  # 2 blocks
    free = list(pool.free)
    with pytest.raises(PagedPoolFull, match=r"3 blocks of 4 positions \(12 positions"):
        trie.plan([[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 7, 7, 7]])
    assert sorted(pool.free) == sorted(free)
    check_every_context(trie, [[1, 2, 3, 4, 5, 6]], truth)
    blocks_accounted(trie)
    # a batch that fits once the least recently used context is evicted
    drive(trie, [[8, 8, 8, 8, 8, 8, 8, 8, 8]], truth)
    assert trie.match([1, 2, 3, 4, 5, 6])[0] < 6
    check_every_context(trie, [[8] * 9], truth)
    blocks_accounted(trie)


def test_a_failed_forward_gives_every_block_back():
    pool = PagedKVPool(1, 1, 1, torch.float32, "cpu", blocks=10, page=4)
    trie = PagedKVTrie(pool)
    truth = {}
    drive(trie, [[1, 2, 3, 4, 5, 6]], truth)
    free = sorted(pool.free)
    plan = trie.plan([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], [9, 9, 9, 9, 9, 9]])
    assert plan.copies and plan.appended  # one row appends, its sibling copies on write
    trie.release_plan(plan)
    assert sorted(pool.free) == free
    # the block the first row would have continued can be continued again, in place
    again = trie.plan([[1, 2, 3, 4, 5, 6, 7]])
    assert not again.copies
    trie.release_plan(again)
    blocks_accounted(trie)


def test_clear_and_drop_extensions_give_blocks_back():
    pool = PagedKVPool(1, 1, 1, torch.float32, "cpu", blocks=12, page=2)
    trie = PagedKVTrie(pool)
    truth = {}
    drive(trie, [[1, 2, 3], [1, 2, 4, 5, 6]], truth)
    drive(trie, [[1, 2, 3, 7, 8, 9]], truth)
    used = trie.blocks_used
    trie.drop_extensions([1, 2, 3])
    assert trie.match([1, 2, 3, 7])[0] == 3 and trie.blocks_used < used
    check_every_context(trie, [[1, 2, 3], [1, 2, 4, 5, 6]], truth)
    blocks_accounted(trie)
    trie.clear()
    assert trie.blocks_used == 0 and len(pool.free) == pool.blocks - 1
    assert trie.match([1, 2, 3]) == (0, trie.root)


# ---- AsyncTransformer(paged_kv=True) --------------------------------------------------


def float64_rows(model, contexts):
    """log-softmax of a float64 forward of each whole context (the oracle)."""
    model64 = model.to("cpu", torch.float64)
    out = []
    with torch.no_grad():
        for ids in contexts:
            out.append(torch.log_softmax(model64(torch.tensor([ids])).logits[0, -1], dim=-1))
    return out


def check_against_float64(family, answers, atol):
    model64 = small_model(answers[0][0][1].shape[0], family)
    for round_ in answers:
        contexts = [ids for ids, _ in round_]
        for (_, row), want in zip(round_, float64_rows(model64, contexts)):
            torch.testing.assert_close(row.double(), want, atol=atol, rtol=0)


PROMPTS = ["The capital of France is", "Once upon a time", "def f(x):\n    return"]


def paged_lm(model, tokenizer, **kwargs):
    lm = AsyncTransformer(model, tokenizer, paged_kv=True, **kwargs)
    assert lm.forward_path.startswith("paged")
    return lm


def count_steps(lm, monkeypatch):
    """How many rows each one-token step from a bucket ran (a list appended to per step)."""
    steps = []
    real = lm._forwards.paged.forward._step

    def spy(rows, pool, pad_id):
        steps.append(len(rows))
        return real(rows, pool, pad_id)

    monkeypatch.setattr(lm._forwards.paged.forward, "_step", spy)
    return steps


@pytest.mark.parametrize(
    "family, n_particles", [("llama", 1), ("llama", 16), ("qwen2", 3), ("gpt2", 5)]
)
def test_smc_rounds_match_a_float64_forward(tokenizer, monkeypatch, family, n_particles):
    """Particles grown a token a round, resampled (forks share blocks, copy on write), with
    blocks of 4 positions so that pasts cross many blocks: every answer within float64
    rounding of a forward of the whole context, and every step after the prompts' from a
    bucket."""
    model = small_model(len(tokenizer), family)
    lm = paged_lm(model, tokenizer)
    lm._forwards.paged.PAGE = 4
    steps = count_steps(lm, monkeypatch)
    prompts = [tokenizer.encode(PROMPTS[i % 3]) for i in range(n_particles)]
    answers = asyncio.run(smc_rounds(lm, prompts, 10, seed=n_particles))
    assert len(steps) >= 9, steps
    check_against_float64(family, answers, atol=TOL)
    trie = lm._kv_trie(None)
    blocks_accounted(trie)
    lm.clear_cache()
    assert trie.blocks_used == 0 and len(trie.pool.free) == trie.pool.blocks - 1
    lm.cleanup()


@pytest.mark.skipif(ON_GPU, reason="on a GPU every test above runs the Triton kernel")
def test_the_triton_kernel_in_the_model_under_the_interpreter(tokenizer):
    """The same rounds with the Triton kernel (CPU interpreter) as the model's attention, on a
    float32 copy of the model: within float32 rounding of float64."""
    model = small_model(len(tokenizer), "llama").float()
    lm = paged_lm(model, tokenizer)
    lm._forwards.paged.PAGE = 4
    lm._forwards.paged.forward.backend = "triton"
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    answers = asyncio.run(smc_rounds(lm, prompts, 4, seed=3))
    check_against_float64("llama", answers, atol=5e-5)
    lm.cleanup()


def test_prefills_and_mixed_batches_run_eagerly_over_the_pool(tokenizer, monkeypatch):
    """Rows with several new tokens (prompts, a context extended by three tokens) beside
    one-token rows run in one eager forward over the pool, causal by position."""
    model = small_model(len(tokenizer), "llama")
    lm = paged_lm(model, tokenizer)
    steps = count_steps(lm, monkeypatch)
    a, b = tokenizer.encode(PROMPTS[0]), tokenizer.encode(PROMPTS[1])

    async def go():
        first = await lm.batch_next_token_logprobs([a, b])
        second = await lm.batch_next_token_logprobs([a + [5], b + [6, 7, 8], [9, 10]])
        return [
            (a, first[0]),
            (b, first[1]),
            (a + [5], second[0]),
            (b + [6, 7, 8], second[1]),
            ([9, 10], second[2]),
        ]

    got = asyncio.run(go())
    assert steps == []
    for (_, row), want in zip(
        got, float64_rows(small_model(len(tokenizer), "llama"), [i for i, _ in got])
    ):
        torch.testing.assert_close(row.double().cpu(), want, atol=TOL, rtol=0)
    lm.cleanup()


def test_a_small_pool_evicts_and_still_answers_right(tokenizer):
    """A pool of a few blocks: least recently used contexts are evicted between rounds and
    their extensions computed again, with the same answers."""
    model = small_model(len(tokenizer), "llama")
    per_position = AsyncTransformer(model, tokenizer).kv_bytes_per_token
    lm = paged_lm(model, tokenizer, kv_cache_tokens=64)
    lm._forwards.paged.PAGE = 4
    assert lm.kv_bytes_per_token == per_position
    prompts = [tokenizer.encode(p) for p in PROMPTS] * 2
    answers = asyncio.run(smc_rounds(lm, prompts, 6, seed=5))
    check_against_float64("llama", answers, atol=TOL)
    blocks_accounted(lm._kv_trie(None))
    lm.cleanup()


def test_a_pool_too_small_for_a_batch_fails_every_caller_and_recovers(tokenizer):
    model = small_model(len(tokenizer), "llama")
    lm = paged_lm(model, tokenizer, kv_cache_tokens=32)
    long = [tokenizer.encode(PROMPTS[i % 3]) + list(range(100, 120 + i)) for i in range(3)]

    async def go():
        return await asyncio.gather(
            *(lm.next_token_logprobs(ids) for ids in long), return_exceptions=True
        )

    results = asyncio.run(go())
    assert all(isinstance(r, PagedPoolFull) for r in results), results
    assert "kv_cache_tokens" in str(results[0])
    blocks_accounted(lm._kv_trie(None))
    short = tokenizer.encode(PROMPTS[0])
    row = asyncio.run(lm.next_token_logprobs(short))
    torch.testing.assert_close(
        row.double().cpu(),
        float64_rows(small_model(len(tokenizer), "llama"), [short])[0],
        atol=TOL,
        rtol=0,
    )
    lm.cleanup()


def test_a_nan_in_a_stored_past_is_caught_and_its_blocks_come_back(tokenizer):
    model = small_model(len(tokenizer), "llama")
    lm = paged_lm(model, tokenizer)
    ids = tokenizer.encode(PROMPTS[0])
    asyncio.run(lm.next_token_logprobs(ids))
    trie = lm._kv_trie(None)
    free = sorted(trie.pool.free)
    _, node = trie.match(ids)
    slot = trie.table(node)[0] * trie.page + 1
    trie.pool.kv[:, :, slot] = float("nan")
    with pytest.raises(NonFiniteLogitsError):
        asyncio.run(lm.next_token_logprobs(ids + [42]))
    assert sorted(trie.pool.free) == free
    blocks_accounted(trie)
    lm.cleanup()


def test_cancelled_requests_lose_no_blocks(tokenizer):
    """Callers cancelled while their batch runs: the forward completes, its states are
    kept (evictable), and every block is accounted for."""
    model = small_model(len(tokenizer), "llama")
    lm = paged_lm(model, tokenizer)
    prompts = [tokenizer.encode(p) + [i] for i, p in enumerate(PROMPTS * 4)]

    async def go():
        tasks = [asyncio.ensure_future(lm.next_token_logprobs(p)) for p in prompts]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    blocks_accounted(lm._kv_trie(None))
    # what the uncancelled callers got is right
    kept = [(p, r) for p, r in zip(prompts, results) if isinstance(r, torch.Tensor)]
    wants = float64_rows(small_model(len(tokenizer), "llama"), [p for p, _ in kept])
    for (_, row), want in zip(kept, wants):
        torch.testing.assert_close(row.double().cpu(), want, atol=TOL, rtol=0)
    lm.cleanup()


def test_walk_cache_hands_out_the_pools_states(tokenizer):
    """genlm's cache API over a paged trie: the past of a context is the key/value states
    transformers' own forward computes for it."""
    model = small_model(len(tokenizer), "llama")
    lm = paged_lm(model, tokenizer)
    ids = tokenizer.encode(PROMPTS[2])
    asyncio.run(lm.next_token_logprobs(ids))
    _, depth, past, base = lm.walk_cache(ids + [7])
    assert base == len(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids], device=DEVICE), use_cache=True).past_key_values
    for layer in range(2):
        torch.testing.assert_close(
            past.layers[layer].keys, want.layers[layer].keys, atol=1e-5 if ON_GPU else 1e-12, rtol=0
        )
        torch.testing.assert_close(
            past.layers[layer].values,
            want.layers[layer].values,
            atol=1e-5 if ON_GPU else 1e-12,
            rtol=0,
        )
    lm.cleanup()


def test_paged_kv_option_errors(tokenizer):
    model = small_model(len(tokenizer), "llama")
    with pytest.raises(TypeError, match="paged_kv must be True or False"):
        AsyncTransformer(model, tokenizer, paged_kv="yes")
    with pytest.raises(ValueError, match="kv_cache_tokens and kv_cache_bytes"):
        AsyncTransformer(model, tokenizer, paged_kv=True, kv_cache_tokens=0)
    gpt2 = small_model(len(tokenizer), "gpt2", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="rescaled per layer"):
        AsyncTransformer(gpt2, tokenizer, paged_kv=True)
    assert DTYPE in (torch.float32, torch.float64)
