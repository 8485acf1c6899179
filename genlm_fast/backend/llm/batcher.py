"""The auto-batcher: concurrent requests gathered into one model call.

`AutoBatcher` is the queue half of `BatchedAsyncLM` (``batched.py``): it owns the waiting
queries, the timer and the idle probe, and calls the model's ``_evaluate`` on a batch.

Batching rules (those of genlm.backend, except for when the clock starts, and the idle flush):
* a batch is evaluated as soon as ``batch_size`` queries wait in it (identical ones
  counted each time, as genlm counts them), or ``timeout`` seconds after the *first*
  query entered it (a steady trickle of queries therefore never postpones a batch
  indefinitely);
* and, beyond genlm (``flush_when_idle=True``, the default), as soon as the event loop has
  nothing left to run but timers and I/O: every coroutine that could still add a query
  is then waiting on something else, so the rest of the timeout would be dead time (an
  SMC step's particles all reach the model within a few loop iterations, and would
  otherwise sit out the whole timeout every step). Checked through asyncio's own loop;
  on other loops (uvloop) only the timer applies. ``flush_when_idle=False`` keeps
  genlm's rule exactly, e.g. for queries that arrive from other threads or over I/O;
* identical requests (same context, same adapter) share one row of the batch;
* a caller cancelled while waiting only loses its own answer, and leaves the queue at once
  (the batch too, when nobody else waits in it);
* an exception raised while evaluating a batch is set on every caller waiting on it;
* `reset_async_queries` fails every waiting caller with `QueriesResetError`;
* the batch belongs to one event loop at a time: threads, each running its own loop, may
  share a model, and a query from another loop while the batch has waiters raises
  `RuntimeError` (retry it). Each waiter is answered through its own loop.
"""

from __future__ import annotations

import asyncio
import functools
from typing import NamedTuple

from genlm_fast.backend.llm.checks import QueriesResetError

__all__ = ["AutoBatcher", "PendingQuery"]


class PendingQuery(NamedTuple):
    """A query waiting in the batch: its context, the future its caller awaits, and its
    adapter (None: the base model)."""

    prompt: tuple
    future: asyncio.Future
    lora_name: object


class _Row:
    """One distinct context waiting in the batch, and everybody waiting for it."""

    __slots__ = ("ids", "lora", "waiters")

    def __init__(self, lora, ids):
        self.lora = lora
        self.ids = ids
        self.waiters = []  # (future, answer): one of ANSWERS

    def live(self):
        return any(not fut.done() for fut, _ in self.waiters)

    def wants_logprobs(self):
        return any(answer == "logprobs" and not fut.done() for fut, answer in self.waiters)


# What a waiter gets from its row of the batch:
# * "logprobs": the CPU log-probability row (`next_token_logprobs`);
# * "logits": those log probabilities on the model's device whenever the batch computed
#   them (always with the output cache on; a later cache hit is answered with the cached
#   row moved there: the same bits), else the raw logits (`next_token_logits`);
# * "raw": the raw logits on the device (genlm's ``add_query`` protocol).
ANSWERS = ("logprobs", "logits", "raw")


# An idle probe inspects the loop's ready callbacks only when there are at most this many:
# more means work is queued (other models' probes are one handle each).
_IDLE_SCAN_LIMIT = 8


def _is_idle_probe(handle):
    return getattr(getattr(handle, "_callback", None), "__func__", None) is (
        AutoBatcher._on_idle_probe
    )


def _settle_if_pending(fut, value, is_error):
    if not fut.done():
        if is_error:
            fut.set_exception(value)
        else:
            fut.set_result(value)


