"""The ways `AsyncTransformer` runs a forward pass, one engine each, and the one place that
chooses between them (`Forwards.plan`).

A forward is a batch of `Row`s: each a context, how many of its first positions have
key/value states stored in the adapter's `KVTrie` (its past), and those states as `KVRun`s.
An engine runs rows of new tokens after their pasts and returns an `Output`: the logits of
each row's last position and each row's new states, which `Forwards.run` stores in the trie.

* `FusedEngine`: the fused CPU decoder (`decoder.FusedDecoder`), forwards of up to
  ``max_tokens`` new tokens of the base model, reading and writing states in place;
* `EagerEngine`: transformers' forward over a padded batch, pasts assembled in a reused
  key/value buffer (`kv_buffer`); everything the others do not take;
* `GraphsEngine`: one-token steps of the base model from fixed-shape buckets replayed as
  CUDA graphs (`graphs.DecodeGraphs`), the eager engine's rows when they all are steps;
* `PagedEngine`: transformers' forward with an attention over a paged key/value pool
  (`paged_forward`, `paged_kv`): it replaces all the others for its model, keeping the
  states in its own trie's pool rather than in `KVTrie` segments.

Each engine says why it cannot take rows (``why_not``, None when it can); `Forwards.choose`
builds the engines an `AsyncTransformer`'s options ask for, and `Forwards.path` is what
`AsyncTransformer.forward_path` reports.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from genlm_fast.backend.cache import KVRun, KVTrie, kv_bytes_per_position
from genlm_fast.backend.llm.checks import check_finite_logits
from genlm_fast.backend.llm.graphs import CaptureFailed, DecodeGraphs, graphs_unsupported
from genlm_fast.backend.llm.kv_buffer import buffer_cache, buffer_layer_class, copy_pasts
from genlm_fast.backend.llm.paged_forward import PagedForward, paged_unsupported
from genlm_fast.backend.llm.paged_kv import PagedKVPool, PagedKVTrie

__all__ = [
    "EagerEngine",
    "Forwards",
    "FusedEngine",
    "GraphsEngine",
    "Output",
    "PagedEngine",
    "Row",
]


class Row(NamedTuple):
    """One context of a forward."""

    ids: tuple  # the context's token ids, all of them
    depth: int  # how many of its first positions have stored states (its past)
    runs: list[KVRun]  # those states, in position order (empty when ``depth`` is 0)

    @property
    def new(self) -> int:
        """How many positions the forward runs for this row."""
        return len(self.ids) - self.depth


class Output(NamedTuple):
    """What an engine's forward returns."""

    logits: torch.Tensor  # [rows, vocab]: each row's last position
    # each row's new states [layers, 2, kv_heads, new, head_dim], to store; None when not
    # asked for, or when the model returned a cache that cannot be reused
    states: list[torch.Tensor] | None


def _ids(rows):
    return [row.ids for row in rows]


class FusedEngine:
    """The base model's forwards of up to ``max_tokens`` new tokens (all rows together) in
    one call of the fused CPU decoder, which `ModelState` builds where the model allows it
    (and builds again when its weights change)."""

    name = "fused"
    MAX_TOKENS = 64

    def __init__(self, state):
        self.state = state
        self.max_tokens = self.MAX_TOKENS

    def why_not(self, row, lora):
        if self.state.decoder is None:
            return self.state.reason
        if lora is not None:
            return "an adapter is active"
        if row.new > self.max_tokens:
            return f"more than {self.max_tokens} new tokens"
        return None

    def pack(self, rows, chosen):
        """``chosen`` (indices of ``rows``) cut into forwards of at most ``max_tokens`` new
        tokens, in order."""
        chunks, chunk, size = [], [], 0
        for i in chosen:
            n = rows[i].new
            if size + n > self.max_tokens:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += n
        if chunk:
            chunks.append(chunk)
        return chunks

    def run(self, rows, keep):
        logits, segments = self.state.decoder.forward(rows)
        check_finite_logits(logits, _ids(rows))
        return Output(logits, segments if keep else None)

    def uncached(self, ids):
        """The last position's logits [V] of ``ids`` run from scratch."""
        return self.state.decoder.forward([Row(tuple(ids), 0, [])])[0][0]


class EagerEngine:
    """transformers' forward over a padded batch (module docstring). New tokens are
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
        states, and a 16-bit model's prefills widened for it to read in place, not converted
        again on every read), else the model's."""
        return torch.float32 if self.state.decoder is not None else self.model.dtype

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
            check_finite_logits(out.logits[:, -1], _ids(rows))
            states = self.new_states(rows, 0, out.past_key_values) if keep else None
            return Output(out.logits[:, -1], states)

        # The past and the new positions share one [L, 2, B, H, max_past + max_new, D]
        # buffer, reused from the last forward: the rows' stored KV is copied in once, the
        # model writes the new positions after it (_BufferLayer), and nothing is
        # concatenated or zero-filled but the gaps of rows with a shorter past (masked,
        # but they must be finite: 0 * NaN would poison the attention).
        # (in the model's dtype: a bfloat16 model's stored states are float32, the fused
        # decoder's, and copy_pasts converts)
        seg = next(row.runs[0].segment for row in rows if row.depth)
        L, _, H, _, D = seg.data.shape
        shape = (L, 2, B, H, max_past + max_new, D)
        storage = self.take_kv_buffer(shape, self.model.dtype, seg.data.device)
        try:
            kv = storage[: math.prod(shape)].view(shape)
            copy_pasts(kv, rows, max_past)
            kwargs["past_key_values"] = buffer_cache(kv, max_past)
            out = self.model(**kwargs)
            check_finite_logits(out.logits[:, -1], _ids(rows))
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


