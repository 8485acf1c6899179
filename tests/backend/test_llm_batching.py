"""Auto-batching of the LM backends, driven by MockAsyncLM: hundreds of concurrent
requests, batch sizes, cancelled waiters and batch calls, a failing forward reaching
every waiter of its batch, resets, full batches and the batch timer.

The mock runs through exactly the batcher and caches AsyncTransformer uses; every row
is checked against an independent computation of the mock's distribution
(tests/backend/llm_mock_support.py)."""

import asyncio
import random
import time

import pytest
import torch

from genlm_fast.backend.llm import QueriesResetError
from tests.backend.llm_mock_support import decode_once as decode_once  # autouse
from tests.backend.llm_mock_support import expected, make
from tests.backend.llm_mock_support import tokenizer as tokenizer  # a fixture
from tests.backend.llm_mock_support import vocab_size as vocab_size  # a fixture

# the vocabulary is decoded once per tokenizer: the tests build many fresh models


def random_contexts(rng, n, vocab_size, dup_every=5):
    ctxs = []
    for i in range(n):
        if ctxs and i % dup_every == 0:
            ctxs.append(list(rng.choice(ctxs)))  # duplicates of earlier requests
        else:
            ctxs.append([rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))])
    return ctxs


@pytest.mark.asyncio
async def test_hundreds_of_concurrent_requests(tokenizer, vocab_size):
    rng = random.Random(0)
    lm = make(tokenizer, batch_size=16, timeout=0.001)
    ctxs = random_contexts(rng, 400, vocab_size)
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
    for ctx, row in zip(ctxs, rows):
        torch.testing.assert_close(row, lm.next_token_logprobs_sync(ctx), rtol=0, atol=0)
        torch.testing.assert_close(row, expected(ctx, vocab_size))
    n_unique = len({tuple(c) for c in ctxs})
    assert lm.stats["rows"] == n_unique  # duplicates shared a row, never recomputed
    assert lm.stats["batches"] >= n_unique // 16
    # batch form, with duplicates inside the batch
    stacked = await lm.batch_next_token_logprobs(ctxs[:50])
    assert stacked.shape == (50, vocab_size)
    for ctx, row in zip(ctxs[:50], stacked):
        torch.testing.assert_close(row, expected(ctx, vocab_size))


@pytest.mark.asyncio
async def test_batches_never_exceed_batch_size(tokenizer, vocab_size, monkeypatch):
    lm = make(tokenizer, batch_size=7, timeout=0.001)
    sizes = []
    forward = lm._forward

    def spy(lora, rows):
        sizes.append(len(rows))
        assert len(set(rows)) == len(rows)
        return forward(lora, rows)

    monkeypatch.setattr(lm, "_forward", spy)
    ctxs = random_contexts(random.Random(1), 200, vocab_size, dup_every=3)
    await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
    assert max(sizes) <= 7 and sum(sizes) == len({tuple(c) for c in ctxs})


