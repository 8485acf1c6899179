"""Auto-batching of the LM backends across the event loop, driven by MockAsyncLM: the
flush once the loop idles (flush_when_idle) against genlm's timer, several event loops
in turn, and threads each running a loop over one model (cleanup included).

The mock runs through exactly the batcher and caches AsyncTransformer uses; every row
is checked against an independent computation of the mock's distribution
(tests/backend/llm_mock_support.py)."""

import asyncio
import random
import time

import pytest
import torch

from genlm_fast.backend.llm import MockAsyncLM, ModelClosedError, QueriesResetError
from tests.backend.llm_mock_support import decode_once as decode_once  # autouse
from tests.backend.llm_mock_support import expected, make
from tests.backend.llm_mock_support import tokenizer as tokenizer  # a fixture
from tests.backend.llm_mock_support import vocab_size as vocab_size  # a fixture

# the vocabulary is decoded once per tokenizer: the tests build many fresh models


@pytest.mark.asyncio
async def test_idle_loop_runs_the_batch_without_waiting_for_the_timer(tokenizer, vocab_size):
    """flush_when_idle (the default): once every coroutine waits on the model, the batch
    runs, not after the timeout; all of them in one model call."""
    lm = make(tokenizer, batch_size=100, timeout=60.0)
    ctxs = [[3, i + 1] for i in range(30)]
    rows = await asyncio.wait_for(asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs)), 10)
    for ctx, row in zip(ctxs, rows):
        torch.testing.assert_close(row, expected(ctx, vocab_size))
    assert lm.stats["batches"] == 1 and lm.stats["rows"] == 30
    assert lm._timer is None and lm._idle_probe is None


@pytest.mark.asyncio
async def test_idle_flush_waits_for_coroutines_that_can_still_run(tokenizer, vocab_size):
    """Queries that come after other work (each coroutine yields to the loop a different
    number of times first, as nested gathers and sleep(0) do) still join the same batch:
    the loop is not idle while any of them can run."""
    lm = make(tokenizer, batch_size=100, timeout=60.0)

    async def particle(i):
        for _ in range(i):
            await asyncio.sleep(0)
        inner = await asyncio.gather(asyncio.sleep(0, result=i))  # a task of its own
        return await lm.next_token_logprobs([5, inner[0] + 1])

    rows = await asyncio.wait_for(asyncio.gather(*(particle(i) for i in range(12))), 10)
    for i, row in enumerate(rows):
        torch.testing.assert_close(row, expected([5, i + 1], vocab_size))
    assert lm.stats["batches"] == 1 and lm.stats["rows"] == 12


@pytest.mark.asyncio
@pytest.mark.parametrize("flush_when_idle", [True, False])
async def test_batch_calls_made_together_share_one_forward(tokenizer, vocab_size, flush_when_idle):
    """genlm-control's product of two prompted LMs asks both at once (a gather of two batch
    calls, each a few awaits deep): one model call answers both, with no wait for the timer,
    even while another coroutine keeps the event loop busy (the loop is never idle)."""
    lm = make(tokenizer, batch_size=100, timeout=60.0, flush_when_idle=flush_when_idle)
    stop = asyncio.Event()

    async def busy():
        while not stop.is_set():
            await asyncio.sleep(0)

    async def prompted(prefix, depth):
        for _ in range(depth):
            await asyncio.sleep(0)
        return await lm.batch_next_token_logprobs([[prefix, i + 1] for i in range(5)])

    spinner = asyncio.create_task(busy())
    try:
        a, b = await asyncio.wait_for(asyncio.gather(prompted(7, 0), prompted(9, 1)), 10)
    finally:
        stop.set()
        await spinner
    for prefix, rows in ((7, a), (9, b)):
        for i, row in enumerate(rows):
            torch.testing.assert_close(row, expected([prefix, i + 1], vocab_size))
    assert lm.stats["batches"] == 1 and lm.stats["rows"] == 10


