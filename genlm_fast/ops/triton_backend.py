"""Triton backend: launches the fused trie-reduction kernels of ``genlm_fast.kernels``.

``trie_reduce`` follows the backend contract of ``genlm_fast.ops.dispatch``. Runs on CUDA
tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported; a correctness tool, far slower than torch).

Paths (see the kernel module's docstring for the algorithm):

* ``log_mass`` (any float dtype) and float32 ``sum``: ``_tile_ranges_dot`` (range sums as a
  TF32-split product with the 0/1 membership mask, exact fallback for the rare ranges that
  need it), after ``_row_lse_partial`` for ``log_mass``.
* ``max``: ``_tile_ranges_max`` (a sparse table of window maxima per tile, two lookups
  per range).
* float64 ``sum``: ``_tile_ranges_dense``.
* then ``_spanning_nodes`` when the trie has nodes crossing tile boundaries.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from genlm_fast.kernels import trie_reduce as kernels
from genlm_fast.ops.dispatch import result_dtype
from genlm_fast.ops.layout import SPAN_NARROW_TILES

CHECKS_ROWS = False  # the dispatcher checks every row before this backend runs

_CODES = {
    "sum": kernels.REDUCE_SUM.value,
    "max": kernels.REDUCE_MAX.value,
    "log_mass": kernels.REDUCE_LOG_MASS.value,
}

LSE_BLOCK = 1024  # elements per iteration of the row-normaliser kernel
LSE_MAX_SPLIT = 64  # slices per row for the normaliser (a power of two)
DENSE_RB = 32  # ranges per chunk in the dense tile kernel
DOT_RB = 64  # ranges per chunk (the N side of the mask product) in the dot tile kernel
DOT_UB = 64  # unit ranges per chunk (one gather from the registers) in the dot tile kernel
DOT_SUB = 16  # ranges per step of the dot kernel's dense rewrite (sum with inf weights)
# Rows per dot-kernel program (the M side of the product; >= 16 for tl.dot) and its warps,
# and the max kernel's rows: the fastest of `python -m tools.gpu.bench --sweep` on the
# Llama-3 vocabulary (docs/gpu.md lists the runs). Taller blocks need more registers than an
# SM can give several programs (tests/ops/test_triton_sm90.py prints the counts).
DOT_ROWS = 16
DOT_WARPS = 4
MAX_ROWS = 8  # rows per program of the max kernel (its sparse table: 7 x [8, 64] values)
MAX_RB = 32  # ranges per chunk of the max kernel
MAX_WARPS = 4
SPAN_BLOCK = 64  # narrow spanning nodes per program
SPAN_TILES = SPAN_NARROW_TILES  # tile totals per narrow node: all of them, in one load
SPAN_WIDE_TILES = 512  # tile totals per iteration of a wide node's program
MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second axis, where the kernels put rows


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: few programs is fastest


def tile_kernel(reduction: str, dtype: torch.dtype) -> str:
    """Which tile kernel runs for inputs of ``dtype`` (the dispatcher hands sum/max float32
    or float64): "dot", "max" or "dense"."""
    if reduction == "max":
        return "max"
    return "dot" if reduction == "log_mass" or dtype == torch.float32 else "dense"


def _row_lse_partials(values: torch.Tensor, acc_dtype: torch.dtype):
    """Launch ``_row_lse_partial``: (pmax, psum) of shape [B, SPLIT] and SPLIT."""
    B, C = values.shape
    block = LSE_BLOCK if values.device.type == "cuda" else 128  # interpreter: exercise SPLIT
    blocks = _cdiv(C, block)
    want = _cdiv(4 * _num_sms(values.device), B)
    split = max(1, min(_next_pow2(want), LSE_MAX_SPLIT, _next_pow2(blocks)))
    if values.device.type == "cpu":
        split = min(split, 2) if blocks > 1 else 1  # interpreter: keep the grid tiny
    chunk = _cdiv(blocks, split) * block
    pmax = torch.empty(B, split, dtype=acc_dtype, device=values.device)
    psum = torch.empty(B, split, dtype=acc_dtype, device=values.device)
    kernels._row_lse_partial[(B, split)](
        values,
        pmax,
        psum,
        C,
        chunk,
        SPLIT=split,
        BLOCK=block,
        ACC=_tl_dtype(acc_dtype),
        num_warps=4,
    )
    return pmax, psum, split


def trie_reduce(
    values: torch.Tensor,
    arrays: dict,
    reduction: str,
    *,
    num_nodes: int,
    num_scratch: int,
    tile: int,
    float64_result: bool = False,
):
    if float64_result:  # the kernels give float64 for float64 values
        values = values.double()
    B = values.shape[0]
    out = torch.empty(
        B, num_nodes, dtype=result_dtype(reduction, values.dtype), device=values.device
    )
    # rows are a grid's second axis, which CUDA caps at 65535: launch in row chunks
    for r0 in range(0, B, MAX_GRID_ROWS):
        r1 = min(B, r0 + MAX_GRID_ROWS)
        _reduce_rows(
            values[r0:r1],
            out[r0:r1],
            arrays,
            reduction,
            num_nodes=num_nodes,
            num_scratch=num_scratch,
            tile=tile,
        )
    return out, None


def _reduce_rows(
    values: torch.Tensor,
    out: torch.Tensor,
    arrays: dict,
    reduction: str,
    *,
    num_nodes: int,
    num_scratch: int,
    tile: int,
) -> None:
    """Launch the kernels for at most MAX_GRID_ROWS contiguous rows, into ``out``."""
    device = values.device
    B, C = values.shape
    out_dtype = out.dtype

    leaf_token = arrays["leaf_token"]
    tile_range_ptr = arrays["tile_range_ptr"]
    n_tiles = tile_range_ptr.numel() - 1
    L = leaf_token.numel()
    S = arrays["span_node"].numel()
    scratch = torch.empty(B, max(1, num_scratch), dtype=out_dtype, device=device)
    NS = scratch.shape[1]
    code = _CODES[reduction]

    # Triton launches on the current CUDA device
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        if reduction == "log_mass":
            acc_dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
            pmax, psum, split = _row_lse_partials(values, acc_dtype)
        else:
            acc_dtype = values.dtype
            pmax = psum = out  # unused by the kernels
            split = 1
        kind = tile_kernel(reduction, values.dtype)
        # every tile kernel's trailing arguments: the ranges, and where their sums go
        ranges = (
            arrays["range_start"],
            arrays["range_end"],
            arrays["range_dest"],
            out,
            num_nodes,
            scratch,
            NS,
        )
        # the row-blocked kernels' (dot, max) leading ones
        tiled = (values, B, C, L, leaf_token, tile_range_ptr, arrays["tile_unit_end"], *ranges)
        if kind == "dot":
            kernels._tile_ranges_dot[(n_tiles, _cdiv(B, DOT_ROWS))](
                *tiled,
                pmax,
                psum,
                LOG_MASS=(reduction == "log_mass"),
                SPLIT=split,
                TILE=tile,
                ROWS=DOT_ROWS,
                RB=DOT_RB,
                UB=DOT_UB,
                SUB=DOT_SUB,
                ACC=_tl_dtype(acc_dtype),
                FAST_MIN_MASS=kernels._FAST_MIN_MASS,
                LEVEL_GAP=kernels._LEVEL_GAP,
                num_warps=DOT_WARPS,
            )
        elif kind == "max":
            kernels._tile_ranges_max[(n_tiles, _cdiv(B, MAX_ROWS))](
                *tiled,
                TILE=tile,
                ROWS=MAX_ROWS,
                RB=MAX_RB,
                num_warps=MAX_WARPS,
            )
        else:
            kernels._tile_ranges_dense[(n_tiles, B)](
                values,
                C,
                L,
                leaf_token,
                tile_range_ptr,
                *ranges,
                pmax,
                psum,
                REDUCTION=code,
                SPLIT=split,
                TILE=tile,
                RB=DENSE_RB,
                ACC=_tl_dtype(acc_dtype),
                num_warps=4,
            )
        if S > 0:
            narrow = arrays["span_narrow"]
            narrow_blocks = _cdiv(narrow, SPAN_BLOCK)
            kernels._spanning_nodes[(narrow_blocks + S - narrow, B)](
                scratch,
                NS,
                out,
                num_nodes,
                S,
                narrow,
                narrow_blocks,
                arrays["span_node"],
                arrays["span_left"],
                arrays["span_right"],
                arrays["span_tile_lo"],
                arrays["span_tile_hi"],
                REDUCTION=code,
                SB=SPAN_BLOCK,
                TB=SPAN_TILES,
                WIDE_TB=SPAN_WIDE_TILES,
                num_warps=4,
            )
