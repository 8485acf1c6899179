"""Auto-batching async front ends for the tries.

Concurrent requests are queued; a background task drains the queue, groups the requests
by (operation, mode) and answers each group with one batched kernel call. What is cheap
to check (type, shape, dtype, width, operation, mode) is checked before a request is
queued, so such a malformed request raises in its own caller. If a batched call still
fails (a NaN row, found by the kernel), its requests are run again one by one, so each
caller gets its own result or its own error; the loop keeps serving later requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import torch

from genlm_fast.backend.trie.base import ParallelTokenCharacterTrie, TokenCharacterTrie
from genlm_fast.ops.dispatch import validate_values
from genlm_fast.trie_core import one_row

logger = logging.getLogger(__name__)

OPS = ("sum", "max", "log_mass")


class AutoBatcher:
    """Queue + background task turning concurrent ``(op, mode, row)`` requests into batches.

    ``run_batch(op, mode, rows)`` must return one result per row. The queue and the task
    serving it are made together and dropped together, so a request made while
    ``cleanup()`` waits for the old task starts a fresh pair and is served.
    """

    def __init__(self, run_batch):
        self._run_batch = run_batch
        self._queue = None
        self._task = None

    def start(self):
        """Start the background task on the running event loop (if not already running).
        A task left on an event loop that no longer runs is replaced; one on a loop still
        running (another thread's) is an error: asyncio's queues serve one loop."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is not loop:
            if task.get_loop().is_running():
                raise RuntimeError(
                    "this trie is serving requests on another event loop (in "
                    "another thread); use one event loop at a time"
                )
            task, queue = self._detach()
            _stop(task)
            _fail_pending(queue)
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._serve(self._queue))

    def submit(self, op, mode, row) -> asyncio.Future:
        self.start()
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, mode, row, future))
        return future

    async def _serve(self, queue):
        groups = {}
        try:
            while True:
                groups = defaultdict(list)
                op, mode, row, future = await queue.get()
                groups[(op, mode)].append((row, future))
                while not queue.empty():
                    op, mode, row, future = queue.get_nowait()
                    groups[(op, mode)].append((row, future))
                for (op, mode), group in groups.items():
                    live = [(row, fut) for row, fut in group if not fut.done()]  # cancelled
                    if live:
                        logger.debug("trie batch: %d %s request(s), mode %s", len(live), op, mode)
                        self._answer(op, mode, live)
        except (asyncio.CancelledError, GeneratorExit):
            raise  # stopped by cleanup() / shutdown(), which fail what is still queued
        except BaseException as stop:
            # a batch raised what is not an Exception (a KeyboardInterrupt) and ends this
            # task: no request it has taken, or left queued, may wait forever (the next
            # request starts a fresh queue and task)
            error = RuntimeError(f"the trie's batch was interrupted ({type(stop).__name__})")
            for group in groups.values():
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(error)
            _fail_pending(queue)
            raise

    def _answer(self, op, mode, requests):
        """Answer ``(row, future)`` requests with one batched call; if it fails, answer
        each request alone, so that a bad row fails only its own caller."""
        try:
            results = self._run_batch(op, mode, [row for row, _ in requests])
        except Exception as error:  # (anything else ends the task: see _serve)
            if len(requests) > 1:
                logger.debug(
                    "trie batch failed (%s); running its %d requests one by one",
                    error,
                    len(requests),
                )
                for request in requests:
                    self._answer(op, mode, [request])
            elif not requests[0][1].done():
                requests[0][1].set_exception(error)
            return
        for (_, fut), result in zip(requests, results):
            if not fut.done():
                fut.set_result(result)

    def _detach(self):
        """Forget the current task and queue (a later request starts new ones)."""
        task, queue = self._task, self._queue
        self._task = self._queue = None
        return task, queue

    async def cleanup(self):
        """Stop the background task and wait for it to finish; requests still queued fail."""
        task, queue = self._detach()
        try:
            if task is not None and not task.done():
                if task.get_loop() is asyncio.get_running_loop():
                    task.cancel()
                    try:
                        await task
                    except (asyncio.CancelledError, RuntimeError):
                        pass
                else:  # left on a loop gone or no longer running: nothing to wait for
                    _stop(task)
        finally:
            _fail_pending(queue)

    def shutdown(self):
        """Stop the background task without waiting (safe when the loop is gone)."""
        task, queue = self._detach()
        _stop(task)
        _fail_pending(queue)


