"""One-token decoding forwards over fixed-shape buffers, replayed as CUDA graphs.

On a GPU, a small model's eager forward waits on the host: a decoder layer is some twenty
kernel launches, each prepared by Python, so a forward of a small model costs the host's
time to launch them whatever the batch; replayed from a CUDA graph, the same kernels cost
the device's time to run them.
A graph replays fixed kernels on fixed addresses, so the forward it records must see the
same shapes and buffers every time. `DecodeGraphs` gives it those:

* a batch whose rows each add one token to a stored past runs in a *bucket* of ``rows``
  (the next power of two) x ``length`` (the past plus one, rounded up to `LENGTH_STEP`)
  positions, which owns its inputs, its output and its key/value buffer
  ``[L, 2, rows, H, length, D]``;
* each row's past is copied to positions ``[0, depth)`` of its row (`copy_pasts`, as for
  the eager forward), zeros after it; the new token goes to the last position, its
  position id is the row's depth, and an additive ``[rows, 1, 1, length]`` mask lets it see
  its past and itself only: the attention is the unpadded one (masked positions weigh
  exactly 0), so only the rounding of the wider product can differ from the eager forward;
* the forward is recorded once per bucket (after two eager runs on a side stream, which
  allocate what the kernels need) and replayed for every later batch of that bucket;
  padded rows see only their own position and hold finite values.

Models whose attention is not the plain causal one over the whole past (sliding windows,
hybrid layers) keep the eager forward: a 4-D mask replaces transformers' per-layer masks.
So does a model whose forward cannot be recorded (`CaptureFailed`). Without ``capture``
(on a CPU, for tests) the same buckets run eagerly.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from genlm_fast.backend.llm.checks import check_finite_logits
from genlm_fast.backend.llm.kv_buffer import buffer_cache, copy_pasts
from genlm_fast.backend.llm.plan import Output, row_ids

__all__ = ["CaptureFailed", "DecodeGraphs", "GraphsEngine", "graphs_unsupported"]


class CaptureFailed(RuntimeError):
    """A model's forward could not be recorded as a CUDA graph (it synchronises with the
    host, say); the buckets are gone and the forward runs eagerly instead."""


def graphs_unsupported(model):
    """Why ``model``'s decoding forward cannot run from a bucket (a str), or None."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return f"its layers are not all full attention ({sorted(set(layer_types))})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it attends through a sliding window"
    return None


class _Bucket:
    """One bucket's inputs, output, key/value buffer and recorded forward."""

    def __init__(self, kv_shape, dtype, device):
        rows, length = kv_shape[2], kv_shape[4]  # of [L, 2, rows, H, length, D]
        self.rows, self.length = rows, length
        self.kv = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, 1, 1, length), dtype=dtype, device=device)
        self.graph = None
        self.logits = self.cache = None


