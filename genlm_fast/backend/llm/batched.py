"""`BatchedAsyncLM`: what every concrete backend shares.

Argument checking, the LRU output cache, the public `AsyncLM` methods, and the auto-batcher
(`AutoBatcher`, ``batcher.py``, whose module docstring gives the batching rules) that gathers
concurrent requests into one model call. A backend only supplies `BatchedAsyncLM._forward`,
which maps a list of distinct contexts to a tensor of next-token logits.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
from abc import abstractmethod
from typing import NamedTuple

import torch

from genlm_fast.backend.cache import OutputCache, trim_heap
from genlm_fast.backend.llm.base import AsyncLM
from genlm_fast.backend.llm.batcher import AutoBatcher
from genlm_fast.backend.llm.checks import (
    QueriesResetError,
    check_token_ids,
    context_list,
    unknown_lora,
)

__all__ = ["BatchedAsyncLM", "Evaluated"]


class Evaluated(NamedTuple):
    """What `BatchedAsyncLM._evaluate` returns for ``n`` contexts."""

    logits: torch.Tensor  # [n, V'] on the model's device
    # [n, V'] log probabilities of ``logits`` on the model's device; None when only logits
    # were wanted and the output cache is off
    logprobs: torch.Tensor | None
    # the same log probabilities as n float32 CPU rows, each a tensor of its own that the
    # output cache also holds (hand out copies, see `BatchedAsyncLM._cached`); None when
    # ``logprobs`` is
    cpu_rows: list[torch.Tensor] | None


class BatchedAsyncLM(AutoBatcher, AsyncLM):
    """An `AsyncLM` that auto-batches concurrent requests and caches results.

    Subclasses implement `_forward` (and may override `_vocab_limit`,
    `_resolve_lora`, `_release`).

    Args:
        tokenizer: Hugging Face tokenizer.
        batch_size (int): Queries that make a batch full (each call counts, identical
            ones included), hence also the most distinct contexts per model call.
            Defaults to 20.
        timeout (float): Seconds, counted from the first waiting query, before a batch
            that is not full is evaluated anyway. Defaults to 0.02.
        cache_size (int): Rows of log probabilities kept in the LRU output cache
            (0 disables it). Defaults to 1024.
        flush_when_idle (bool): Also evaluate a batch that is not full as soon as the
            event loop has nothing else to run (see the module's batching rules).
            Defaults to True; False waits for ``batch_size`` or ``timeout`` only, as genlm.
    """

    def __init__(
        self, tokenizer, batch_size=20, timeout=0.02, cache_size=1024, flush_when_idle=True
    ):
        super().__init__(tokenizer)
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)
            or not 0 <= float(timeout) < float("inf")
        ):
            # NaN would never fire the timer: a batch that does not fill would hang
            raise ValueError(
                f"timeout must be a finite non-negative number of seconds, got {timeout!r}"
            )
        if isinstance(cache_size, bool) or not isinstance(cache_size, numbers.Integral):
            raise ValueError(f"cache_size must be an integer, got {cache_size!r}")
        self.batch_size = int(batch_size)
        self.timeout = float(timeout)
        self.cache_size = int(cache_size)
        self.flush_when_idle = bool(flush_when_idle)
        self._outputs = OutputCache(self.cache_size)
        self._pending = {}  # (lora, ids) -> _Row, in arrival order
        self._queued = 0  # queries waiting in _pending, identical ones counted each time
        self._timer = None
        self._idle_probe = None  # a loop.call_soon handle of _on_idle_probe, while one is due
        self._loop = None
        # Guards the queue (_pending, _queued, _loop, the wakeups) and the output cache:
        # several threads, each running its own event loop, may share one model.
        self._lock = threading.RLock()
        self._forward_lock = threading.Lock()  # one forward at a time (KV caches are shared)
        self._default_lora = None
        self.stats = {"batches": 0, "rows": 0, "cache_hits": 0}

    @property
    def _active_lora(self):
        """The adapter calls without ``lora_name`` use (None: the base model)."""
        return self._default_lora

    @_active_lora.setter
    def _active_lora(self, name):
        # set, cleared, or its adapter reloaded: calls without lora_name may answer otherwise
        self._default_lora = name
        self.state_epoch += 1

    # ---- to be provided by a backend ---------------------------------------------

    @abstractmethod
    def _forward(self, lora_name, rows):
        """Next-token logits for each context in ``rows`` (tuples of ints, distinct).

        Returns:
            (torch.Tensor): ``[len(rows), V']`` on the model's device.
        """

    def _vocab_limit(self):
        """Exclusive upper bound on valid token ids."""
        return len(self.byte_vocab)

    def _resolve_lora(self, lora_name):
        """Map a per-call ``lora_name`` to the adapter actually used (None = base)."""
        if lora_name is None:
            return self._active_lora
        raise unknown_lora(lora_name)

    def _release(self):
        """Drop the model's resources (called once by `cleanup`)."""

    def _size_threads(self):
        """Called before every `_forward`, in the thread that runs it: a CPU backend sizes
        torch's threads there (`genlm_fast.backend.llm.threads`)."""

    @property
    def device(self):
        return torch.device("cpu")

    # ---- evaluation ----------------------------------------------------------------

    def _check_context(self, token_ids):
        """One context as a tuple of ids, or a clear error (a backend adds its limits)."""
        return check_token_ids(token_ids, self._vocab_limit())

    def _prepare(self, token_ids, lora_name):
        self._check_open()
        lora = self._resolve_lora(lora_name)
        return lora, self._check_context(token_ids)

    def _evaluate(self, lora, rows, want_logprobs=True):
        """Run `_forward` on distinct ``rows`` in chunks of ``batch_size``.

        Returns an `Evaluated`. The CPU rows are cached even when only logits are wanted,
        so that a context asked for again (a beam re-scored, a prefix shared by particles)
        costs no forward whichever method asks.
        """
        logits = self._forward_in_chunks(lora, rows, self._forward)
        if not want_logprobs and self.cache_size <= 0:
            return Evaluated(logits, None, None)
        logprobs = torch.log_softmax(logits.float(), -1)
        return Evaluated(logits, logprobs, self._keep_rows(lora, rows, logprobs.cpu()))

    def _forward_in_chunks(self, lora, rows, forward):
        """``forward(lora, chunk)`` on ``rows`` in chunks of ``batch_size``, one forward of
        this model at a time; the ``[n, V']`` rows, concatenated."""
        parts = []
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            with self._forward_lock:
                self._check_open()  # cleanup() may have run since the rows were taken
                self._size_threads()
                out = forward(lora, chunk)
            if out.shape[0] != len(chunk):
                raise RuntimeError(
                    f"backend returned {out.shape[0]} rows for {len(chunk)} contexts"
                )
            parts.append(out)
            self.stats["batches"] += 1
            self.stats["rows"] += len(chunk)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _keep_rows(self, lora, rows, logprobs):
        """Store the log-probability rows of ``rows`` in the output cache (when it is on),
        each as a tensor of its own, so that evicting one frees its memory; returns the
        list of rows."""
        if self.cache_size <= 0:
            return list(logprobs)
        kept = [row.clone() for row in logprobs]
        with self._lock:
            for ids, row in zip(rows, kept):
                self._outputs[(lora, ids)] = row
        return kept

    def _cached(self, lora, ids):
        """The cached row of a context itself, or None. What hands a row out copies it (as
        `_flush` does): every caller gets a tensor of its own, so that editing a result in
        place (``logps[mask] = -inf``) changes neither the cache nor another caller's row."""
        with self._lock:
            hit = self._outputs.get((lora, ids))
            if hit is not None:
                self.stats["cache_hits"] += 1
        return hit

    # ---- public API ----------------------------------------------------------------

    async def next_token_logprobs(self, token_ids, lora_name=None):
        """Log probabilities of the token following ``token_ids``, auto-batched.

        Args:
            token_ids (list[int]): The context, at least one token.
            lora_name (str, optional): LoRA adapter; None uses the default (see `set_lora`).

        Returns:
            (torch.Tensor): float32 log probabilities on the CPU, shape ``[V']``.
        """
        return await self._logprobs_of(*self._prepare(token_ids, lora_name))

    async def _logprobs_of(self, lora, ids):
        """`next_token_logprobs` of a checked context (``_prepare``'s pair)."""
        hit = self._cached(lora, ids)
        if hit is not None:
            return hit.clone()
        return await self._enqueue(lora, ids, "logprobs")

    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        """Log probabilities of the token following ``token_ids``, without batching."""
        lora, ids = self._prepare(token_ids, lora_name)
        hit = self._cached(lora, ids)
        if hit is not None:
            return hit.clone()
        return self._evaluate(lora, [ids]).cpu_rows[0].clone()

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None):
        """Log probabilities for several contexts, ``[B, V']``, in as few calls as possible."""
        self._check_open()
        lora = self._resolve_lora(lora_name)
        all_ids = [
            self._check_context(t)
            for t in context_list(
                token_ids_list, "batch_next_token_logprobs_sync", allow_empty=False
            )
        ]
        found = {}
        todo = []
        for ids in all_ids:
            if ids in found:
                continue
            hit = self._cached(lora, ids)
            if hit is not None:
                found[ids] = hit
            else:
                found[ids] = None
                todo.append(ids)
        if todo:
            for ids, row in zip(todo, self._evaluate(lora, todo).cpu_rows):
                found[ids] = row
        return torch.stack([found[ids] for ids in all_ids])

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        """Log probabilities for several contexts, ``[B, V']``, via the auto-batcher."""
        self._check_open()
        token_ids_list = context_list(
            token_ids_list, "batch_next_token_logprobs", allow_empty=False
        )
        return await self._whole_batch(self._logprobs_of, token_ids_list, lora_name)

    async def next_token_logits(self, token_ids, lora_name=None):
        """Unnormalized next-token logits ``[V']`` on the model's device.

        With the output cache on, the answer is the context's log probabilities (they differ
        from the logits by a constant only) moved to the device: those go to the cache, and
        a cached context answers with them, so a context gets the same row bit for bit
        whether it was computed or found. With the cache off (``cache_size=0``), the raw
        logits.
        """
        return await self._logits_of(*self._prepare(token_ids, lora_name))

    async def _logits_of(self, lora, ids):
        """`next_token_logits` of a checked context (``_prepare``'s pair)."""
        hit = self._cached(lora, ids)
        if hit is not None:
            return hit.to(self.device, non_blocking=True, copy=True)
        return await self._enqueue(lora, ids, "logits")

    async def batch_next_token_logits(self, token_ids_list, lora_name=None):
        """Unnormalized logits ``[B, V']`` on the model's device, via the auto-batcher."""
        self._check_open()
        token_ids_list = context_list(token_ids_list, "batch_next_token_logits", allow_empty=False)
        return await self._whole_batch(self._logits_of, token_ids_list, lora_name)

    # A batch call evaluates once this many event-loop passes in a row added no query to
    # the batch (two: a caller's query arrives the pass after the task making it was
    # created), or after _JOIN_PASSES passes in all.
    _SETTLED_PASSES = 2
    _JOIN_PASSES = 8

    async def _whole_batch(self, answer, token_ids_list, lora_name):
        """A batch call hands over all its contexts at once: queue them, then evaluate
        them (with whatever else is queued) as soon as event-loop passes stop adding
        queries to the batch, instead of waiting for the timer. Batch calls made together (a
        ``gather`` of them: genlm-control's product of two prompted LMs asks both models at
        once, each particle step) so share one forward. Every context is checked first, so
        a bad one fails the call before any forward runs; a call cancelled (or failed)
        before its rows are back takes its queries with it."""
        prepared = [self._prepare(ids, lora_name) for ids in token_ids_list]
        tasks = [asyncio.ensure_future(answer(lora, ids)) for lora, ids in prepared]
        try:
            await asyncio.sleep(0)  # every task runs up to its queued future
            settled = 0
            for _ in range(self._JOIN_PASSES):
                queued = self._queued
                if not self._pending:
                    break  # evaluated already (full, idle, or by a batch call it joined)
                await asyncio.sleep(0)
                settled = settled + 1 if self._queued == queued else 0
                if settled == self._SETTLED_PASSES:
                    break
            if self._pending:
                self._flush()
            return torch.stack(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # retrieved: not logged as "never retrieved"
            raise

    def clear_cache(self):
        """Forget cached log probabilities, and give their memory back."""
        with self._lock:
            self._outputs.clear()
        self.state_epoch += 1
        trim_heap()

    def cleanup(self):
        """Fail waiting queries, drop caches and the model; later calls raise."""
        if self._closed:
            return
        self._fail_pending(QueriesResetError("query dropped because the model was cleaned up"))
        self._closed = True
        with self._lock:
            self._outputs.clear()
        with self._forward_lock:  # a forward running in another thread finishes first
            self._release()

    def __reduce_ex__(self, protocol):
        # pickle and copy.deepcopy would otherwise walk into the event loop, the locks and
        # the model, and fail on whichever comes first with a message naming none of them;
        # copy.copy would make a second model sharing this one's queue
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled or copied: it holds the model, "
            "its caches and its event-loop state. Share one model, and copy contexts "
            "(token ids) rather than the objects that hold it."
        )

    def __del__(self):
        try:
            self._cancel_wakeups()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