@pytest.mark.asyncio
async def test_two_models_both_flush_when_idle(tokenizer, vocab_size):
    """Each model's probe ignores the other's: neither waits for its timer."""
    first = make(tokenizer, batch_size=100, timeout=60.0)
    second = make(tokenizer, batch_size=100, timeout=60.0)

    async def particle(i):
        a = await first.next_token_logprobs([7, i + 1])
        b = await second.next_token_logprobs([8, i + 1])
        return a, b

    out = await asyncio.wait_for(asyncio.gather(*(particle(i) for i in range(9))), 10)
    for i, (a, b) in enumerate(out):
        torch.testing.assert_close(a, expected([7, i + 1], vocab_size))
        torch.testing.assert_close(b, expected([8, i + 1], vocab_size))
    assert first.stats["batches"] == second.stats["batches"] == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("flush_when_idle", [True, False])
async def test_queries_behind_a_timer_with_and_without_idle_flush(
    tokenizer, vocab_size, flush_when_idle
):
    """A query that waits on a timer (or I/O) first: with flush_when_idle the loop idles
    meanwhile, so the earlier query runs alone, and the later one too, long before the
    batch's minute-long timeout; without it, genlm's rule, both share the batch the
    timeout closes."""
    timeout = 60.0 if flush_when_idle else 0.5
    lm = make(tokenizer, batch_size=100, timeout=timeout, flush_when_idle=flush_when_idle)

    async def late():
        await asyncio.sleep(0.05)
        return await lm.next_token_logprobs([2, 2])

    start = time.perf_counter()
    early_row, late_row = await asyncio.wait_for(
        asyncio.gather(lm.next_token_logprobs([1, 1]), late()), 10
    )
    elapsed = time.perf_counter() - start
    torch.testing.assert_close(early_row, expected([1, 1], vocab_size))
    torch.testing.assert_close(late_row, expected([2, 2], vocab_size))
    if flush_when_idle:
        assert lm.stats["batches"] == 2  # (wait_for above: not after the timeout)
    else:
        assert lm.stats["batches"] == 1 and elapsed >= 0.45


@pytest.mark.asyncio
async def test_idle_flush_can_be_turned_off_on_a_live_model(tokenizer):
    lm = make(tokenizer, batch_size=100, timeout=60.0)
    lm.flush_when_idle = False
    task = asyncio.create_task(lm.next_token_logprobs([4, 4]))
    await asyncio.sleep(0.05)
    assert not task.done() and lm._queued == 1
    lm.batch_evaluate_queries()
    await task


@pytest.mark.asyncio
async def test_two_event_loops_in_turn(tokenizer, vocab_size):
    lm = make(tokenizer)

    async def ask(c):
        return await lm.next_token_logprobs(c)

    # pytest-asyncio already runs a loop here; use fresh loops in a worker thread
    def run_twice():
        return [asyncio.run(ask([5, i])) for i in (1, 2)]

    rows = await asyncio.to_thread(run_twice)
    for i, r in zip((1, 2), rows):
        torch.testing.assert_close(r, expected([5, i], vocab_size))


def test_abandoned_queries_on_a_live_loop_do_not_block_another(tokenizer, vocab_size):
    """A query whose only caller gave up (wait_for timed out) on a loop that is stopped but
    not closed must not lock the model to that loop; a query some caller still awaits does."""
    lm = make(tokenizer, batch_size=100, timeout=30.0, flush_when_idle=False)

    async def ask(c):
        return await lm.next_token_logprobs(c)

    first = asyncio.new_event_loop()
    try:
        with pytest.raises(asyncio.TimeoutError):
            first.run_until_complete(asyncio.wait_for(ask([9, 9]), 0.01))
        # the abandoned row left the queue with its caller, and its timer with it
        assert not lm._pending and lm._queued == 0 and lm._timer is None
        torch.testing.assert_close(asyncio.run(ask([9, 10])), expected([9, 10], vocab_size))
        assert lm.stats["rows"] == 1  # the abandoned row was dropped, not evaluated

        waiting = first.create_task(ask([9, 11]))
        first.run_until_complete(asyncio.sleep(0))  # queued and awaited on the first loop
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(ask([9, 12]))
        lm.batch_evaluate_queries()
        torch.testing.assert_close(first.run_until_complete(waiting), expected([9, 11], vocab_size))
    finally:
        first.close()