class DecodeGraphs:
    """The buckets of one model's one-token decoding forwards (module docstring).

    Args:
        model: the transformers model (its parameters must keep their storage while a
            bucket is recorded: `clear` after replacing any).
        keeps_logits (bool): the model's forward takes ``logits_to_keep``.
        capture (bool): record CUDA graphs (the model is on a CUDA device); False runs the
            buckets eagerly.
    """

    LENGTH_STEP = 128
    # at most this many buckets, their key/value buffers at most MAX_BYTES together (the
    # least recently used go first); a batch whose bucket alone is larger runs eagerly
    MAX_BUCKETS = 4
    MAX_BYTES = 1 << 30

    def __init__(self, model, keeps_logits, capture=True):
        self.model = model
        self.keeps_logits = keeps_logits
        self.capture = capture
        self._buckets = OrderedDict()
        self._pool = None

    def clear(self):
        """Forget every bucket and its recorded forward (and their memory)."""
        self._buckets.clear()
        self._pool = None

    def nbytes(self):
        """Bytes of the buckets' key/value buffers."""
        return sum(b.kv.numel() * b.kv.element_size() for b in self._buckets.values())

    def bucket_shape(self, rows, past):
        """(rows, length) of the bucket that runs ``rows`` rows over pasts up to ``past``."""
        return 1 << (rows - 1).bit_length(), -(-(past + 1) // self.LENGTH_STEP) * self.LENGTH_STEP

    def run(self, plans, pad_id):
        """One forward of ``plans`` (`plan.Row`s, each with one new token and a stored
        past) from its bucket: ``(logits [B, V], kv, cache)``, the logits a copy,
        ``kv`` the bucket's buffer and ``cache`` the forward's cache (their positions
        ``length - 1`` hold the new states, read them before the next `run`); or None when
        the bucket alone would be larger than `MAX_BYTES`."""
        segment = plans[0].runs[0].segment.data  # [L, 2, H, T, D]
        L, two, H, _, D = segment.shape
        rows, length = self.bucket_shape(len(plans), max(row.depth for row in plans))
        bucket = self._bucket((L, two, rows, H, length, D), segment.dtype, segment.device)
        if bucket is None:
            return None
        self._fill(bucket, plans, pad_id)
        if not self.capture:
            logits, cache = self._call(bucket)
        else:
            if bucket.graph is None:
                self._record(bucket)
            bucket.graph.replay()
            logits, cache = bucket.logits, bucket.cache
        return logits[: len(plans), -1].clone(), bucket.kv, cache

    def _bucket(self, kv_shape, dtype, device):
        """The bucket of key/value buffer ``kv_shape`` ``[L, 2, rows, H, length, D]``, made
        (and room made for it) if new; None if it alone is over `MAX_BYTES`."""
        key = (kv_shape[2], kv_shape[4], dtype, device)  # rows, length: the rest is the model's
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        size = math.prod(kv_shape) * dtype.itemsize
        if size > self.MAX_BYTES:
            return None
        while self._buckets and (
            len(self._buckets) >= self.MAX_BUCKETS or self.nbytes() + size > self.MAX_BYTES
        ):
            self._buckets.popitem(last=False)
        bucket = self._buckets[key] = _Bucket(kv_shape, dtype, device)
        return bucket

    def _fill(self, bucket, plans, pad_id):
        """The batch's tokens, positions, mask and pasts into the bucket's buffers."""
        B, length = len(plans), bucket.length
        depths = torch.tensor([row.depth for row in plans] + [0] * (bucket.rows - B))
        tokens = [row.ids[-1] for row in plans] + [pad_id] * (bucket.rows - B)
        bucket.input_ids.copy_(torch.tensor(tokens)[:, None])
        bucket.position_ids.copy_(depths[:, None])
        positions = torch.arange(length)
        visible = (positions[None, :] < depths[:, None]) | (positions == length - 1)[None, :]
        mask = torch.zeros(visible.shape, dtype=bucket.mask.dtype)
        mask.masked_fill_(~visible, torch.finfo(bucket.mask.dtype).min)
        bucket.mask.copy_(mask[:, None, None, :])
        copy_pasts(bucket.kv, plans, length - 1)

    def _call(self, bucket):
        kwargs = {
            "input_ids": bucket.input_ids,
            "position_ids": bucket.position_ids,
            "attention_mask": bucket.mask,
            "past_key_values": buffer_cache(bucket.kv, bucket.length - 1),
            "use_cache": True,
        }
        if self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            out = self.model(**kwargs)
        return out.logits, out.past_key_values

    def _record(self, bucket):
        """Record the bucket's forward as a CUDA graph (its buffers hold a real batch)."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # what the kernels allocate on first use, before recording
                self._call(bucket)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits, bucket.cache = self._call(bucket)
        except Exception as exc:
            self.clear()
            raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
        bucket.graph = graph


class GraphsEngine:
    """The `plan.Engine` of the buckets: batches of the base model whose rows each add one
    token to a stored past, from the buckets of ``buckets`` (`DecodeGraphs`), their states
    read from the bucket's buffer by ``eager`` (`kv_buffer.EagerEngine`: the same layout as
    its own forward's)."""

    name = "CUDA graphs"

    def __init__(self, buckets: DecodeGraphs, eager):
        self.buckets = buckets
        self.eager = eager

    def why_not(self, rows, lora):
        if lora is not None:
            return "an adapter is active"  # the recorded forwards are the base model's
        if not all(row.new == 1 and row.depth for row in rows):
            return "not every row is one token after a stored past"
        return None

    def run(self, rows, keep):
        """The rows' `Output`, or None when their bucket alone would be too large.

        Raises:
            CaptureFailed: the forward could not be recorded (the buckets are gone).
        """
        done = self.buckets.run(rows, self.eager.pad_id)
        if done is None:
            return None
        logits, kv, cache = done
        check_finite_logits(logits, row_ids(rows))
        states = self.eager.new_states(rows, kv.shape[4] - 1, cache, kv) if keep else None
        return Output(logits, states)
