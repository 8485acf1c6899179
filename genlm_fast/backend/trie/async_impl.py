"""Auto-batching async front ends for the tries.

Concurrent requests are queued; a background task drains the queue, groups the requests
by (operation, mode) and answers each group with one batched kernel call. A request is
validated before it is queued, so a malformed one fails alone; an exception raised by a
batched call reaches every caller in that group, and the loop keeps serving later ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from genlm_fast.backend.trie.base import ParallelTokenCharacterTrie, TokenCharacterTrie

logger = logging.getLogger(__name__)


class AutoBatcher:
    """Queue + background task turning concurrent ``(op, mode, row)`` requests into batches.

    ``run_batch(op, mode, rows)`` must return one result per row.
    """

    def __init__(self, run_batch):
        self._run_batch = run_batch
        self._queue = None
        self._task = None

    def start(self):
        """Start the background task on the running event loop (if not already running)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._serve())

    def submit(self, op, mode, row) -> asyncio.Future:
        self.start()
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, mode, row, future))
        return future

    async def _serve(self):
        while True:
            groups = defaultdict(list)
            op, mode, row, future = await self._queue.get()
            groups[(op, mode)].append((row, future))
            while not self._queue.empty():
                op, mode, row, future = self._queue.get_nowait()
                groups[(op, mode)].append((row, future))
            for (op, mode), group in groups.items():
                live = [(row, fut) for row, fut in group if not fut.done()]  # skip cancelled
                if not live:
                    continue
                logger.debug("trie batch: %d %s request(s), mode %s", len(live), op, mode)
                try:
                    results = self._run_batch(op, mode, [row for row, _ in live])
                except Exception as error:  # every waiter of the group hears about it
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(error)
                    continue
                for (_, fut), result in zip(live, results):
                    if not fut.done():
                        fut.set_result(result)

    async def cleanup(self):
        """Stop the background task and wait for it to finish."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, RuntimeError):
                pass
        self._fail_pending()

    def shutdown(self):
        """Stop the background task without waiting (safe when the loop is gone)."""
        task, self._task = self._task, None
        if task is not None:
            try:
                task.cancel()
            except RuntimeError:
                pass
        self._fail_pending()

    def _fail_pending(self):
        queue, self._queue = self._queue, None
        while queue is not None and not queue.empty():
            *_, future = queue.get_nowait()
            if not future.done():
                try:
                    future.set_exception(RuntimeError("trie was shut down before this request ran"))
                except RuntimeError:
                    pass


class AsyncTrieFrontEnd:
    """What the async tries share: the wrapped trie, its ``AutoBatcher`` (answering with
    the subclass's ``_run_batch``), the up-front width check and the lifecycle methods."""

    def __init__(self, trie):
        self.trie = trie
        self._batcher = AutoBatcher(self._run_batch)

    def _check(self, ws):
        width = ws.shape[-1] if hasattr(ws, "shape") else len(ws)
        if width != self.trie.vocab_size:
            raise ValueError(f"expected a weight vector of length {self.trie.vocab_size}, "
                             f"got {width}")

    def start(self):
        self._batcher.start()

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
        if op == "log_mass":
            return self.trie.batch_log_mass(_stack(rows))
        raise ValueError(f"Invalid trie operation: {op!r} (expected 'sum', 'max' or 'log_mass')")

    async def _queue_request(self, request, op):
        """genlm's low-level entry: queue ``request`` for ``op`` and return its future."""
        return self._batcher.submit(op, None, request)

    async def weight_sum(self, ws):
        """Batched ``weight_sum`` of one weight vector."""
        self._check(ws)
        return await self._batcher.submit("sum", None, ws)

    async def weight_max(self, ws):
        """Batched ``weight_max`` of one weight vector."""
        self._check(ws)
        return await self._batcher.submit("max", None, ws)

    async def log_mass(self, logits):
        """Batched fused ``log_mass`` of one logit row (result stays on its device)."""
        return await self._batcher.submit("log_mass", None, logits)


def _stack(rows):
    import torch

    return torch.stack([torch.as_tensor(r) for r in rows])
