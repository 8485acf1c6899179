"""``paged_attention``: attention of query tokens over a paged key/value pool, read in place.

One layer's keys and values live in a pool ``[slots, kv_heads, head_dim]`` cut into blocks
of ``page`` slots; row ``b``'s position ``n`` is in slot ``block_tables[b, n // page] *
page + n % page``. Query token ``(b, t)`` at absolute position ``positions[b, t]`` attends
to that row's positions ``[max(0, pos + 1 - window), pos]`` (its own key and value are
written to the pool before the attention), so decoding steps, prefills and mixed batches are
one computation; a position of -1 marks padding, whose output is 0.

Backends: ``reference`` (plain torch: the visible slots gathered into a dense batch, a
float32 softmax; also the CPU path) and ``triton`` (``genlm_fast.kernels.paged_attention``:
the pool read in place, one program per query token and key/value head, an online softmax).
``"auto"`` picks Triton on CUDA when it is installed. Both compute in float32 for a 16- or
32-bit pool (the reference in float64 for a float64 one, which Triton does not take) and
return the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genlm_fast.ops.dispatch import resolve_reference_or_triton

BACKENDS = ("reference", "triton")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)
NO_WINDOW = 2**31 - 1  # the window of full attention, as the kernel takes it
TRITON_BLOCK_N = 32  # positions per step of the kernel's walk over a row's past


@dataclass(frozen=True)
class PagedQuery:
    """Where a batch's query tokens sit in their rows' pasts.

    Attributes:
        block_tables: ``[B, W]`` int32/int64, row ``b``'s blocks in position order (entries
            past a row's length are never read).
        positions: ``[B, T]`` int32/int64, each query token's absolute position; -1 marks
            padding.
        page: slots per block.
        window: a sliding window's width (positions ``pos - window + 1 .. pos`` visible), or
            None for full causal attention.
    """

    block_tables: torch.Tensor
    positions: torch.Tensor
    page: int
    window: int | None = None


def check_inputs(query, k_pool, v_pool, where: PagedQuery):
    """Raise a clear error for inputs the op does not take (shapes, dtypes, devices)."""
    for name, x in (("query", query), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT:
            raise TypeError(f"{name} must be a float tensor, got {x.dtype}")
    if query.dim() != 4:
        raise ValueError(f"query must be [B, heads, T, head_dim], got shape {tuple(query.shape)}")
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both be [slots, kv_heads, head_dim], got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if k_pool.dtype != v_pool.dtype:
        raise TypeError(f"k_pool is {k_pool.dtype} but v_pool is {v_pool.dtype}")
    if k_pool.stride(2) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError("k_pool and v_pool must have unit-stride head_dim and equal strides")
    B, heads, T, D = query.shape
    slots, kv_heads, pool_d = k_pool.shape
    if pool_d != D:
        raise ValueError(f"query's head_dim is {D} but the pool's is {pool_d}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    tables, positions = where.block_tables, where.positions
    for name, x in (("block_tables", tables), ("positions", positions)):
        if not isinstance(x, torch.Tensor) or x.dtype not in _INDEX or x.dim() != 2:
            raise TypeError(f"{name} must be a 2-D int32/int64 tensor")
    if tables.shape[0] != B or tuple(positions.shape) != (B, T):
        raise ValueError(
            f"block_tables {tuple(tables.shape)} and positions {tuple(positions.shape)} do "
            f"not match the query's {B} rows x {T} tokens"
        )
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", tables)):
        if x.device != query.device:
            raise ValueError(f"{name} is on {x.device} but the query is on {query.device}")
    if positions.device != query.device:
        raise ValueError(f"positions is on {positions.device} but the query is on {query.device}")
    if not isinstance(where.page, int) or where.page < 1 or slots % where.page:
        raise ValueError(f"page must be a positive divisor of the pool's {slots} slots")
    if where.window is not None and (not isinstance(where.window, int) or where.window < 1):
        raise ValueError(f"window must be None or a positive int, got {where.window!r}")


def paged_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    where: PagedQuery,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``query`` ``[B, heads, T, head_dim]`` over the pool; returns
    ``[B, T, heads, head_dim]`` in the query's dtype (the layout a decoder layer's output
    projection reads). See the module docstring for the semantics."""
    check_inputs(query, k_pool, v_pool, where)
    chosen = resolve_reference_or_triton("paged_attention", backend, query.device)
    if chosen == "triton" and torch.float64 in (query.dtype, k_pool.dtype):
        raise TypeError("the 'triton' paged_attention backend takes 16- and 32-bit tensors")
    if chosen == "triton":
        return _triton(query, k_pool, v_pool, where, float(scale))
    return _reference(query, k_pool, v_pool, where, float(scale))


def _reference(query, k_pool, v_pool, where, scale):
    B, heads, T, D = query.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    positions = where.positions.long()
    out = query.new_zeros((B, T, heads, D))
    span = int(positions.max()) + 1 if positions.numel() else 0
    if span <= 0:
        return out
    if span > where.block_tables.shape[1] * where.page:
        raise IndexError(
            f"a query at position {span - 1} is past what block tables of "
            f"{where.block_tables.shape[1]} blocks x {where.page} slots reach"
        )
    n = torch.arange(span, device=query.device)
    blocks = where.block_tables.long()[:, n // where.page]
    slots = blocks * where.page + n % where.page  # [B, span]
    window = NO_WINDOW if where.window is None else where.window
    visible = (n[None, None, :] <= positions[:, :, None]) & (
        n[None, None, :] > positions[:, :, None] - window
    )  # [B, T, span]
    wide = torch.promote_types(torch.promote_types(query.dtype, k_pool.dtype), torch.float32)
    keys = k_pool[slots].to(wide)  # [B, span, kv_heads, D]
    values = v_pool[slots].to(wide)
    q = query.to(wide).reshape(B, kv_heads, group, T, D)
    scores = torch.einsum("bhgtd,bnhd->bhgtn", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total > 0, total, 1.0)
    # an invisible slot weighs exactly 0, and its value (whatever a free slot holds) is 0 too
    values = torch.where(visible.any(dim=1)[:, :, None, None], values, 0.0)
    mixed = torch.einsum("bhgtn,bnhd->bhgtd", weights, values).reshape(B, heads, T, D)
    return mixed.transpose(1, 2).to(query.dtype)


def _triton(query, k_pool, v_pool, where, scale):
    import triton

    from genlm_fast.kernels import paged_attention as kernel

    B, heads, T, D = query.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    out = torch.empty((B, T, heads, D), dtype=query.dtype, device=query.device)
    if query.stride(3) != 1:
        query = query.contiguous()
    positions = where.positions
    if not positions.is_contiguous():
        positions = positions.contiguous()
    window = NO_WINDOW if where.window is None else where.window
    if B * T == 0:
        return out
    kernel._paged_attention[(B * T, kv_heads)](
        query,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        k_pool,
        v_pool,
        k_pool.stride(0),
        k_pool.stride(1),
        where.block_tables,
        where.block_tables.stride(0),
        positions,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        T,
        scale,
        window,
        GROUP=group,
        HEAD_DIM=D,
        PAGE=where.page,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_N=TRITON_BLOCK_N,
    )
    return out
