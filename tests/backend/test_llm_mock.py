"""Auto-batching, caching and error handling of the LM backends, driven by MockAsyncLM.

The mock runs through exactly the batcher and caches AsyncTransformer uses; every row
is checked against an independent computation of the mock's distribution.
"""

import asyncio
import functools
import random
import time

import numpy as np
import pytest
import torch

from bench.vocabs import gpt2_tokenizer
from genlm_fast.backend.cache import KVTrie, OutputCache
from genlm_fast.backend.llm import (
    AsyncVirtualLM,
    MockAsyncLM,
    ModelClosedError,
    QueriesResetError,
    UnknownLoraError,
    load_model_by_name,
)
from tests.backend.ownership import check_callers_own_their_rows


@pytest.fixture(scope="module")
def tokenizer():
    return gpt2_tokenizer()


@pytest.fixture(autouse=True)
def _decode_once(monkeypatch):
    """Decode the vocabulary once per tokenizer: the tests build many fresh models."""
    from genlm_fast.backend.llm import base

    monkeypatch.setattr(base, "decode_vocab", _memo_decode_vocab)


_DECODED = {}


def _memo_decode_vocab(tok):
    from genlm_fast.backend.tokenization import decode_vocab

    if id(tok) not in _DECODED:
        _DECODED[id(tok)] = (tok, decode_vocab(tok))
    return _DECODED[id(tok)][1]


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return len(MockAsyncLM(tokenizer).byte_vocab)


def make(tokenizer, **kw):
    return MockAsyncLM(tokenizer, **kw)


def expected(ctx, vocab_size):
    """The mock's distribution, computed without the library."""
    return _expected(tuple(int(t) for t in ctx), vocab_size)


@functools.lru_cache(maxsize=4096)
def _expected(ctx, vocab_size):
    seed = sum((i + 1) * t for i, t in enumerate(ctx)) % 2**32
    scores = np.random.RandomState(seed).rand(vocab_size).astype(np.float32)
    return torch.log_softmax(torch.from_numpy(scores), dim=-1)


def random_contexts(rng, n, vocab_size, dup_every=5):
    ctxs = []
    for i in range(n):
        if ctxs and i % dup_every == 0:
            ctxs.append(list(rng.choice(ctxs)))  # duplicates of earlier requests
        else:
            ctxs.append([rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))])
    return ctxs


# ---------------------------------------------------------------------------- basics