@pytest.mark.asyncio
async def test_random_cancellations(tokenizer, vocab_size):
    rng = random.Random(2)
    lm = make(tokenizer, batch_size=16, timeout=0.002)
    ctxs = random_contexts(rng, 300, vocab_size, dup_every=2)
    tasks = [asyncio.create_task(lm.next_token_logprobs(c)) for c in ctxs]
    victims = set(rng.sample(range(len(tasks)), 90))
    for step in range(4):
        for i in victims:
            if i % 4 == step:
                tasks[i].cancel()
        await asyncio.sleep(0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    survivors = 0
    for i, (ctx, res) in enumerate(zip(ctxs, results)):
        if isinstance(res, asyncio.CancelledError):
            assert i in victims
            continue
        assert not isinstance(res, BaseException), res
        torch.testing.assert_close(res, expected(ctx, vocab_size))
        survivors += 1
    assert survivors >= len(ctxs) - len(victims)
    # nothing left behind: the model keeps working
    assert not lm._pending and lm._timer is None
    torch.testing.assert_close(
        await lm.next_token_logprobs([4, 5, 6]), expected([4, 5, 6], vocab_size)
    )


@pytest.mark.asyncio
async def test_cancelled_waiters_leave_the_queue_at_once(tokenizer, vocab_size):
    """A waiter cancelled before its batch runs is gone from the queue at once: its row goes
    when nobody else waits for it, and the timer when nothing is left queued."""
    lm = make(tokenizer, batch_size=100, timeout=30.0, flush_when_idle=False)
    first, twin, other = (
        asyncio.ensure_future(lm.next_token_logprobs(c)) for c in ([1, 2], [1, 2], [3])
    )
    await asyncio.sleep(0)
    assert len(lm._pending) == 2 and lm._queued == 3 and lm._timer is not None
    first.cancel()
    await asyncio.sleep(0)
    assert len(lm._pending) == 2 and lm._queued == 2  # the row stays for its twin
    other.cancel()
    await asyncio.sleep(0)
    assert list(lm._pending) == [(None, (1, 2))] and lm._queued == 1
    assert lm._timer is not None
    late = asyncio.ensure_future(lm.next_token_logprobs([4]))
    await asyncio.sleep(0)
    twin.cancel()
    late.cancel()
    await asyncio.sleep(0)
    assert not lm._pending and lm._queued == 0 and lm._timer is None
    assert lm.stats["rows"] == 0
    # and the next query is answered as usual
    lm.timeout = 0.01
    torch.testing.assert_close(await lm.next_token_logprobs([1, 2]), expected([1, 2], vocab_size))


@pytest.mark.asyncio
async def test_cancelling_one_of_two_identical_waiters(tokenizer, vocab_size):
    lm = make(tokenizer, batch_size=100, timeout=0.05)
    a = asyncio.create_task(lm.next_token_logprobs([8, 8, 8]))
    b = asyncio.create_task(lm.next_token_logprobs([8, 8, 8]))
    c = asyncio.create_task(lm.next_token_logprobs([9]))
    await asyncio.sleep(0)
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    torch.testing.assert_close(await b, expected([8, 8, 8], vocab_size))
    torch.testing.assert_close(await c, expected([9], vocab_size))
    assert lm.stats["rows"] == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["batch_next_token_logprobs", "batch_next_token_logits"])
async def test_a_batch_call_cancelled_at_once_leaves_nothing_running(tokenizer, vocab_size, call):
    """Cancelled before its first step ends (its contexts queued, not yet gathered), a batch
    call takes its queries with it: no forward runs for it later and no task is left
    behind (a query left running would log a bad context's error as never retrieved)."""
    lm = make(tokenizer, batch_size=100, timeout=0.2, flush_when_idle=False)
    before = set(asyncio.all_tasks())
    task = asyncio.create_task(getattr(lm, call)([[1], [2], [3, 4]]))
    await asyncio.sleep(0)  # the call has queued its contexts and yields
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)  # past the timer
    assert lm.stats["batches"] == 0 and lm.stats["rows"] == 0
    assert {t for t in asyncio.all_tasks() if not t.done()} <= before | {asyncio.current_task()}
    torch.testing.assert_close(await lm.next_token_logprobs([1]), expected([1], vocab_size))


@pytest.mark.asyncio
async def test_a_bad_context_fails_its_batch_call_before_any_forward(tokenizer, vocab_size):
    """As the blocking form does: every context is checked before any is evaluated."""
    lm = make(tokenizer, batch_size=100, timeout=0.01)
    for call in (lm.batch_next_token_logprobs, lm.batch_next_token_logits):
        with pytest.raises(ValueError, match="vocabulary"):
            await call([[1], [2], [vocab_size + 7]])
    with pytest.raises(ValueError, match="vocabulary"):
        lm.batch_next_token_logprobs_sync([[1], [vocab_size + 7]])
    await asyncio.sleep(0.05)
    assert lm.stats["rows"] == 0 and not lm._pending