def _stop(task):
    """Cancel ``task`` from any thread. On a closed loop (closed with the task pending) it
    can only be closed: its ``await queue.get()`` then fails to reach that loop."""
    if task is None or task.done():
        return
    loop = task.get_loop()
    if loop.is_closed():
        try:
            task.get_coro().close()
        except RuntimeError:  # 'Event loop is closed', from the queue's cleanup
            pass
        # the task can never finish now: without this asyncio logs "Task was destroyed but
        # it is pending!" when it is collected
        task._log_destroy_pending = False
        return
    try:
        if loop.is_running() and loop is not _running_loop():
            loop.call_soon_threadsafe(task.cancel)  # another thread's loop
        else:
            task.cancel()
    except RuntimeError:  # the loop closed in between
        pass


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _fail_pending(queue):
    while queue is not None and not queue.empty():
        *_, future = queue.get_nowait()
        if not future.done():
            try:
                future.set_exception(RuntimeError("trie was shut down before this request ran"))
            except RuntimeError:
                pass


class AsyncTrieFrontEnd:
    """What the async tries share: the wrapped trie, its ``AutoBatcher`` (answering with
    the subclass's ``_run_batch``), the checks made before a request is queued and the
    lifecycle methods."""

    def __init__(self, trie):
        self.trie = trie
        self._batcher = AutoBatcher(self._run_batch)

    def _submit(self, op, mode, ws) -> asyncio.Future:
        """Check ``ws`` as one row for ``op`` (one of ``OPS``, or a ``TrieOp``) and queue it
        as a tensor; a malformed request raises here, in its caller."""
        op = getattr(op, "value", op)
        if not isinstance(op, str) or op not in OPS:
            raise ValueError(f"Invalid trie operation: {op!r} (expected one of {OPS})")
        ws = one_row(ws, "expected one row of shape [V]", "await one call per row")
        batch = self.trie._as_batch(ws, None)  # [1, V]
        if op != "log_mass":
            batch = self.trie._weight_rows(batch)
        # the dispatcher's own checks (type, dtype, width), before the row joins a batch
        validate_values(
            batch,
            self.trie.layout,
            exact_width=None if op == "log_mass" else self.trie.layout.num_columns,
        )
        return self._batcher.submit(op, mode, batch[0])

    def start(self):
        self._batcher.start()

    @property
    def _task(self):
        """The background task serving the queue (genlm's attribute): None until the first
        request or `start`, and again after `cleanup` / `shutdown`."""
        return self._batcher._task

    async def cleanup(self):
        await self._batcher.cleanup()

    def shutdown(self):
        self._batcher.shutdown()

    def __del__(self):
        batcher = getattr(self, "_batcher", None)
        if batcher is not None:
            batcher.shutdown()


class AsyncTokenCharacterTrie(AsyncTrieFrontEnd):
    """Auto-batching wrapper around a ``TokenCharacterTrie``/``ParallelTokenCharacterTrie``:
    concurrent ``await trie.weight_sum(ws)`` calls are answered by one batched call."""

    @classmethod
    def from_vocab(cls, vocab, backend="parallel", **kwargs):
        """Build the trie over ``vocab``: ``backend`` is "parallel" (default) or "sequential"."""
        if backend == "parallel":
            trie = ParallelTokenCharacterTrie(decode=vocab, **kwargs)
        elif backend == "sequential":
            trie = TokenCharacterTrie(decode=vocab, **kwargs)
        else:
            raise ValueError(f"Unknown backend: {backend!r}. Must be 'sequential' or 'parallel'")
        return cls(trie)

    def _run_batch(self, op, mode, rows):
        if op == "sum":
            return self.trie.batch_weight_sum(rows)
        if op == "max":
            return self.trie.batch_weight_max(rows)
        return self.trie.batch_log_mass(torch.stack(rows))

    async def _queue_request(self, request, op):
        """genlm's low-level entry: queue ``request`` for ``op`` and return its future."""
        return self._submit(op, None, request)

    async def weight_sum(self, ws):
        """Batched ``weight_sum`` of one weight vector."""
        return await self._submit("sum", None, ws)

    async def weight_max(self, ws):
        """Batched ``weight_max`` of one weight vector."""
        return await self._submit("max", None, ws)

    async def log_mass(self, logits):
        """Batched fused ``log_mass`` of one logit row (result stays on its device)."""
        return await self._submit("log_mass", None, logits)
