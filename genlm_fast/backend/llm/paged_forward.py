"""Forwards of a transformers model over a `PagedKVPool`: the past read in place, new
states written by one scatter per layer, one-token steps replayed as CUDA graphs.

The model's own modules run (norms, rotary embeddings, projections, MLPs: every variant a
family has); only its attention is ours. For the length of a forward the model's attention
implementation is `ATTENTION`, registered with transformers: each layer's
``past_key_values.update`` (`_PoolCache`) scatters the new keys and values into their pool
slots and hands back the layer's whole pool, and the attention function runs
`genlm_fast.ops.paged_attention` over it with the batch's block tables and positions, which
reach it as the forward's ``paged_step`` keyword. A 4-D placeholder mask makes transformers
skip building masks (the positions are the mask).

A batch of rows that each add one token (an SMC or beam step) runs from a *bucket* of
``rows`` (a power of two) x ``width`` (block-table entries, a power of two): the bucket's
inputs are one device tensor (token ids, positions, slots, block tables) filled from the
host by one copy, and its forward is recorded once as a CUDA graph and replayed for every
later step of that bucket, whatever the rows' past lengths: the attention kernel reads each
row's length from the positions. Padded rows write to the scratch slot and attend to
nothing. Other batches (prefills, mixed lengths) run eagerly, the same computation.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from genlm_fast.backend.cache import kv_bytes_per_position
from genlm_fast.backend.llm.checks import check_finite_logits
from genlm_fast.backend.llm.graphs import CaptureFailed
from genlm_fast.backend.llm.paged_kv import PagedKVPool, PagedKVTrie
from genlm_fast.backend.llm.widen import compute_dtype
from genlm_fast.ops.paged_attention import PagedQuery, paged_attention

__all__ = ["ATTENTION", "PagedEngine", "PagedForward", "PagedStep", "paged_unsupported"]

ATTENTION = "genlm_fast_paged"
SCRATCH_SLOT = 0  # block 0 of every pool is scratch


@dataclass(frozen=True)
class PagedStep:
    """What the attention of one forward reads besides the pool: where each query token is
    (`PagedQuery`, the window left None: each layer says its own) and which backend runs."""

    where: PagedQuery
    backend: str


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: the paged op when the forward carries a
    ``paged_step``, else (a forward that is not ours, on a model shared with one) SDPA."""
    step = kwargs.pop("paged_step", None)
    if step is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    window = kwargs.get("sliding_window")
    where = step.where
    if window:
        where = PagedQuery(where.block_tables, where.positions, where.page, int(window))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return paged_attention(query, key, value, where, scaling, step.backend), None


_registered = False


def _register():
    global _registered
    if _registered:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)
    # (a forward not ours that runs while the switch holds builds SDPA's mask)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _registered = True