def _settle(fut, value, is_error=False, here=None):
    """Set a waiter's result (or exception) from any thread.

    A future of a loop running in another thread must be settled through that loop:
    set directly, it would not wake the loop, and its caller would wait forever.
    """
    loop = fut.get_loop()
    if fut.done() or loop.is_closed():
        return
    if loop is not here and loop.is_running():
        loop.call_soon_threadsafe(_settle_if_pending, fut, value, is_error)
    else:
        _settle_if_pending(fut, value, is_error)


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class AutoBatcher:
    """The waiting queries of a `BatchedAsyncLM` and when they are evaluated.

    The host class sets up the queue's state in its constructor (``_pending``,
    ``_queued``, ``_timer``, ``_idle_probe``, ``_loop``, ``_lock``) and supplies
    ``_evaluate(lora, rows, want_logprobs)`` (returning an `Evaluated`) and ``_check_open()``.
    """

    def _enqueue(self, lora, ids, answer, future=None):
        """Queue one query for an ``answer`` of the kind named (see `ANSWERS`); returns the
        future it goes to (``future``, a future of the running loop, when given, else a
        new one)."""
        if answer not in ANSWERS:
            raise ValueError(f"unknown answer kind {answer!r}; expected one of {ANSWERS}")
        loop = asyncio.get_running_loop()
        if future is not None and future.get_loop() is not loop:
            raise ValueError(
                "the query's future belongs to another event loop than the "
                "running one; create it with loop.create_future()"
            )
        with self._lock:
            if self._pending and self._loop is not loop:
                if (
                    self._loop is not None
                    and not self._loop.is_closed()
                    and any(row.live() for row in self._pending.values())
                ):
                    raise RuntimeError(
                        f"this {type(self).__name__} has queries pending on another "
                        "event loop; use one event loop at a time"
                    )
                # Left over from a closed loop, or every caller there gave up: nobody is
                # waiting for those any more.
                self._cancel_wakeups()
                self._pending = {}
                self._queued = 0
            self._loop = loop
            fut = loop.create_future() if future is None else future
            key = (lora, ids)
            row = self._pending.get(key)
            if row is None:
                row = self._pending[key] = _Row(lora, ids)
            row.waiters.append((fut, answer))
            self._queued += 1
            fut.add_done_callback(functools.partial(self._on_waiter_done, key, row))
            full = self._queued >= self.batch_size
            if not full:
                if self._timer is None:
                    self._timer = loop.call_later(self.timeout, self._on_timer)
                if self.flush_when_idle and self._idle_probe is None:
                    self._idle_probe = loop.call_soon(self._on_idle_probe)
        if full:
            self._flush()
        return fut

    def _on_waiter_done(self, key, row, fut):
        """A waiter cancelled before its batch ran leaves the queue at once (and the batch
        with it when nobody else waits in it), so that nothing stays queued for it."""
        if not fut.cancelled():
            return
        with self._lock:
            if self._pending.get(key) is not row:
                return  # its batch was taken already
            kept = [(f, answer) for f, answer in row.waiters if f is not fut]
            if len(kept) == len(row.waiters):
                return
            row.waiters = kept
            self._queued -= 1
            if not kept:
                del self._pending[key]
            if not self._pending:
                self._cancel_wakeups()
                self._queued = 0

    def _on_timer(self):
        with self._lock:
            if self._loop is not _running_loop():
                return  # a stale wakeup: another loop's queries replaced this one's
            self._timer = None
        self._flush()

    def _on_idle_probe(self):
        """Flush if the loop has nothing else to run; else look again next iteration.

        asyncio runs, per iteration, the callbacks that were ready when it began; anything
        scheduled meanwhile (a task woken up, a task's next step) lands in ``loop._ready``.
        So when this probe finds ``_ready`` empty, or holding only other models' probes,
        no coroutine can run before the loop blocks on timers and I/O.
        """
        loop = _running_loop()
        with self._lock:
            if self._loop is not loop:
                return  # a stale wakeup: another loop's queries replaced this one's
            self._idle_probe = None
            if not self._pending or not self.flush_when_idle:
                return
            ready = getattr(loop, "_ready", None)  # asyncio's deque of ready handles
            if ready is None:
                return  # another loop implementation: the timer decides
            if len(ready) > _IDLE_SCAN_LIMIT or not all(
                handle.cancelled() or _is_idle_probe(handle) for handle in ready
            ):
                self._idle_probe = loop.call_soon(self._on_idle_probe)
                return
        self._flush()

    def _cancel_wakeups(self):
        for handle in (self._timer, self._idle_probe):
            if handle is not None:
                handle.cancel()
        self._timer = self._idle_probe = None

    def _flush(self):
        """Evaluate everything waiting, one model call per adapter (per chunk)."""
        with self._lock:
            self._cancel_wakeups()
            rows, self._pending, self._queued = self._pending, {}, 0
        here = _running_loop()
        groups = {}
        for row in rows.values():
            if row.live():  # rows whose callers all gave up are skipped
                groups.setdefault(row.lora, []).append(row)
        fatal = None
        for lora, group in groups.items():
            try:
                want = any(r.wants_logprobs() for r in group)
                out = self._evaluate(lora, [r.ids for r in group], want)
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                err = exc
                if not isinstance(exc, Exception):
                    err = RuntimeError(f"batch evaluation was interrupted: {exc!r}")
                    err.__cause__ = exc
                    fatal = exc
                for r in group:
                    for fut, _ in r.waiters:
                        _settle(fut, err, True, here)
                continue
            for i, r in enumerate(group):
                for fut, answer in r.waiters:
                    if fut.done():
                        continue
                    if answer == "logprobs":
                        value = out.cpu_rows[i].clone()
                    elif answer == "logits" and out.logprobs is not None:
                        value = out.logprobs[i].clone()
                    else:
                        value = out.logits[i].clone()
                    _settle(fut, value, False, here)
        if fatal is not None:
            raise fatal

    def batch_evaluate_queries(self):
        """Evaluate every waiting query now, without waiting for the batch to fill."""
        self._check_open()
        self._flush()

    def _fail_pending(self, exc):
        with self._lock:
            self._cancel_wakeups()
            rows, self._pending, self._queued = self._pending, {}, 0
        here = _running_loop()
        for row in rows.values():
            for fut, _ in row.waiters:
                _settle(fut, exc, True, here)

    @property
    def queries(self):
        """The queries waiting for the next batch, one `PendingQuery` per caller (genlm's
        ``queries`` list; identical contexts share one row of the batch)."""
        with self._lock:
            return [
                PendingQuery(row.ids, fut, row.lora)
                for row in self._pending.values()
                for fut, _ in row.waiters
            ]

    @queries.setter
    def queries(self, value):
        # genlm code empties the queue by assigning []; any caller still waiting is told
        # (QueriesResetError), as by reset_async_queries
        if len(value):
            raise ValueError(
                "queries can only be emptied (assign []); queue queries with "
                "next_token_logprobs or add_query"
            )
        self.reset_async_queries()

    def reset_async_queries(self):
        """Drop every waiting query; its caller gets `QueriesResetError`.

        Use it when an exception stopped an inference algorithm midway.
        """
        self._fail_pending(
            QueriesResetError("query dropped by reset_async_queries() before it was evaluated")
        )