def test_cleanup_from_another_thread_wakes_the_waiters(tokenizer):
    """cleanup() on one thread while a caller awaits on a loop running in another thread: the
    caller hears of it at once (a thread-safe wake-up), not when the batch timer fires."""
    import threading

    lm = make(tokenizer, batch_size=100, timeout=60.0, flush_when_idle=False)
    queued, outcome = threading.Event(), {}

    async def wait_for_row():
        task = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
        await asyncio.sleep(0)
        queued.set()
        start = time.perf_counter()
        try:
            await task
        except QueriesResetError:
            outcome["after_s"] = time.perf_counter() - start

    worker = threading.Thread(target=lambda: asyncio.run(wait_for_row()), daemon=True)
    worker.start()
    assert queued.wait(30)
    time.sleep(0.1)  # the worker's loop is now blocked in its selector
    lm.cleanup()
    worker.join(20)
    assert not worker.is_alive(), "the waiter was not woken by cleanup()"
    assert outcome["after_s"] < 10


def test_threads_each_with_its_own_loop_share_one_model(tokenizer, vocab_size):
    """Several threads, each running its own event loop, query one model at once. One loop
    may have queries waiting at a time: another loop's call then either gets its row or the
    clear "another event loop" error, and is retried. No query may be lost or answered
    without waking its loop: that caller would sit until its next timer (here the 5 s
    deadline), so every call must come back well before it."""
    import sys
    import threading

    lm = make(tokenizer, batch_size=3, timeout=0.0005, flush_when_idle=False)
    errors, latencies = [], []

    def worker(seed):
        rng = random.Random(seed)

        async def one(ctx):
            while True:
                try:
                    start = time.perf_counter()
                    row = await asyncio.wait_for(lm.next_token_logprobs(ctx), 5)
                    latencies.append(time.perf_counter() - start)
                    return row
                except RuntimeError as exc:
                    if "another event loop" not in str(exc):
                        raise
                    await asyncio.sleep(rng.random() * 1e-4)

        async def run():
            for _ in range(100):
                ctxs = [
                    [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 4))]
                    for _ in range(2)
                ]
                for ctx, row in zip(ctxs, await asyncio.gather(*map(one, ctxs))):
                    torch.testing.assert_close(row, expected(ctx, vocab_size))

        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the races show up within a second
    try:
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting"
    assert not errors, errors
    assert len(latencies) == 8 * 100 * 2 and max(latencies) < 2.0, max(latencies)


def test_cleanup_waits_for_a_forward_running_in_another_thread(tokenizer, vocab_size):
    """cleanup() from one thread while another thread's forward runs: the model is released
    after that forward (whose caller gets its row), not under it; rows taken before the
    cleanup but not yet run get ModelClosedError instead of a released model."""
    import threading

    events, started, result = [], threading.Event(), {}

    class SlowMock(MockAsyncLM):
        def _forward(self, lora_name, rows):
            started.set()
            time.sleep(0.3)
            events.append("forward done")
            return super()._forward(lora_name, rows)

        def _release(self):
            events.append("released")

    lm = SlowMock(tokenizer)
    worker = threading.Thread(
        target=lambda: result.setdefault("row", lm.next_token_logprobs_sync([3, 4])), daemon=True
    )
    worker.start()
    assert started.wait(10)
    lm.cleanup()
    worker.join(10)
    assert events == ["forward done", "released"]
    torch.testing.assert_close(result["row"], expected([3, 4], vocab_size))
    with pytest.raises(ModelClosedError):
        lm._evaluate(None, [(5,)])  # what a flush that took its rows before cleanup runs