def paged_unsupported(model):
    """Why ``model``'s forwards cannot run over a paged pool (a str), or None."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(
        config, "add_cross_attention", False
    ):
        return "it has cross-attention"
    for key in ("attn_logit_softcapping", "scale_attn_by_inverse_layer_idx"):
        if getattr(config, key, None):
            return f"its attention scores are rescaled per layer ({key})"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "it reorders and upcasts its attention (reorder_and_upcast_attn)"
    attentions = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]
    if not attentions:
        return "no attention modules with a layer index were found"
    if any(m.config is not config for m in attentions):
        return "its attention modules do not share the model's config"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind not in ("full_attention", "sliding_attention") for kind in layer_types):
        return f"it has layers of other kinds than attention ({sorted(set(layer_types))})"
    return None


class _PoolCache:
    """The ``past_key_values`` of a paged forward: ``update`` writes a layer's new states to
    their slots (one scatter) and returns the layer's pool ``[slots, kv_heads, head_dim]``,
    keys and values."""

    is_compileable = False

    def __init__(self, kv, slots):
        self.kv = kv  # [layers, 2, slots, kv_heads, head_dim]
        self.slots = slots  # [B * T] int64, the slot of each new token, padding at scratch

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        B, H, T, D = key_states.shape
        new = torch.stack((key_states, value_states)).transpose(2, 3).reshape(2, B * T, H, D)
        layer = self.kv[layer_idx]
        layer.index_copy_(1, self.slots, new.to(layer.dtype))
        return layer[0], layer[1]

    def get_seq_length(self, layer_idx=0):
        return 0


class _Bucket:
    """A one-token step's fixed inputs (one int64 tensor, views per input), output and
    recorded forward."""

    def __init__(self, rows, width, device):
        self.rows, self.width = rows, width
        self.inputs = torch.zeros(rows * (4 + width), dtype=torch.long, device=device)
        ids, positions, attend, slots, tables = self.inputs.split(
            [rows, rows, rows, rows, rows * width]
        )
        self.input_ids = ids.view(rows, 1)
        self.position_ids = positions.view(rows, 1)
        self.attend = attend.view(rows, 1)
        self.slots = slots
        self.tables = tables.view(rows, width)
        self.graph = None
        self.logits = None


class PagedForward:
    """Forwards of ``model`` over a pool (module docstring).

    Args:
        model: the transformers model.
        keeps_logits (bool): its forward takes ``logits_to_keep``.
        capture (bool): record one-token steps as CUDA graphs (a model on a CUDA device);
            False runs the same buckets eagerly.
        backend (str): the `paged_attention` backend ("auto": Triton on CUDA).
    """

    MAX_BUCKETS = 8
    MIN_WIDTH = 4

    def __init__(self, model, keeps_logits, capture, backend="auto"):
        _register()
        self.model = model
        self.keeps_logits = keeps_logits
        self.capture = capture
        self.backend = backend
        self._buckets = OrderedDict()
        self._graph_pool = None

    def clear(self):
        """Forget the recorded forwards (after a change of weights or of the pool)."""
        self._buckets.clear()
        self._graph_pool = None

    def run(self, plan, pool, pad_id, buckets=True):
        """The planned forward (`PagedKVTrie.plan`): its copy-on-write copies, then the
        model over the pool; the last position's logits ``[B, V]`` (a tensor of its own).
        ``buckets``: a one-token step may run from its bucket (False for a forward through
        an adapter, which a recorded graph would not see)."""
        pool.copy_prefixes(plan.copies)
        rows = plan.rows
        if buckets and all(row.new == 1 for row in rows):
            return self._step(rows, pool, pad_id)
        return self._eager(rows, pool, pad_id)

    def _call(self, kv, input_ids, position_ids, attend, slots, tables, page):
        step = PagedStep(PagedQuery(tables, attend, page), self.backend)
        kwargs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": torch.zeros(
                (input_ids.shape[0], 1, 1, 1), dtype=kv.dtype, device=kv.device
            ),
            "past_key_values": _PoolCache(kv, slots),
            "use_cache": True,
            "paged_step": step,
        }
        if self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTENTION
        try:
            with torch.no_grad():
                return self.model(**kwargs).logits[:, -1]
        finally:
            config._attn_implementation = before

    def _eager(self, rows, pool, pad_id):
        T = max(row.new for row in rows)
        width = max(len(row.table) for row in rows)
        ids, position_ids, attend, slots, tables = [], [], [], [], []
        for row in rows:
            pad = T - row.new
            ids += [pad_id] * pad + row.ids[row.depth :]
            new_positions = list(range(row.depth, len(row.ids)))
            position_ids += [0] * pad + new_positions
            attend += [-1] * pad + new_positions
            slots += [SCRATCH_SLOT] * pad + row.slots
            tables += row.table + [0] * (width - len(row.table))
        device = pool.kv.device
        host = torch.tensor(ids + position_ids + attend + slots + tables, dtype=torch.long)
        flat = host.to(device, non_blocking=True)
        B = len(rows)
        ids_t, pos_t, att_t, slots_t, tables_t = flat.split([B * T] * 4 + [B * width])
        return self._call(
            pool.kv,
            ids_t.view(B, T),
            pos_t.view(B, T),
            att_t.view(B, T),
            slots_t,
            tables_t.view(B, width),
            pool.page,
        ).clone()

    def _step(self, rows, pool, pad_id):
        B = len(rows)
        need = max(len(row.table) for row in rows)
        bucket = self._bucket(
            1 << (B - 1).bit_length(), max(self.MIN_WIDTH, 1 << (need - 1).bit_length()), pool
        )
        R, W = bucket.rows, bucket.width
        pad = R - B
        ids = [row.ids[-1] for row in rows] + [pad_id] * pad
        positions = [row.depth for row in rows]
        attend = positions + [-1] * pad
        slots = [row.slots[0] for row in rows] + [SCRATCH_SLOT] * pad
        tables = []
        for row in rows:
            tables += row.table + [0] * (W - len(row.table))
        tables += [0] * (W * pad)
        host = torch.tensor(ids + positions + [0] * pad + attend + slots + tables, dtype=torch.long)
        bucket.inputs.copy_(host, non_blocking=True)
        if not self.capture:
            logits = self._bucket_call(bucket, pool)
        else:
            if bucket.graph is None:
                self._record(bucket, pool)
            bucket.graph.replay()
            logits = bucket.logits
        return logits[:B].clone()

    def _bucket(self, rows, width, pool):
        key = (rows, width)
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        while len(self._buckets) >= self.MAX_BUCKETS:
            self._buckets.popitem(last=False)
        bucket = self._buckets[key] = _Bucket(rows, width, pool.kv.device)
        return bucket

    def _bucket_call(self, bucket, pool):
        return self._call(
            pool.kv,
            bucket.input_ids,
            bucket.position_ids,
            bucket.attend,
            bucket.slots,
            bucket.tables,
            pool.page,
        )

    def _record(self, bucket, pool):
        """Record the bucket's forward as a CUDA graph (its inputs hold a real step: the
        warm-up runs write the same states to the same slots as the replay)."""
        from genlm_fast.backend.llm.graphs import CaptureFailed

        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # what the kernels allocate on first use, before recording
                self._bucket_call(bucket, pool)
        current.wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                bucket.logits = self._bucket_call(bucket, pool)
        except Exception as exc:
            self.clear()
            raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
        bucket.graph = graph


class PagedEngine:
    """The engine of ``paged_kv=True``: every forward of a model over its adapters' paged
    pools (`PagedForward`). Rows are planned against a `PagedKVTrie` (which blocks they
    read, which they write), run, and their states committed to the trie, or the blocks
    given back if the forward failed."""

    name = "paged"
    PAGE = 16  # positions per block of the pool

    def __init__(self, model, forward: PagedForward, pad_id):
        self.model = model
        self.forward = forward
        self.pad_id = pad_id

    def new_trie(self, tokens, max_bytes):
        """A `PagedKVTrie` over a pool as large as the key/value budget."""
        model = self.model
        dtype = compute_dtype(model)
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