@pytest.mark.asyncio
async def test_exception_reaches_every_waiter(tokenizer, vocab_size, monkeypatch):
    lm = make(tokenizer, batch_size=10, timeout=0.001)
    calls = []
    forward = lm._forward

    def failing(lora, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("device on fire")
        return forward(lora, rows)

    monkeypatch.setattr(lm, "_forward", failing)
    ctxs = [[i, 1000 + i] for i in range(30)]
    results = await asyncio.gather(
        *(lm.next_token_logprobs(c) for c in ctxs), return_exceptions=True
    )
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert len(failed) == calls[1] == 10  # exactly the second batch, all of it
    for i in failed:
        assert isinstance(results[i], RuntimeError) and "device on fire" in str(results[i])
    for i, r in enumerate(results):
        if i not in failed:
            torch.testing.assert_close(r, expected(ctxs[i], vocab_size))
    # the failed contexts were not cached: they can be asked again
    again = await asyncio.gather(*(lm.next_token_logprobs(ctxs[i]) for i in failed))
    for i, r in zip(failed, again):
        torch.testing.assert_close(r, expected(ctxs[i], vocab_size))


@pytest.mark.asyncio
async def test_duplicate_waiters_share_an_exception(tokenizer, monkeypatch):
    lm = make(tokenizer, batch_size=50, timeout=0.001)

    def boom(lora, rows):
        raise ValueError("bad batch")

    monkeypatch.setattr(lm, "_forward", boom)
    results = await asyncio.gather(
        *(lm.next_token_logprobs([3, 3]) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, ValueError) for r in results)


@pytest.mark.asyncio
async def test_reset_async_queries_fails_waiters(tokenizer, vocab_size):
    lm = make(tokenizer, batch_size=1000, timeout=30.0)
    tasks = [asyncio.create_task(lm.next_token_logprobs([i + 1])) for i in range(12)]
    await asyncio.sleep(0)
    assert len(lm._pending) == 12
    lm.reset_async_queries()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, QueriesResetError) for r in results)
    assert lm.stats["rows"] == 0 and lm._timer is None
    lm.timeout = 0.0
    torch.testing.assert_close(await lm.next_token_logprobs([1]), expected([1], vocab_size))


@pytest.mark.asyncio
async def test_full_batch_does_not_wait_for_timer(tokenizer):
    lm = make(tokenizer, batch_size=5, timeout=60.0, flush_when_idle=False)
    start = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs([i + 1, 2]) for i in range(5))), 10
    )
    assert time.perf_counter() - start < 10
    assert lm.stats["batches"] == 1


@pytest.mark.asyncio
async def test_identical_queries_fill_a_batch(tokenizer, vocab_size):
    """batch_size counts queries as genlm does, identical ones each time: 3 callers of
    one context and 2 of another fill a batch of 5 (one model call, 2 rows) without
    waiting for the timer."""
    lm = make(tokenizer, batch_size=5, timeout=60.0, flush_when_idle=False)
    ctxs = [[4, 4]] * 3 + [[5]] * 2
    rows = await asyncio.wait_for(asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs)), 10)
    for ctx, row in zip(ctxs, rows):
        torch.testing.assert_close(row, expected(ctx, vocab_size))
    assert lm.stats["batches"] == 1 and lm.stats["rows"] == 2
    # four queries are not a full batch: they wait (and are then answered together)
    waiting = [asyncio.create_task(lm.next_token_logprobs([6, i % 2])) for i in range(4)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in waiting) and lm._queued == 4
    lm.batch_evaluate_queries()
    for i, row in enumerate(await asyncio.gather(*waiting)):
        torch.testing.assert_close(row, expected([6, i % 2], vocab_size))
    assert lm.stats["batches"] == 2 and lm.stats["rows"] == 4 and lm._queued == 0


@pytest.mark.asyncio
async def test_timer_starts_at_first_query(tokenizer):
    """A steady trickle of queries must not postpone the batch (genlm's timer restarts)."""
    lm = make(tokenizer, batch_size=10_000, timeout=0.3, flush_when_idle=False)
    start = time.perf_counter()
    first = asyncio.create_task(lm.next_token_logprobs([1, 2, 3]))
    done_at = None
    others = []
    for i in range(40):  # one query every 50 ms for 2 s
        others.append(asyncio.create_task(lm.next_token_logprobs([7, i + 1])))
        await asyncio.sleep(0.05)
        if done_at is None and first.done():
            done_at = time.perf_counter() - start
    await asyncio.gather(first, *others)
    assert done_at is not None and done_at < 1.5, done_at
    assert lm.stats["batches"] >= 3
