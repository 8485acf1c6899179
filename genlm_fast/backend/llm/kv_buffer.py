"""transformers' forward over a padded batch (`EagerEngine`), and the key/value buffers it
reads its past from and writes its new positions into: one ``[L, 2, B, H, T, D]`` tensor
per forward, the rows' stored pasts copied in once (`copy_pasts`), each layer's new keys and
values written in place after them (`buffer_cache`). `graphs.DecodeGraphs` fills its
buckets' buffers the same way."""

from __future__ import annotations

import functools
import math

import torch

from genlm_fast.backend.llm.checks import check_finite_logits
from genlm_fast.backend.llm.plan import Output, row_ids
from genlm_fast.backend.llm.widen import compute_dtype

__all__ = ["EagerEngine", "buffer_cache", "buffer_layer_class", "copy_pasts"]


def copy_pasts(kv, plans, fill_to):
    """Copy each row's stored past into ``kv`` ``[L, 2, B, H, T, D]``: row ``i`` of
    ``plans`` (`plan.Row`s, whose `KVRun`s hold the states of their first ``depth``
    positions) to positions ``[0, depth)``, and zeros in
    ``[depth, fill_to)``: masked, but they must be finite (0 * NaN would poison the
    attention). Rows that read the same run to the same positions (the shared prompt of
    many particles) get it in one broadcast copy per block of consecutive rows."""
    readers = {}
    for i, (_, d, runs) in enumerate(plans):
        at = 0
        for s, a, b in runs:
            readers.setdefault((id(s), a, b, at), (s, []))[1].append(i)
            at += b - a
        if d < fill_to:
            kv[:, :, i, :, d:fill_to] = 0
    for (_, a, b, at), (s, rows) in readers.items():
        for first, last in consecutive_blocks(rows):
            kv[:, :, first : last + 1, :, at : at + b - a] = s.data[:, :, None, :, a:b]


def consecutive_blocks(rows):
    """Increasing row numbers as (first, last) of each block of consecutive ones."""
    first = prev = rows[0]
    for r in rows[1:]:
        if r != prev + 1:
            yield first, prev
            first = r
        prev = r
    yield first, prev


@functools.cache
def buffer_layer_class():
    """transformers' ``DynamicLayer`` over preallocated key and value buffers
    ``[B, H, T, D]`` whose first positions already hold the past: ``update`` writes the
    new states in place after them (the stock layer concatenates, copying the whole past
    each forward). States that do not fit (another shape, dtype or length) are
    concatenated as the stock layer does, and ``in_place`` turns False. Defined on first
    use: transformers is imported only with this backend."""
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        def __init__(self, key_buffer, value_buffer, filled):
            super().__init__()
            self.dtype, self.device = key_buffer.dtype, key_buffer.device
            self._key_buffer, self._value_buffer = key_buffer, value_buffer
            self.keys = key_buffer[:, :, :filled]
            self.values = value_buffer[:, :, :filled]
            self.is_initialized = True
            self.in_place = True

        def update(self, key_states, value_states, *args, **kwargs):
            start = self.keys.shape[2]
            stop = start + key_states.shape[2]
            target = self._key_buffer[:, :, start:stop]
            if (
                self.in_place
                and stop <= self._key_buffer.shape[2]
                and key_states.shape == target.shape
                and value_states.shape == target.shape
                and key_states.dtype == value_states.dtype == self.dtype
            ):
                target.copy_(key_states)
                self._value_buffer[:, :, start:stop].copy_(value_states)
                self.keys = self._key_buffer[:, :, :stop]
                self.values = self._value_buffer[:, :, :stop]
                return self.keys, self.values
            self.in_place = False
            return super().update(key_states, value_states, *args, **kwargs)

    return _BufferLayer


def buffer_cache(kv, filled):
    """A ``DynamicCache`` whose layer ``l`` writes into ``kv[l]`` ([L, 2, B, H, T, D]),
    positions ``[0, filled)`` being the past."""
    from transformers import DynamicCache

    layer = buffer_layer_class()
    cache = DynamicCache()
    cache.layers = [layer(kv[i, 0], kv[i, 1], filled) for i in range(kv.shape[0])]
    return cache