class GraphsEngine:
    """Batches of the base model whose rows each add one token to a stored past, from the
    buckets of ``buckets`` (`DecodeGraphs`), their states read from the bucket's buffer by
    ``eager`` (the same layout as its own forward's)."""

    name = "CUDA graphs"

    def __init__(self, buckets: DecodeGraphs, eager: EagerEngine):
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
        check_finite_logits(logits, _ids(rows))
        states = self.eager.new_states(rows, kv.shape[4] - 1, cache, kv) if keep else None
        return Output(logits, states)


class PagedEngine:
    """Every forward of a model over its adapters' paged pools (`PagedForward`): rows are
    planned against a `PagedKVTrie` (which blocks they read, which they write), run, and
    their states committed to the trie, or the blocks given back if the forward failed."""

    name = "paged"
    PAGE = 16  # positions per block of the pool

    def __init__(self, model, forward: PagedForward, pad_id):
        self.model = model
        self.forward = forward
        self.pad_id = pad_id

    def new_trie(self, tokens, max_bytes):
        """A `PagedKVTrie` over a pool as large as the key/value budget."""
        model = self.model
        dtype = model.dtype
        per_position = kv_bytes_per_position(model.config, dtype.itemsize)[0]
        positions = tokens if max_bytes is None else min(tokens, max_bytes // per_position)
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        pool = PagedKVPool(
            int(text.num_hidden_layers),
            heads,
            head_dim,
            dtype,
            model.device,
            blocks=positions // self.PAGE + 1,
            page=self.PAGE,
        )
        return PagedKVTrie(pool)

    def run(self, rows, trie, lora):
        """The last-position logits of ``rows`` (token id sequences), their states kept."""
        plan = trie.plan(rows)
        try:
            # recorded steps are the base model's: an adapter's forwards run eagerly
            logits = self.forward.run(plan, trie.pool, self.pad_id, buckets=lora is None)
            check_finite_logits(logits, rows)
        except CaptureFailed as exc:
            trie.release_plan(plan)
            warnings.warn(
                f"paged_kv: {type(self.model).__name__}'s step could not be recorded as a "
                f"CUDA graph, so it runs eagerly ({exc})",
                RuntimeWarning,
                stacklevel=4,
            )
            self.forward.capture = False
            return self.run(rows, trie, lora)
        except BaseException:
            trie.release_plan(plan)
            raise
        trie.commit(plan)
        return logits


class Forwards:
    """The engines of one `AsyncTransformer` and the choice between them.

    Build it with `choose`. ``paged`` (a `PagedEngine`) set means it runs every forward;
    else ``fused`` takes the rows it can, ``eager`` the rest, cut by its cost model, and
    ``graphs`` (None: off) those of its forwards that are one-token steps."""

    def __init__(self, model, state, pad_id, keeps_logits):
        self.model = model
        self.state = state
        self.fused = FusedEngine(state)
        self.eager = EagerEngine(model, state, pad_id, keeps_logits)
        self.graphs = None
        self.paged = None

    @classmethod
    def choose(cls, model, state, *, pad_id, keeps_logits, kv_on, paged_kv, cuda_graphs):
        """The engines for ``model`` and the options ``paged_kv`` and ``cuda_graphs``
        (`AsyncTransformer`'s arguments).

        Raises:
            TypeError: an option of the wrong type.
            ValueError: ``paged_kv=True`` for a model it cannot run or without a key/value
                budget; ``cuda_graphs=True`` for a model off a CUDA device.
        """
        forwards = cls(model, state, pad_id, keeps_logits)
        if not isinstance(paged_kv, bool):
            raise TypeError(f"paged_kv must be True or False, got {paged_kv!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        on_cuda = model.device.type == "cuda"
        if paged_kv:
            why_not = paged_unsupported(model)
            if why_not is not None:
                raise ValueError(f"paged_kv=True cannot run {type(model).__name__}: {why_not}")
            if not kv_on:
                raise ValueError(
                    "paged_kv=True keeps every forward's states in the pool: kv_cache_tokens "
                    "and kv_cache_bytes must leave room for some (got 0)"
                )
            paged = PagedForward(model, keeps_logits, capture=on_cuda)
            forwards.paged = PagedEngine(model, paged, pad_id)
            return forwards
        if cuda_graphs is False:
            return forwards
        if not on_cuda:
            if cuda_graphs:
                raise ValueError(
                    "cuda_graphs=True needs a model on a CUDA device; this one is on "
                    f"{model.device}"
                )
            return forwards
        why_not = graphs_unsupported(model)
        if why_not is not None:
            if cuda_graphs:
                warnings.warn(
                    f"cuda_graphs: {type(model).__name__} keeps the eager forward: {why_not}",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return forwards
        forwards.graphs = GraphsEngine(DecodeGraphs(model, keeps_logits), forwards.eager)
        return forwards

    @property
    def path(self):
        """Which engine runs the base model's decoding steps, in words
        (`AsyncTransformer.forward_path`)."""
        if self.paged is not None:
            graphs = ", one-token steps as CUDA graphs" if self.paged.forward.capture else ""
            return f"paged (attention over a paged key/value pool{graphs})"
        if self.state.decoder is not None:
            return "fused"
        graphs = ", one-token steps as CUDA graphs" if self.graphs is not None else ""
        return f"transformers ({self.state.reason}){graphs}"

    @property
    def kv_dtype(self):
        """The dtype of the stored key/value states."""
        return self.model.dtype if self.paged is not None else self.eager.kv_dtype

    def new_trie(self, tokens, max_bytes):
        """An empty trie of stored states for one adapter, within the budgets."""
        if self.paged is not None:
            return self.paged.new_trie(tokens, max_bytes)
        return KVTrie(tokens, max_bytes)

    def clear(self):
        """Forget what was recorded over the model's parameters (after they changed)."""
        if self.graphs is not None:
            self.graphs.buckets.clear()
        if self.paged is not None:
            self.paged.forward.clear()

    def plan(self, rows, lora):
        """The forwards that run ``rows`` (`Row`s): ``[(engine, indices of rows)]``. The one
        place where an engine is chosen (but the paged engine's, which runs everything)."""
        fused = [i for i, row in enumerate(rows) if self.fused.why_not(row, lora) is None]
        jobs = [(self.fused, chunk) for chunk in self.fused.pack(rows, fused)]
        taken = set(fused)
        rest = [i for i in range(len(rows)) if i not in taken]
        if not rest:
            return jobs
        for chunk in self.eager.split([rows[i] for i in rest]):
            chunk = [rest[i] for i in chunk]
            part = [rows[i] for i in chunk]
            steps = self.graphs is not None and self.graphs.why_not(part, lora) is None
            engine = self.graphs if steps else self.eager
            jobs.append((engine, chunk))
        return jobs

    def run(self, lora, rows, trie):
        """The last-position logits of ``rows`` (token id sequences) [B, V], their new states
        stored in ``trie`` (None: none kept). Returns ``(logits, kept)``: ``kept`` False when
        the model returned states that cannot be reused (none were stored)."""
        if self.paged is not None:
            return self.paged.run(rows, trie, lora), True
        plans = [
            Row(ids, *trie.match(ids, len(ids) - 1)) if trie is not None else Row(ids, 0, [])
            for ids in rows
        ]
        kept = True
        jobs = self.plan(plans, lora)
        out = None
        for engine, chunk in jobs:
            part = plans if len(jobs) == 1 else [plans[i] for i in chunk]
            logits, stored = self.run_on(engine, part, trie if kept else None)
            kept = kept and stored
            if len(jobs) == 1:
                return logits, kept
            if out is None:
                out = logits.new_empty((len(rows), logits.shape[1]))
            out[torch.tensor(chunk, device=logits.device)] = logits
        return out, kept

    def run_on(self, engine, rows, trie):
        """One forward of ``rows`` (`Row`s) on ``engine``, its new states stored in ``trie``
        (None: none kept). Returns ``(logits, stored)``: ``stored`` False when the model
        returned states that cannot be reused."""
        keep = trie is not None
        logits, states = self._run(engine, rows, keep)
        if keep and states is None:
            return logits, False
        if keep:
            for row, seg in zip(rows, states):
                trie.insert(row.ids, row.depth, seg, row.runs)
        return logits, True

    def _run(self, engine, rows, keep):
        if engine is self.graphs:
            try:
                done = engine.run(rows, keep)
            except CaptureFailed as exc:
                warnings.warn(
                    f"cuda_graphs: {type(self.model).__name__}'s forward could not be "
                    f"recorded as a CUDA graph, so it runs eagerly ({exc})",
                    RuntimeWarning,
                    stacklevel=5,
                )
                self.graphs = done = None
            if done is not None:
                return done
            engine = self.eager
        return engine.run(rows, keep)

    def uncached(self, lora, ids):
        """The last position's logits [V] of ``ids`` from one forward over all of them: the
        fused decoder's where it takes them (so that a cached query's answer is this one,
        bit for bit), else transformers'."""
        if self.fused.why_not(Row(tuple(ids), 0, []), lora) is None:
            return self.fused.uncached(ids)
        return self.eager.uncached(ids)
