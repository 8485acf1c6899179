"""The `AsyncLM` interface, the shared auto-batching machinery, and `MockAsyncLM`.

`AsyncLM` is the genlm.backend interface. `BatchedAsyncLM` adds everything a concrete
backend shares: argument checking, the LRU output cache, and the auto-batcher that
gathers concurrent requests into one model call. A backend only supplies
`BatchedAsyncLM._forward`, which maps a list of distinct contexts to a tensor of
next-token logits.

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
* a caller cancelled while waiting only loses its own answer;
* an exception raised while evaluating a batch is set on every caller waiting on it;
* `reset_async_queries` fails every waiting caller with `QueriesResetError`;
* the batch belongs to one event loop at a time: threads, each running its own loop, may
  share a model, and a query from another loop while the batch has waiters raises
  `RuntimeError` (retry it). Each waiter is answered through its own loop.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable

import numpy as np
import torch

from genlm_fast.backend.cache import OutputCache
from genlm_fast.backend.tokenization import decode_vocab

__all__ = [
    "AsyncLM",
    "BatchedAsyncLM",
    "MockAsyncLM",
    "ModelClosedError",
    "QueriesResetError",
    "UnknownLoraError",
]


def context_list(token_ids_list, method: str, allow_empty: bool = True) -> list:
    """A batch call's contexts as a list (each one checked later, by ``check_token_ids``);
    ``allow_empty=False`` for the calls that stack one row per context (no rows, no width)."""
    if token_ids_list is not None and not isinstance(token_ids_list, (str, bytes, bytearray)):
        try:
            contexts = list(token_ids_list)
        except TypeError:  # not iterable
            pass
        else:
            if not contexts and not allow_empty:
                raise ValueError(f"{method} needs at least one context, got an empty list")
            return contexts
    raise TypeError(f"{method} expects a list of token_ids contexts, got "
                    f"{type(token_ids_list).__name__}")


def check_temperature(temperature) -> float:
    """A sampling temperature: a positive finite number (0 would divide by zero, a negative
    one would invert the distribution). A zero-dimensional tensor or array counts as its
    number."""
    if isinstance(temperature, (torch.Tensor, np.ndarray)) and temperature.ndim == 0:
        temperature = temperature.item()
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not 0 < float(temperature) < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return float(temperature)


def check_sampling(max_tokens, eos_token_ids, seed):
    """`sample`'s other arguments, checked: (max_tokens as an int, the EOS ids as a set,
    seed as an int or None), or a clear error naming the argument."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise TypeError(f"max_tokens must be an int, got {max_tokens!r}")
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(
            eos_token_ids, (Iterable, torch.Tensor, np.ndarray)):
        raise TypeError("eos_token_ids must be a collection of token ids (possibly empty), "
                        f"got {eos_token_ids!r}")
    eos = set()
    for t in (eos_token_ids.tolist() if isinstance(eos_token_ids, (torch.Tensor, np.ndarray))
              else eos_token_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"eos_token_ids must hold ints, found {t!r}")
        eos.add(int(t))
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if not -(2**63) <= int(seed) < 2**64:
            raise ValueError(f"seed must lie in [-2**63, 2**64), got {seed}")
        seed = int(seed)
    return int(max_tokens), eos, seed


class ModelClosedError(RuntimeError):
    """The model was used after `AsyncLM.cleanup` released it."""


class QueriesResetError(RuntimeError):
    """A waiting query was dropped, by `reset_async_queries` or by `cleanup`."""


class UnknownLoraError(ValueError):
    """A LoRA adapter name that was never loaded (or was removed)."""


def unknown_lora(name):
    return UnknownLoraError(
        f"unknown LoRA adapter {name!r}: load it first with add_new_lora(path, {name!r})"
    )