def test_matches_genlm_mock(tokenizer, vocab_size):
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    assert len(ours.byte_vocab) == len(theirs.byte_vocab)
    assert ours.str_vocab == theirs.str_vocab
    assert [bytes(t) for t in ours.byte_vocab] == [bytes(t) for t in theirs.byte_vocab]
    for ctx in ([], [1], [5, 6, 7], [50000, 3, 17, 256]):  # genlm's mock answers [] too
        a = ours.next_token_logprobs_sync(ctx)
        assert a.dtype == torch.float32 and a.shape == (vocab_size,)
        torch.testing.assert_close(a, theirs.next_token_logprobs_sync(ctx), rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_genlm_control_over_the_mock(tokenizer):
    """genlm-control's PromptedLLM starts from an empty prompt: over our mock it gives
    what it gives over genlm's."""
    import genlm.backend.llm as genlm_llm
    from genlm.control import PromptedLLM

    ours, theirs = PromptedLLM(make(tokenizer)), PromptedLLM(genlm_llm.MockAsyncLM(tokenizer))
    context = [ours.vocab[100], ours.vocab[200]]
    assert await ours.prefix(context) == pytest.approx(await theirs.prefix(context), abs=1e-5)
    a, b = await ours.logw_next([]), await theirs.logw_next([])
    np.testing.assert_allclose(a.weights, b.weights, rtol=0, atol=1e-5)


@pytest.mark.asyncio
async def test_sample_matches_genlm(tokenizer):
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    prompts = [[10, 20, 30], [7], [400, 401]]
    a = await ours.batch_sample(prompts, max_tokens=6, eos_token_ids=[50256], seed=3)
    b = await theirs.batch_sample(prompts, max_tokens=6, eos_token_ids=[50256], seed=3)
    assert a == b
    want = await theirs.sample([10, 20, 30], 6, [50256], temperature=0.5, seed=9)
    # genlm takes any number torch can divide by, a zero-dimensional tensor included
    for t in (0.5, np.float64(0.5), torch.tensor(0.5), np.array(0.5)):
        assert await ours.sample([10, 20, 30], 6, [50256], temperature=t, seed=9) == want
    # an EOS draw stops sampling and is not returned
    first = a[0][0]
    assert await ours.sample([10, 20, 30], 6, [first], seed=3) == []


@pytest.mark.asyncio
async def test_sample_accepts_every_context_form(tokenizer):
    """next_token_logprobs accepts a context as a torch tensor or numpy array; so do sample
    and batch_sample (a tensor is one context, not a list of 0-d tensors). The draws
    are genlm's on the same context as a list."""
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    prompt = [10, 20, 30]
    want = await theirs.sample(prompt, 5, [50256], seed=4)
    forms = [
        torch.tensor(prompt),
        torch.tensor(prompt, dtype=torch.int32),
        np.array(prompt),
        tuple(prompt),
    ]
    for form in forms:
        assert await ours.sample(form, 5, [50256], seed=4) == want
    assert await ours.batch_sample(forms, 5, [50256], seed=4) == [want] * len(forms)


@pytest.mark.asyncio
async def test_logits_hook(tokenizer, vocab_size):
    lm = make(tokenizer)
    ctxs = [[1, 2], [3], [1, 2]]
    logits = await lm.batch_next_token_logits(ctxs)
    assert logits.shape == (3, vocab_size) and logits.device == lm.device
    for ctx, row in zip(ctxs, logits):
        torch.testing.assert_close(torch.log_softmax(row, -1), expected(ctx, vocab_size))
    # a cached context answers with its log-probabilities (same up to a constant)
    await lm.next_token_logprobs([9, 9])
    row = await lm.next_token_logits([9, 9])
    torch.testing.assert_close(torch.log_softmax(row, -1), expected([9, 9], vocab_size))
    assert lm.stats["rows"] == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("cache_size", [0, 16])
async def test_logits_calls_fill_the_output_cache(tokenizer, vocab_size, cache_size):
    """A context first asked for its logits is not run again when asked again, through
    either method (unless the cache is off), and gets the same row either way."""
    lm = make(tokenizer, cache_size=cache_size)
    for ctx in ([4, 5], [6]):
        first = await lm.next_token_logits(ctx)
        again = await lm.next_token_logits(ctx)
        logprobs = await lm.next_token_logprobs(ctx)
        # computed or found in the cache, a context's row is the same bit for bit
        assert torch.equal(first, again)
        if cache_size:
            assert torch.equal(first.cpu(), logprobs)
        torch.testing.assert_close(torch.log_softmax(first, -1), expected(ctx, vocab_size))
        torch.testing.assert_close(torch.log_softmax(again, -1), expected(ctx, vocab_size))
        torch.testing.assert_close(logprobs, expected(ctx, vocab_size))
    sync = lm.batch_next_token_logprobs_sync([[4, 5], [6]])
    torch.testing.assert_close(sync[1], expected([6], vocab_size))
    assert lm.stats["rows"] == (2 if cache_size else 8)


@pytest.mark.asyncio
async def test_callers_own_their_rows(tokenizer, vocab_size):
    lm = make(tokenizer)
    await check_callers_own_their_rows(lm, [5, 6, 7])
    assert torch.equal(await lm.next_token_logprobs([5, 6, 7]), expected([5, 6, 7], vocab_size))


def test_sync_batch(tokenizer, vocab_size):
    lm = make(tokenizer, batch_size=4)
    ctxs = [[i, i + 1] for i in range(10)] + [[0, 1]]
    out = lm.batch_next_token_logprobs_sync(ctxs)
    assert out.shape == (11, vocab_size)
    for ctx, row in zip(ctxs, out):
        torch.testing.assert_close(row, expected(ctx, vocab_size))
    assert lm.stats["rows"] == 10 and lm.stats["batches"] == 3
    out2 = lm.batch_next_token_logprobs_sync(ctxs)  # all from the output cache
    assert lm.stats["rows"] == 10
    torch.testing.assert_close(out, out2)


# ---------------------------------------------------------------------------- batching


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


# ---------------------------------------------------------------------------- errors


@pytest.mark.asyncio
async def test_bad_contexts(tokenizer, vocab_size):
    lm = make(tokenizer)
    with pytest.raises(ValueError, match="vocabulary"):
        await lm.next_token_logprobs([1, vocab_size])
    with pytest.raises(ValueError, match="vocabulary"):
        lm.next_token_logprobs_sync([-1])
    with pytest.raises(ValueError, match="vocabulary"):
        await lm.batch_next_token_logprobs([[1], [vocab_size + 5]])
    for bad in (
        "hello",
        [1.5, 2],
        [[1, 2]],
        [True, 1],
        None,
        3,
        [1, "2"],
        [torch.tensor(1.0)],
        [torch.tensor(True)],
        [torch.tensor([1])],
        [np.array(2.0)],
        [np.bool_(True)],
    ):
        with pytest.raises(TypeError, match="token_ids"):
            await lm.next_token_logprobs(bad)
        with pytest.raises(TypeError, match="token_ids"):
            lm.next_token_logprobs_sync(bad)
    with pytest.raises(TypeError):
        await lm.next_token_logprobs(torch.tensor([1.0, 2.0]))
    for call in (lm.batch_next_token_logprobs, lm.batch_next_token_logits):
        # no contexts, no rows to stack (genlm: torch's "stack expects a non-empty TensorList")
        with pytest.raises(ValueError, match=f"{call.__name__} needs at least one context"):
            await call([])
    with pytest.raises(ValueError, match="needs at least one context"):
        lm.batch_next_token_logprobs_sync(iter([]))
    for bad in (None, 3, "hello"):  # batch calls: a list of contexts (None was an empty batch)
        for call in (lm.batch_next_token_logprobs, lm.batch_next_token_logits):
            with pytest.raises(TypeError, match="list of token_ids contexts"):
                await call(bad)
        with pytest.raises(TypeError, match="list of token_ids contexts"):
            lm.batch_next_token_logprobs_sync(bad)
        with pytest.raises(TypeError, match="list of token_ids contexts"):
            await lm.batch_sample(bad, 2, [0])
    for bad in (
        0,
        0.0,
        -1.0,
        float("inf"),
        float("nan"),
        None,
        True,
        "1",
        torch.tensor([0.5, 0.5]),
        torch.tensor(float("nan")),
    ):
        # 0 divided by zero (torch's 'probability tensor contains inf'), -1 sampled from
        # the inverted distribution
        with pytest.raises(ValueError, match="temperature must be a positive"):
            await lm.sample([1, 2], 3, [0], temperature=bad)
        with pytest.raises(ValueError, match="temperature must be a positive"):
            await lm.batch_sample([[1, 2]], 3, [0], temperature=bad)
    for kwargs, error, message in [
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
        ({"max_tokens": "3"}, TypeError, "max_tokens must be an int"),
        ({"eos_token_ids": None}, TypeError, "eos_token_ids must be a collection"),
        ({"eos_token_ids": 5}, TypeError, "eos_token_ids must be a collection"),
        ({"eos_token_ids": [1.5]}, TypeError, "eos_token_ids must hold ints"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": "7"}, TypeError, "seed must be an int"),
        ({"seed": 2**70}, ValueError, "seed must lie in"),
    ]:
        args = {"max_tokens": 3, "eos_token_ids": [0], **kwargs}
        with pytest.raises(error, match=message):
            await lm.sample([1, 2], **args)
        with pytest.raises(error, match=message):
            await lm.batch_sample([[1, 2]], **args)
    # numpy integers, tensors and one-pass iterables are fine, and mean what lists do
    want = await lm.sample([1, 2], 4, [7, 9], seed=5)
    assert await lm.sample([1, 2], np.int64(4), np.array([7, 9]), seed=np.int64(5)) == want
    assert await lm.batch_sample([[1, 2], [1, 2]], 4, iter([7, 9]), seed=5) == [want] * 2
    assert await lm.sample([1, 2], 4, torch.tensor([7, 9]), seed=5) == want
    # integer arrays and tensors are fine, and equal to lists
    a = await lm.next_token_logprobs(np.array([4, 5], dtype=np.int64))
    b = await lm.next_token_logprobs(torch.tensor([4, 5]))
    c = await lm.next_token_logprobs((np.int32(4), 5))
    # items that are 0-d integer tensors or arrays, as ctx + [logps.argmax()] makes them
    d = await lm.next_token_logprobs([torch.tensor(4), torch.tensor(5, dtype=torch.int32)])
    e = lm.next_token_logprobs_sync([np.array(4), 5])
    for r in (a, b, c, d, e):
        torch.testing.assert_close(r, expected([4, 5], vocab_size))
    with pytest.raises(UnknownLoraError):
        await lm.next_token_logprobs([1], lora_name="nope")
    with pytest.raises(ValueError):  # UnknownLoraError is a ValueError, as in genlm
        lm.next_token_logprobs_sync([1], lora_name="nope")
    assert not lm._pending


@pytest.mark.asyncio
async def test_cleanup_then_any_call_raises(tokenizer):
    lm = make(tokenizer, batch_size=100, timeout=30.0)
    waiting = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0)
    lm.cleanup()
    with pytest.raises(QueriesResetError):
        await asyncio.wait_for(waiting, 5)
    lm.cleanup()  # idempotent
    with pytest.raises(ModelClosedError):
        await lm.next_token_logprobs([1])
    with pytest.raises(ModelClosedError):
        lm.next_token_logprobs_sync([1])
    with pytest.raises(ModelClosedError):
        await lm.batch_next_token_logprobs([[1]])
    with pytest.raises(ModelClosedError):
        lm.batch_next_token_logprobs_sync([[1]])
    with pytest.raises(ModelClosedError):
        await lm.next_token_logits([1])
    with pytest.raises(ModelClosedError):
        await lm.sample([1], 3, [0])
    with pytest.raises(ModelClosedError), lm:
        pass


@pytest.mark.asyncio
async def test_context_managers(tokenizer):
    with make(tokenizer) as lm:
        lm.next_token_logprobs_sync([1])
    with pytest.raises(ModelClosedError):
        lm.next_token_logprobs_sync([1])
    async with make(tokenizer) as lm2:
        await lm2.next_token_logprobs([1])
    with pytest.raises(ModelClosedError):
        await lm2.next_token_logprobs([1])


def test_pickling_or_copying_names_the_model(tokenizer):
    import copy
    import pickle

    lm = make(tokenizer)
    lm.next_token_logprobs_sync([1])
    holder = {"particle": [1, 2], "model": lm}  # what an app's state may look like
    for attempt in (
        lambda: pickle.dumps(lm),
        lambda: copy.deepcopy(lm),
        lambda: copy.copy(lm),
        lambda: copy.deepcopy(holder),
        lambda: pickle.dumps(holder),
    ):
        with pytest.raises(TypeError, match="MockAsyncLM cannot be pickled or copied"):
            attempt()
    assert copy.copy(holder)["model"] is lm  # a shallow copy shares the model, as ever


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"batch_size": "3"}, "batch_size must be a positive integer"),
        ({"batch_size": True}, "batch_size must be a positive integer"),
        ({"timeout": -1}, "timeout must be a finite non-negative"),
        ({"timeout": float("nan")}, "timeout must be a finite non-negative"),
        ({"timeout": float("inf")}, "timeout must be a finite non-negative"),
        ({"timeout": None}, "timeout must be a finite non-negative"),
        ({"timeout": "0.1"}, "timeout must be a finite non-negative"),
        ({"cache_size": 1.5}, "cache_size must be an integer"),
    ],
)
def test_constructor_checks(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MockAsyncLM(tokenizer, **kwargs)


def test_constructor_accepts_numpy_numbers(tokenizer, vocab_size):
    lm = MockAsyncLM(
        tokenizer, batch_size=np.int64(4), timeout=np.float32(0.01), cache_size=np.int32(8)
    )
    assert (lm.batch_size, lm.timeout, lm.cache_size) == (4, pytest.approx(0.01), 8)
    torch.testing.assert_close(lm.next_token_logprobs_sync([3]), expected([3], vocab_size))


def test_load_model_by_name(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    lm = load_model_by_name(str(tmp_path), backend="mock")
    assert isinstance(lm, MockAsyncLM) and len(lm.byte_vocab) == len(tokenizer)
    # ImportError, as genlm raises where MLX / SGLang are not installed (so an app's
    # fallback runs), and NotImplementedError
    for backend in ("mlx", "sgl"):
        for error in (ImportError, NotImplementedError):
            with pytest.raises(error, match="genlm_fast does not support"):
                load_model_by_name("gpt2", backend=backend)
    # genlm's class names import (genlm-control does `from genlm.backend.llm import
    # AsyncMlxLM` for backend="mlx"), and using them says why they cannot be used
    from genlm_fast.backend.llm import AsyncMlxLM, AsyncSGLTransformer

    for cls in (AsyncMlxLM, AsyncSGLTransformer):
        with pytest.raises(ImportError, match="genlm_fast does not support"):
            cls.from_name("gpt2")
        with pytest.raises(NotImplementedError, match="genlm_fast does not support"):
            cls()
    with pytest.raises(ValueError, match="Invalid backend"):
        load_model_by_name("gpt2", backend="tpu")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="vllm is not installed"):
            load_model_by_name("gpt2", backend="vllm")
        with pytest.raises(ImportError, match="vllm is not installed"):
            AsyncVirtualLM.from_name("gpt2")
        with pytest.raises(ImportError, match="vllm is not installed"):
            AsyncVirtualLM(llm=None)


def test_lazy_backend_exports():
    import subprocess
    import sys

    code = (
        "import sys, genlm_fast.backend as b; assert 'torch' not in sys.modules; "
        "assert b.load_model_by_name and b.AsyncLM and b.MockAsyncLM and b.AsyncTransformer; "
        "assert b.AsyncVirtualLM.__name__ == 'AsyncVirtualLM'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- caches


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