class EagerEngine:
    """The `plan.Engine` of transformers' forward over a padded batch, its pasts copied
    into a buffer kept from one forward to the next (module docstring). New tokens are
    left-padded, so that every row's last token sits at the same position and the LM head
    runs once per row (``logits_to_keep=1``)."""

    name = "transformers"

    # Cost model of one forward, in token-rows: a fixed overhead, plus the padded work,
    # which costs no less than reading the weights once (small batches are memory-bound).
    FORWARD_OVERHEAD = 16
    MEMORY_FLOOR = 64
    # A KV buffer up to this size is kept for the next forward: a fresh one would be
    # page-faulted in again, every forward of a decoding run.
    KV_BUFFER_KEEP_BYTES = 64 << 20

    def __init__(self, model, state, pad_id, keeps_logits):
        self.model = model
        self.state = state
        self.pad_id = pad_id
        self.keeps_logits = keeps_logits
        self.kv_buffer = None  # flat storage of the last forward's KV (`take_kv_buffer`)

    def why_not(self, rows, lora):
        return None  # it runs anything

    @property
    def kv_dtype(self):
        """The dtype of the stored states: float32 where the fused decoder runs (its own
        states, read in place) or transformers' forward computes in float32 (`widen`), else
        the model's."""
        return torch.float32 if self.state.decoder is not None else compute_dtype(self.model)

    @classmethod
    def split(cls, rows):
        """Partition rows into forwards so that right-padding does not dominate.

        Rows sorted by new-token count are cut into contiguous groups minimising
        ``sum(overhead + max(floor, rows * longest))`` (exact, by dynamic programming).
        Returns lists of indices of ``rows``.
        """
        order = sorted(range(len(rows)), key=lambda i: -rows[i].new)
        lengths = [rows[i].new for i in order]
        n = len(order)
        best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j rows
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):  # rows i..j-1 in one forward; the longest is row i
                cost = best[i] + cls.FORWARD_OVERHEAD + max(cls.MEMORY_FLOOR, (j - i) * lengths[i])
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        chunks = []
        j = n
        while j > 0:
            chunks.append(sorted(order[cut[j] : j]))
            j = cut[j]
        return chunks[::-1]

    def run(self, rows, keep):
        dev = self.model.device
        B = len(rows)
        max_past = max(row.depth for row in rows)
        max_new = max(row.new for row in rows)
        pad = self.pad_id
        input_ids, positions, mask = [], [], []
        for ids, d, _ in rows:
            n = len(ids) - d
            input_ids.append([pad] * (max_new - n) + list(ids[d:]))
            positions.append([0] * (max_new - n) + list(range(d, d + n)))
            mask.append([1] * d + [0] * (max_past - d) + [0] * (max_new - n) + [1] * n)
        kwargs = {
            "input_ids": torch.tensor(input_ids, device=dev),
            "attention_mask": torch.tensor(mask, device=dev),
            "position_ids": torch.tensor(positions, device=dev),
            "use_cache": keep,
        }
        if self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        if not max_past:
            out = self.model(**kwargs)
            check_finite_logits(out.logits[:, -1], row_ids(rows))
            states = self.new_states(rows, 0, out.past_key_values) if keep else None
            return Output(out.logits[:, -1], states)

        # The past and the new positions share one [L, 2, B, H, max_past + max_new, D]
        # buffer, reused from the last forward: the rows' stored KV is copied in once, the
        # model writes the new positions after it (_BufferLayer), and nothing is
        # concatenated or zero-filled but the gaps of rows with a shorter past (masked,
        # but they must be finite: 0 * NaN would poison the attention).
        # (in the dtype the forward computes in: copy_pasts converts stored states of another)
        seg = next(row.runs[0].segment for row in rows if row.depth)
        L, _, H, _, D = seg.data.shape
        shape = (L, 2, B, H, max_past + max_new, D)
        storage = self.take_kv_buffer(shape, compute_dtype(self.model), seg.data.device)
        try:
            kv = storage[: math.prod(shape)].view(shape)
            copy_pasts(kv, rows, max_past)
            kwargs["past_key_values"] = buffer_cache(kv, max_past)
            out = self.model(**kwargs)
            check_finite_logits(out.logits[:, -1], row_ids(rows))
            # (a past came from the trie, so the states are kept)
            states = self.new_states(rows, max_past, out.past_key_values, kv)
        finally:
            self.give_back_kv_buffer(storage)
        return Output(out.logits[:, -1], states)

    def take_kv_buffer(self, shape, dtype, device):
        """Flat storage for at least ``prod(shape)`` elements: the kept one if it fits,
        else a new one with room to grow (a context grows by a token a round)."""
        need = math.prod(shape)
        kept, self.kv_buffer = self.kv_buffer, None  # taken: no other caller shares it
        if (
            kept is not None
            and kept.numel() >= need
            and kept.dtype == dtype
            and kept.device == device
        ):
            return kept
        return torch.empty(need + need // 4, dtype=dtype, device=device)

    def give_back_kv_buffer(self, storage):
        if storage.numel() * storage.element_size() <= self.KV_BUFFER_KEEP_BYTES:
            self.kv_buffer = storage

    def new_states(self, rows, max_past, cache, kv=None):
        """Each row's new positions, copied (the buffer is reused by the next forward): from
        ``kv`` (the forward's buffer) when the model wrote them all there, else from the
        cache's layers; None when the cache is not one whose states can be reused."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        max_new = max(row.new for row in rows)
        reusable = (DynamicLayer, buffer_layer_class())  # not their subclasses (sliding...)
        usable = bool(layers) and all(
            type(layer) in reusable
            and isinstance(getattr(layer, "keys", None), torch.Tensor)
            and layer.keys.dim() == 4
            and layer.keys.shape[2] == max_past + max_new
            and layer.keys.device == layers[0].keys.device
            and layer.keys.shape[1:] == layers[0].keys.shape[1:]
            for layer in layers
        )
        if not usable:
            return None
        if (
            kv is not None
            and len(layers) == kv.shape[0]
            and all(getattr(layer, "in_place", False) for layer in layers)
        ):
            new = kv[:, :, :, :, max_past:]  # [L, 2, B, H, max_new, D], a view
        else:
            new = torch.stack(
                [
                    torch.stack((layer.keys[:, :, max_past:], layer.values[:, :, max_past:]))
                    for layer in layers
                ]
            )  # [L, 2, B, H, max_new, D]
        dtype = self.kv_dtype
        return [
            new[:, :, i, :, max_new - row.new :].to(
                dtype=dtype, memory_format=torch.contiguous_format, copy=True
            )
            for i, row in enumerate(rows)
        ]

    def uncached(self, ids):
        ids_in = torch.tensor([list(ids)], device=self.model.device)
        return self.model(ids_in, use_cache=False).logits[0, -1]