def _is_integer_dtype(dtype) -> bool:
    """An integer dtype of torch or numpy (bool is not one)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return np.issubdtype(dtype, np.integer)


def check_token_ids(token_ids, vocab_size=None, allow_empty=False):
    """Validate a context and return it as a tuple of Python ints.

    Accepts any 1-D sequence of integers (list, tuple, numpy array, integer tensor), whose
    items may also be numpy integers or 0-d integer tensors (``ctx + [logps.argmax()]``).

    Raises:
        TypeError: ``token_ids`` is not a sequence of integers.
        ValueError: it is empty (unless ``allow_empty``), or holds an id outside
            ``[0, vocab_size)``.
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}; "
            "tokenize text first (tokenizer.encode)"
        )
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        if token_ids.ndim != 1:
            raise TypeError(
                f"token_ids must be one-dimensional, got shape {tuple(token_ids.shape)}"
            )
        if not _is_integer_dtype(token_ids.dtype):
            raise TypeError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        ids = tuple(int(t) for t in token_ids.tolist())
    else:
        try:
            items = list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            ) from None
        for t in items:
            if type(t) is int:
                continue
            if isinstance(t, (torch.Tensor, np.ndarray)):
                if t.ndim == 0 and _is_integer_dtype(t.dtype):
                    continue
            elif not isinstance(t, bool) and isinstance(t, numbers.Integral):
                continue
            raise TypeError(
                f"token_ids must be a sequence of ints; found {t!r} ({type(t).__name__})"
            )
        ids = tuple(int(t) for t in items)
    if not ids and not allow_empty:
        raise ValueError("Token ids must not be empty")
    if vocab_size is not None and ids:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
            )
    return ids


