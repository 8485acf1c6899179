"""The async tries against genlm-backend 0.3.1 and genlm-bytes 0.2.0 (and against the sync
tries): batching concurrent callers, errors reaching their own callers, cleanup,
interrupted batches and event loops."""

from __future__ import annotations

import contextlib
import gc
import re

import genlm.backend.trie as ref_trie
import genlm.bytes.trie as ref_bytes
import numpy as np
import pytest
import torch

from genlm_fast.backend.trie import AsyncTokenCharacterTrie
from genlm_fast.bytes import AsyncTokenByteTrie, TokenByteTrie, TrieMode
from tests.backend.trie_support import SMALL, ours, theirs


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
