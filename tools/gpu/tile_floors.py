"""Memory floors in the CUDA tile kernel's own access pattern (for ``tools.gpu.memory_floors``).

The tile kernel moves the output in pieces: a block of (tile, 32 rows) writes, for each of
its rows, the tile's block of node ids, [tile_node_lo[t], tile_node_lo[t + 1]) (~200 ids,
~800 bytes, on Llama-3), and, staged, first reads its rows' values of the tile's leaves as
one contiguous stretch (tile x rows values). torch's ``fill_`` and ``copy_`` stream whole
rows instead, so they do not say whether that pattern alone costs bandwidth. These Triton
kernels move exactly the tile kernel's bytes in its pattern, with no reduction at all:

- ``write``: each program writes ones to its rows' id blocks of ``tiles`` consecutive tiles
  (1: the tile kernel's blocks; 4: what blocks of 4 tiles, 4x longer segments, would give);
- ``read_write``: each program reads its tile's staged stretch and writes each row's sum of
  it to the row's id block (a stand-in for the tile kernel with no work between the two).

The results are checked (``expected``) before they are timed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32  # the CUDA tile kernel's rows per block from B = 32 on
IDS = 256  # node ids a program writes per step (Llama-3: 201 a tile on average)


@triton.jit
def _tile_pattern_kernel(
    staged_ptr,
    out_ptr,
    tile_node_lo_ptr,
    n_tiles,
    B,
    C,
    N,
    L,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    IDS: tl.constexpr,
    TILES: tl.constexpr,
    READ: tl.constexpr,
):
    first_row = tl.program_id(1) * ROWS
    rows = tl.minimum(B - first_row, ROWS)
    r = tl.arange(0, ROWS)
    row_ok = r < rows
    out_rows = out_ptr + (first_row + r).to(tl.int64) * N  # [ROWS] pointers
    for k in tl.static_range(TILES):
        t = tl.program_id(0) * TILES + k
        if t < n_tiles:
            value = tl.full([ROWS], 1.0, tl.float32)
            if READ:
                # the tile's stretch of the staged rows: [L][rows] from first_row * C
                p = tl.arange(0, TILE)
                base = t * TILE
                src = (
                    staged_ptr
                    + first_row.to(tl.int64) * C
                    + (base + p[:, None]) * rows
                    + r[None, :]
                )
                x = tl.load(src, mask=((base + p[:, None]) < L) & row_ok[None, :], other=0.0)
                value = tl.sum(x, axis=0)
            lo = tl.load(tile_node_lo_ptr + t)
            hi = tl.load(tile_node_lo_ptr + t + 1)
            block = value[:, None] + tl.zeros([ROWS, IDS], tl.float32)
            for i0 in range(lo, hi, IDS):
                ids = i0 + tl.arange(0, IDS)
                tl.store(
                    out_rows[:, None] + ids[None, :],
                    block,
                    mask=row_ok[:, None] & (ids[None, :] < hi),
                    eviction_policy="evict_first",
                )


def tile_pattern(
    out: torch.Tensor,
    tile_node_lo: torch.Tensor,
    tile: int,
    L: int,
    *,
    tiles: int = 1,
    staged: torch.Tensor | None = None,
) -> None:
    """Write ``out`` [B, N] float32 in the tile kernel's pattern (see the module docstring);
    ``staged`` [B * C] float32 (C >= L), laid out as the row pass stages: read first."""
    B, N = out.shape
    n_tiles = tile_node_lo.numel() - 1
    C = staged.numel() // B if staged is not None else 0
    if staged is not None and C < L:
        raise ValueError(f"staged holds {C} columns a row, fewer than the {L} leaves")
    grid = (triton.cdiv(n_tiles, tiles), triton.cdiv(B, ROWS))
    _tile_pattern_kernel[grid](
        staged if staged is not None else out,
        out,
        tile_node_lo,
        n_tiles,
        B,
        C,
        N,
        L,
        TILE=tile,
        ROWS=ROWS,
        IDS=IDS,
        TILES=tiles,
        READ=staged is not None,
        num_warps=8,
    )


def expected(
    B: int, N: int, tile_node_lo, tile: int, L: int, staged: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``tile_pattern`` writes, in plain torch: ones, or each row's sum of the staged
    stretch of the tile that owns the node."""
    lo = torch.as_tensor(tile_node_lo, dtype=torch.int64).cpu()
    n_tiles = lo.numel() - 1
    owner = torch.repeat_interleave(torch.arange(n_tiles), lo[1:] - lo[:-1])
    if owner.numel() != N:
        raise ValueError(f"tile_node_lo covers {owner.numel()} ids, not {N}")
    if staged is None:
        return torch.ones(B, N)
    C = staged.numel() // B
    stretch = staged.detach().cpu().double()
    sums = torch.zeros(B, n_tiles, dtype=torch.float64)
    for first in range(0, B, ROWS):
        rows = min(B - first, ROWS)
        block = stretch[first * C : first * C + L * rows].view(L, rows)  # [L][rows]
        pad = torch.zeros(n_tiles * tile - L, rows, dtype=torch.float64)
        sums[first : first + rows] = torch.cat([block, pad]).view(n_tiles, tile, rows).sum(1).T
    return sums[:, owner].float()