class AsyncLM(ABC):
    """Asynchronous next-token distributions from a language model.

    Args:
        tokenizer: The Hugging Face tokenizer of the model; its vocabulary is decoded
            into ``byte_vocab`` (bytes of each token) and ``str_vocab``.
    """

    #: Moves whenever calls without ``lora_name`` may start giving other answers (the
    #: default adapter was set, cleared, reloaded or removed; clear_cache()). Whoever keeps
    #: results across calls, such as the byte-level beam, keys them on it.
    state_epoch = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_vocab, self.str_vocab = decode_vocab(self.tokenizer)
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------

    def _check_open(self):
        if getattr(self, "_closed", False):
            raise ModelClosedError(
                f"this {type(self).__name__} was cleaned up (cleanup() or context exit); "
                "create a new model to run more queries"
            )

    def cleanup(self):
        """Release the model and its caches. Any later call raises `ModelClosedError`."""
        self._closed = True

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.cleanup()
        return False

    async def __aenter__(self):
        self._check_open()
        return self

    async def __aexit__(self, exc_type, exc, tb):
        self.cleanup()
        return False

    def clear_cache(self):
        """Forget cached results. Nothing to forget here."""

    # ---- next-token distributions ----------------------------------------------

    @abstractmethod
    async def next_token_logprobs(self, token_ids, lora_name=None):
        """Log probabilities of the token following ``token_ids`` (awaitable).

        Args:
            token_ids (list[int]): The context, at least one token.
            lora_name (str, optional): LoRA adapter to use; None for the default.

        Returns:
            (torch.Tensor): float32 log probabilities, one per vocabulary entry.
        """

    @abstractmethod
    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        """Blocking form of `next_token_logprobs`."""

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        """`next_token_logprobs` of several contexts, stacked into ``[B, V]``."""
        contexts = context_list(token_ids_list, "batch_next_token_logprobs",
                                allow_empty=False)
        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name=lora_name) for ids in contexts)
        )
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None):
        """Blocking form of `batch_next_token_logprobs`."""
        contexts = context_list(token_ids_list, "batch_next_token_logprobs_sync",
                                allow_empty=False)
        return torch.stack(
            [self.next_token_logprobs_sync(ids, lora_name=lora_name) for ids in contexts]
        )

    async def next_token_logits(self, token_ids, lora_name=None):
        """Unnormalized next-token scores on the model's device (the fused-path hook).

        Any row that differs from the log probabilities by a constant is a valid answer;
        consumers such as a trie's ``batch_log_mass`` normalize it themselves.
        """
        return await self.next_token_logprobs(token_ids, lora_name=lora_name)

    async def batch_next_token_logits(self, token_ids_list, lora_name=None):
        """`next_token_logits` of several contexts, stacked into ``[B, V]``."""
        contexts = context_list(token_ids_list, "batch_next_token_logits",
                                allow_empty=False)
        rows = await asyncio.gather(
            *(self.next_token_logits(ids, lora_name=lora_name) for ids in contexts)
        )
        return torch.stack(rows)

    # ---- LoRA ---------------------------------------------------------------------

    def add_new_lora(self, lora_path, lora_name="lora_1"):
        """Load a LoRA adapter under ``lora_name``."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def remove_lora(self, lora_name):
        """Unload a LoRA adapter."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def set_lora(self, lora_path=None, lora_name="lora_1"):
        """Make a loaded adapter the default for calls that pass no ``lora_name``."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def clear_lora(self):
        """Go back to the base model as the default."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    # ---- sampling ----------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids,
        max_tokens,
        eos_token_ids,
        temperature=1.0,
        seed=None,
        lora_name=None,
    ):
        """Ancestral sampling of up to ``max_tokens`` tokens after the prompt.

        Stops before the first token in ``eos_token_ids`` (which is not returned).
        With a ``seed``, draws come from a CPU generator seeded with it.

        Returns:
            (list[int]): The sampled token ids.
        """
        self._check_open()
        temperature = check_temperature(temperature)
        max_tokens, eos, seed = check_sampling(max_tokens, eos_token_ids, seed)
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        if isinstance(prompt_token_ids, (torch.Tensor, np.ndarray)):
            context = prompt_token_ids.tolist()  # ints, as next_token_logprobs accepts it
        else:
            context = list(prompt_token_ids)
        out = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context + out, lora_name=lora_name)
            probs = torch.softmax(logprobs / temperature, dim=-1)
            if generator is not None:
                probs = probs.cpu()
            tok = int(torch.multinomial(probs, num_samples=1, generator=generator).item())
            if tok in eos:
                break
            out.append(tok)
        return out

    async def batch_sample(
        self,
        prompt_token_ids_list,
        max_tokens,
        eos_token_ids,
        temperature=1.0,
        seed=None,
        lora_name=None,
    ):
        """`sample` for each prompt concurrently (each with the same ``seed``)."""
        check_temperature(temperature)
        # read once: eos_token_ids may be a one-pass iterable
        max_tokens, eos_token_ids, seed = check_sampling(max_tokens, eos_token_ids, seed)
        prompt_token_ids_list = context_list(prompt_token_ids_list, "batch_sample")
        return list(
            await asyncio.gather(
                *(
                    self.sample(
                        prompt_token_ids=p,
                        max_tokens=max_tokens,
                        eos_token_ids=eos_token_ids,
                        temperature=temperature,
                        seed=seed,
                        lora_name=lora_name,
                    )
                    for p in prompt_token_ids_list
                )
            )
        )


class _Row:
    """One distinct context waiting in the batch, and everybody waiting for it."""

    __slots__ = ("ids", "lora", "waiters")

    def __init__(self, lora, ids):
        self.lora = lora
        self.ids = ids
        self.waiters = []  # (future, wants_logprobs)

    def live(self):
        return any(not fut.done() for fut, _ in self.waiters)

    def wants_logprobs(self):
        return any(want and not fut.done() for fut, want in self.waiters)


# An idle probe inspects the loop's ready callbacks only when there are at most this many:
# more means work is queued (other models' probes are one handle each).
_IDLE_SCAN_LIMIT = 8


