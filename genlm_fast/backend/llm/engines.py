"""The choice between the ways `AsyncTransformer` runs a forward pass: `Forwards`.

A forward is a batch of `plan.Row`s: each a context, how many of its first positions have
key/value states stored in the adapter's `KVTrie` (its past), and those states as `KVRun`s.
An engine (`plan.Engine`) runs rows of new tokens after their pasts and returns a
`plan.Output`: the logits of each row's last position and each row's new states, which
`Forwards.run_on` stores in the trie. The engines, one module each:

* `decoder.FusedEngine`: the fused CPU decoder, forwards of up to ``max_tokens`` new tokens
  of the base model, reading and writing states in place;
* `kv_buffer.EagerEngine`: transformers' forward over a padded batch, pasts assembled in a
  reused key/value buffer; everything the others do not take;
* `graphs.GraphsEngine`: one-token steps of the base model from fixed-shape buckets
  replayed as CUDA graphs, the eager engine's forwards when all their rows are steps;
* `paged_forward.PagedEngine`: transformers' forward with an attention over a paged
  key/value pool (`paged_kv`): it replaces all the others for its model, keeping the states
  in its own trie's pool rather than in `KVTrie` segments.

`Forwards.choose` builds the engines an `AsyncTransformer`'s options ask for, `Forwards.plan`
picks one for each forward of a batch (the one place that does), and `Forwards.path` is what
`AsyncTransformer.forward_path` reports.
"""

from __future__ import annotations

import warnings

import torch

from genlm_fast.backend.cache import KVTrie
from genlm_fast.backend.llm.decoder import FusedEngine
from genlm_fast.backend.llm.graphs import (
    CaptureFailed,
    DecodeGraphs,
    GraphsEngine,
    graphs_unsupported,
)
from genlm_fast.backend.llm.kv_buffer import EagerEngine
from genlm_fast.backend.llm.paged_forward import PagedEngine, PagedForward, paged_unsupported
from genlm_fast.backend.llm.plan import Row
from genlm_fast.backend.llm.widen import compute_dtype

__all__ = ["Forwards"]


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
        return compute_dtype(self.model) if self.paged is not None else self.eager.kv_dtype

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