def _is_idle_probe(handle):
    return getattr(getattr(handle, "_callback", None), "__func__", None) is (
        BatchedAsyncLM._on_idle_probe
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


class BatchedAsyncLM(AsyncLM):
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

    def __init__(self, tokenizer, batch_size=20, timeout=0.02, cache_size=1024,
                 flush_when_idle=True):
        super().__init__(tokenizer)
        if (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                or not 0 <= float(timeout) < float("inf")):
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

        Returns the logits ``[n, V']`` and, if ``want_logprobs``, a list of the n float32
        CPU log-probability rows (each one its own tensor, also stored in the output cache:
        hand out copies, see `_cached`). The rows are cached even when only logits are
        wanted, so that a context asked for again (a beam re-scored, a prefix shared by
        particles) costs no forward whichever method asks.
        """
        logits = self._forward_in_chunks(lora, rows, self._forward)
        if not want_logprobs and self.cache_size <= 0:
            return logits, None
        return logits, self._keep_rows(lora, rows, torch.log_softmax(logits.float(), -1).cpu())

    def _forward_in_chunks(self, lora, rows, forward):
        """``forward(lora, chunk)`` on ``rows`` in chunks of ``batch_size``, one forward of
        this model at a time; the ``[n, V']`` rows, concatenated."""
        parts = []
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            with self._forward_lock:
                self._check_open()  # cleanup() may have run since the rows were taken
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

    # ---- the auto-batcher ----------------------------------------------------------

    def _enqueue(self, lora, ids, wants_logprobs):
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._pending and self._loop is not loop:
                if (self._loop is not None and not self._loop.is_closed()
                        and any(row.live() for row in self._pending.values())):
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
            fut = loop.create_future()
            key = (lora, ids)
            row = self._pending.get(key)
            if row is None:
                row = self._pending[key] = _Row(lora, ids)
            row.waiters.append((fut, wants_logprobs))
            self._queued += 1
            full = self._queued >= self.batch_size
            if not full:
                if self._timer is None:
                    self._timer = loop.call_later(self.timeout, self._on_timer)
                if self.flush_when_idle and self._idle_probe is None:
                    self._idle_probe = loop.call_soon(self._on_idle_probe)
        if full:
            self._flush()
        return fut

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
                logits, logprobs = self._evaluate(lora, [r.ids for r in group], want)
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
                for fut, wants_lp in r.waiters:
                    if not fut.done():
                        answer = (logprobs[i] if wants_lp else logits[i]).clone()
                        _settle(fut, answer, False, here)
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

    def reset_async_queries(self):
        """Drop every waiting query; its caller gets `QueriesResetError`.

        Use it when an exception stopped an inference algorithm midway.
        """
        self._fail_pending(
            QueriesResetError("query dropped by reset_async_queries() before it was evaluated")
        )

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
        return await self._enqueue(lora, ids, True)

    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        """Log probabilities of the token following ``token_ids``, without batching."""
        lora, ids = self._prepare(token_ids, lora_name)
        hit = self._cached(lora, ids)
        if hit is not None:
            return hit.clone()
        return self._evaluate(lora, [ids])[1][0].clone()

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None):
        """Log probabilities for several contexts, ``[B, V']``, in as few calls as possible."""
        self._check_open()
        lora = self._resolve_lora(lora_name)
        all_ids = [self._check_context(t)
                   for t in context_list(token_ids_list, "batch_next_token_logprobs_sync",
                                         allow_empty=False)]
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
            _, logprobs = self._evaluate(lora, todo)
            for ids, row in zip(todo, logprobs):
                found[ids] = row
        return torch.stack([found[ids] for ids in all_ids])

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        """Log probabilities for several contexts, ``[B, V']``, via the auto-batcher."""
        self._check_open()
        token_ids_list = context_list(token_ids_list, "batch_next_token_logprobs",
                                      allow_empty=False)
        return await self._whole_batch(self._logprobs_of, token_ids_list, lora_name)

    async def next_token_logits(self, token_ids, lora_name=None):
        """Unnormalized next-token logits ``[V']`` on the model's device.

        The batch's log probabilities also go to the output cache (on the CPU, as those of
        `next_token_logprobs`), and a cached context answers with them moved to the
        device: they differ from the logits by a constant only.
        """
        return await self._logits_of(*self._prepare(token_ids, lora_name))

    async def _logits_of(self, lora, ids):
        """`next_token_logits` of a checked context (``_prepare``'s pair)."""
        hit = self._cached(lora, ids)
        if hit is not None:
            return hit.to(self.device, non_blocking=True, copy=True)
        return await self._enqueue(lora, ids, False)

    async def batch_next_token_logits(self, token_ids_list, lora_name=None):
        """Unnormalized logits ``[B, V']`` on the model's device, via the auto-batcher."""
        self._check_open()
        token_ids_list = context_list(token_ids_list, "batch_next_token_logits",
                                      allow_empty=False)
        return await self._whole_batch(self._logits_of, token_ids_list, lora_name)

    async def _whole_batch(self, answer, token_ids_list, lora_name):
        """A batch call hands over all its contexts at once: queue them, then evaluate
        right away (with whatever else is queued) instead of waiting for the timer. Every
        context is checked first, so a bad one fails the call before any forward runs; a
        call cancelled (or failed) before its rows are back takes its queries with it."""
        prepared = [self._prepare(ids, lora_name) for ids in token_ids_list]
        tasks = [asyncio.ensure_future(answer(lora, ids)) for lora, ids in prepared]
        try:
            await asyncio.sleep(0)  # every task runs up to its queued future
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
        """Forget cached log probabilities."""
        with self._lock:
            self._outputs.clear()
        self.state_epoch += 1

    def cleanup(self):
        """Fail waiting queries, drop caches and the model; later calls raise."""
        if self._closed:
            return
        self._fail_pending(
            QueriesResetError("query dropped because the model was cleaned up")
        )
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


class MockAsyncLM(BatchedAsyncLM):
    """A deterministic stand-in language model over a real tokenizer's vocabulary.

    The distribution after a context depends only on the context (the same one
    genlm.backend's mock produces): the scores are uniform draws from a NumPy
    ``RandomState`` seeded with ``sum((i + 1) * token_i)``. Requests go through the
    same auto-batcher as the real backends.

    Args:
        tokenizer: Hugging Face tokenizer.
        batch_size (int): See `BatchedAsyncLM`. Defaults to 20.
        timeout (float): See `BatchedAsyncLM`. Defaults to 0.0 (next loop iteration).
        cache_size (int): See `BatchedAsyncLM`. Defaults to 1024.
        flush_when_idle (bool): See `BatchedAsyncLM`. Defaults to True.
    """

    def __init__(self, tokenizer, batch_size=20, timeout=0.0, cache_size=1024,
                 flush_when_idle=True):
        super().__init__(tokenizer, batch_size=batch_size, timeout=timeout,
                         cache_size=cache_size, flush_when_idle=flush_when_idle)

    @classmethod
    def from_name(cls, model_name, **kwargs):
        """Build the mock over the tokenizer of ``model_name`` (``"smollm2"`` works offline)."""
        from transformers import AutoTokenizer

        from genlm_fast.models import resolve_model_name

        return cls(AutoTokenizer.from_pretrained(resolve_model_name(model_name)), **kwargs)

    @staticmethod
    def context_seed(token_ids):
        """The RandomState seed of a context (reduced mod 2**32 when it is larger)."""
        return sum((i + 1) * t for i, t in enumerate(token_ids)) % (2**32)

    def _check_context(self, token_ids):
        """As the real backends, but the empty context is one too (genlm's mock answers
        it: genlm-control's PromptedLLM starts from an empty prompt)."""
        return check_token_ids(token_ids, self._vocab_limit(), allow_empty=True)

    def _scores(self, token_ids):
        rng = np.random.RandomState(self.context_seed(token_ids))
        return torch.from_numpy(rng.rand(len(self.byte_vocab)).astype(np.float32))

    def _forward(self, lora_name, rows):
        return torch.stack([self._scores(ids) for ids in rows])
