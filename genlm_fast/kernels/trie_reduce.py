"""Triton kernels for the trie reduction (``sum`` / ``max`` / ``log_mass``) over a compiled
``TrieLayout`` (see ``genlm_fast/ops/layout.py``).

One module past 500 lines: its kernels are one algorithm (below, about a hundred lines) and
share the ``@triton.jit`` helpers that they inline.

Algorithm
---------
The leaves of the trie, sorted by post-order node id, form the *leaf order*; every node's
leaves are one contiguous slice of it. The leaf order is cut into tiles of ``TILE`` positions
and every node range is pre-split (by the layout) into *local ranges* lying inside one tile.
A tile's *unit* ranges (one leaf: ~80% of all ranges on real vocabularies, the leaves and the
single-child chains above them) come first in its list: the tile kernels copy their leaf's own
value (a gather from the registers; exact, also for ``log_mass``: the log-probability itself)
and run the reductions below only on the other ranges.

1. ``_row_lse_partial`` (``log_mass`` only), grid (B, SPLIT): each program reads one
   contiguous slice of a logit row once, coalesced, and keeps an online (max, sum-exp) pair
   per lane with ONE exp per element (``s = x > m ? s*e^(m-x) + 1 : s + e^(x-m)``). It writes
   one (max, sum) partial per slice; the tile kernels merge the SPLIT partials of their rows
   (cheap) instead of a third launch. Splitting rows keeps >= ~4 programs per SM even at B=1.

2. ``_tile_ranges_dot`` (``log_mass``, float32 ``sum``), grid (n_tiles, cdiv(B, ROWS)):
   a program gathers the TILE leaf values ``x[row, leaf_token[pos]]`` of ROWS rows once
   (masked past L), turns them into non-negative terms ``w`` and reduces ALL the tile's local
   ranges as a matrix product ``S[rows, ranges] = w[rows, TILE] @ M[TILE, ranges]`` where
   ``M`` is the 0/1 membership mask ``start <= pos < end`` (built on the fly from the CSR
   range lists, RB ranges at a time). A masked dense reduction would cost TILE ALU ops per
   (row, range); the mask product moves that work onto the tensor cores and builds each mask
   once for ROWS rows.
   *Exactness.* ``M`` is exactly 0/1, so only ``w`` is split: ``w = hi + lo`` with ``hi`` =
   ``w`` truncated to 10 mantissa bits (exact in TF32) and ``lo`` = the exact remainder,
   rounded to TF32 (relative error of ``w`` <= 2^-21), two TF32 products accumulate in fp32.
   All terms are >= 0 for ``log_mass`` (no cancellation).
   ``log_mass``: ``v = (x - big) - s`` (fp32, see *Normaliser* below), ``m`` = tile max
   of ``v`` per row, ``w = exp(v - m)`` in [0, 1] (TILE exps per row and tile, not per
   range); node = ``m + log(S)``. This is exact to fp32 rounding whenever ``S >= 1e-24``:
   then the range's own max is >= m - 60 nats, and every term that exp() could have flushed
   (< e^-87 relative to m) is < e^-27 relative to the range's mass. Ranges with
   ``S < 1e-24`` (far below their tile's max, or all -inf) are redone in a second pass of
   the same program, only for the rows that have one, with the shift lowered level by
   level to the largest leaf still below ``shift - 55`` (same mask, same split product,
   ``exp`` capped at e^80); each level is exact for the ranges it lifts above 1e-24 and
   passes at least one leaf, so it ends within TILE + 1 levels (usually 1-2, also for
   -1e30 "masks"); a range left open when no leaf remains below holds only -inf leaves.
   Only rows whose finite leaves in the tile span > 55 nats can need it (elsewhere
   ``S < 1e-24`` means ``S = 0``: all -inf, which the fast path already gets right), so it
   is rare for real logits and free for -inf masks, but it keeps the result exact in log
   space whatever the logits' spread.
   ``sum``: ``w`` = the weights; rows holding a non-finite weight in this tile take the
   dense path (inf * 0 in a product would give NaN).
   *Normaliser.* The row's ``lse`` is never formed as one number: the tile kernels merge
   the partials into ``big`` (the row max, a logit, so exact in ACC) and
   ``s = log(sum exp(x - big))`` in ``[0, log C]``, and take ``v = (x - big) - s``. Rounding
   ``lse = big + s`` to float32 would put half an ulp of ``|lse|`` into every node (2.4e-4
   for logits near 6000: logits / a small temperature, fp16 logits near 65000). Here
   ``x - big`` is exact (Sterbenz) or rounded relative to ``|x - big|``, ``s`` carries
   an ulp of ``log C``, so ``v`` is good to an ulp or two of ``|v|`` whatever the offset.

3. ``_tile_ranges_max`` (``max``), grid (n_tiles, cdiv(B, ROWS)): a sparse table per row
   and tile, ``t_j[p]`` = max of the window ``[p, p + 2^j)``, built by doubling
   (``t_{j+1}[p] = max(t_j[p], t_j[p + 2^j])``, log2(TILE) register gathers); then any range
   ``[s, e)`` of length ``n`` is ``max(t_k[s], t_k[e - 2^k])`` with ``k = floor(log2 n)``:
   two overlapping windows that cover it exactly, so the result is exact. Per range that is
   two gathers per level instead of the dense path's TILE masked compares.

4. ``_tile_ranges_dense`` (float64 ``sum``, and an optional fallback for everything), grid
   (n_tiles, B): the straightforward version; per chunk of RB ranges it builds the [RB, TILE]
   mask and reduces along the tile axis (sum; max; logsumexp as max, then sum exp(v - max),
   guarded for -inf).

   Every local range is written once, to ``out[row, dest]`` when ``dest >= 0`` or to the
   per-row scratch slot ``-1 - dest`` (tile totals and left/right pieces of spanning nodes).
   Empty ranges give the identity: 0 for sum and max, -inf for log_mass.

5. ``_spanning_nodes``, grid (narrow blocks + wide nodes, B): a node whose leaves cross
   tile boundaries combines its left piece, its right piece and the totals of the whole
   tiles ``[lo, hi)`` from scratch. Spanning nodes are sorted by tile count and most cover
   a few tiles (Llama-3: 5,171 nodes, 5,591 whole tiles in all): the *narrow* ones (at most
   ``SPAN_NARROW_TILES``, a prefix) go SPAN_BLOCK to a program, one chunk of tiles each; the
   few wide ones (the root: every tile) one to a program, SPAN_WIDE_TILES tiles at a time.
   Sums accumulate in float64 (the root over 128k leaves stays within 1e-7 of exact);
   log_mass keeps an online (max, float64 sum-exp) pair; max is exact.

No [B, C] intermediate is ever written: the only traffic is reading the logits (twice for
``log_mass``: once coalesced for the normaliser, once gathered in leaf order, mostly from
L2), the small index arrays (once per ROWS rows) and writing ``out`` ([B, N], coalesced:
within a tile, local node ids are nearly consecutive). Cache hints keep it that way: the
logits are loaded evict-last (each 32-byte sector is gathered by ~8 different tiles), the
output, never read again, is stored evict-first (``.cs``), so ~100 MB of output at B=64
does not push the logits out of L2 between those gathers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from genlm_fast.kernels.log_softmax_rows import lse_merge, online_lse_update

# the REDUCTION constexpr of every kernel (a kernel reads globals only when they are constexpr)
REDUCE_SUM = tl.constexpr(0)
REDUCE_MAX = tl.constexpr(1)
REDUCE_LOG_MASS = tl.constexpr(2)

# a range whose mass relative to its tile's max is below this is redone with a lower shift
_FAST_MIN_MASS = 1e-24
_LEVEL_GAP = 55.0  # e^-55 = 1.3e-24 >= _FAST_MIN_MASS: a range whose max is within this of
# the shift is always lifted to _FAST_MIN_MASS


@triton.jit
def _row_lse_partial(
    x_ptr, pmax_ptr, psum_ptr, C, chunk, SPLIT: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr
):
    """Per (row, slice): max and sum of exp(x - max) over x[row, slice], one exp per element."""
    row = tl.program_id(0)
    sp = tl.program_id(1)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, C)
    base = x_ptr + row.to(tl.int64) * C
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), ACC)
    s = tl.zeros([BLOCK], ACC)
    for k in range(lo, hi, BLOCK):
        idx = k + offs
        x = tl.load(
            base + idx, mask=idx < hi, other=float("-inf"), eviction_policy="evict_last"
        ).to(ACC)
        m, s = online_lse_update(m, s, x)
    big, tot = lse_merge(m, s)
    tl.store(pmax_ptr + row * SPLIT + sp, big)
    tl.store(psum_ptr + row * SPLIT + sp, tot)


@triton.jit
def _load_ranges(start_ptr, end_ptr, dest_ptr, c, r1, RB: tl.constexpr):
    """Local ranges [c, c + RB) of a tile's list, which ends at r1: (valid, start, end, dest)."""
    ridx = c + tl.arange(0, RB)
    r_ok = ridx < r1
    start = tl.load(start_ptr + ridx, mask=r_ok, other=0)
    end = tl.load(end_ptr + ridx, mask=r_ok, other=0)
    dest = tl.load(dest_ptr + ridx, mask=r_ok, other=0)
    return r_ok, start, end, dest


@triton.jit
def _unit_positions(
    start_ptr, dest_ptr, c, u1, t, ROWS: tl.constexpr, UB: tl.constexpr, TILE: tl.constexpr
):
    """Unit ranges [c, c + UB) of a tile's list, which end at u1: (valid, dest, their leaf's
    tile-local position broadcast over ROWS rows, for a gather along the tile axis)."""
    uidx = c + tl.arange(0, UB)
    u_ok = uidx < u1
    start = tl.load(start_ptr + uidx, mask=u_ok, other=0)
    dest = tl.load(dest_ptr + uidx, mask=u_ok, other=0)
    local = tl.minimum(tl.maximum(start - t * TILE, 0), TILE - 1)  # clamped for the padding
    return u_ok, dest, tl.broadcast_to(local[None, :], (ROWS, UB))


@triton.jit
def _store_ranges(out_rows, scr_rows, dest, res, ok):
    """res to out[dest] where dest >= 0, to scratch[-1 - dest] where dest < 0 (masked by ok);
    broadcasts over rows when out_rows / scr_rows are [ROWS, 1] row pointers."""
    tl.store(out_rows + dest, res, mask=ok & (dest >= 0), cache_modifier=".cs")
    tl.store(scr_rows + (-1 - dest), res, mask=ok & (dest < 0))


@triton.jit
def _dense_reduce(v, pos, start, end, REDUCTION: tl.constexpr):
    """Reduce v[TILE] over each range [start, end) of a chunk ([RB]) -> [RB]."""
    member = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    if REDUCTION == REDUCE_SUM:
        res = tl.sum(tl.where(member, v[None, :], 0.0), axis=1)
    elif REDUCTION == REDUCE_MAX:
        res = tl.max(tl.where(member, v[None, :], float("-inf")), axis=1)
        res = tl.where(end > start, res, 0.0)
    else:
        peak = tl.max(tl.where(member, v[None, :], float("-inf")), axis=1)
        peak_safe = tl.where(peak == float("-inf"), 0.0, peak)
        tot = tl.sum(tl.where(member, tl.exp(v[None, :] - peak_safe[:, None]), 0.0), axis=1)
        res = tl.where(peak == float("-inf"), float("-inf"), peak_safe + tl.log(tot))
    return res


@triton.jit
def _row_normaliser(pmax_ptr, psum_ptr, rows, row_ok, SPLIT: tl.constexpr, ACC: tl.constexpr):
    """Merge the SPLIT (max, sum) partials of each row: (big, s) with lse = big + s, big the
    row max (a logit: exact; 0 for an all -inf row or rows past B), s = log(sum) in
    [0, log C] (0 for rows past B). Kept as a pair: see the module docstring."""
    sp = tl.arange(0, SPLIT)
    pmask = row_ok[:, None] & (sp[None, :] < SPLIT)
    poff = rows[:, None] * SPLIT + sp[None, :]
    pm = tl.load(pmax_ptr + poff, mask=pmask, other=float("-inf")).to(ACC)
    ps = tl.load(psum_ptr + poff, mask=pmask, other=0.0).to(ACC)
    big = tl.max(pm, axis=1)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    s = tl.log(tl.sum(ps * tl.exp(pm - big_safe[:, None]), axis=1))
    return big_safe, tl.where(row_ok, s, 0.0)


@triton.jit
def _split_tf32(w):
    """w = hi + lo: hi exact in TF32 (10 mantissa bits), lo the exact remainder rounded to
    nearest TF32, so hi + lo carries ~21 bits whatever the tensor cores do to fp32 inputs."""
    hi = (w.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    lo = w - hi
    lo = ((lo.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
    return hi, lo


@triton.jit
def _tile_ranges_dense(
    x_ptr,
    C,
    L,
    leaf_token_ptr,
    range_ptr_ptr,
    range_start_ptr,
    range_end_ptr,
    range_dest_ptr,
    out_ptr,
    N,
    scratch_ptr,
    NS,
    pmax_ptr,
    psum_ptr,
    REDUCTION: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE: tl.constexpr,
    RB: tl.constexpr,
    ACC: tl.constexpr,
):
    """One (tile, row) per program: masked [RB, TILE] reductions, RB ranges at a time."""
    t = tl.program_id(0)
    row = tl.program_id(1)
    pos = t * TILE + tl.arange(0, TILE)
    pos_ok = pos < L
    tok = tl.load(leaf_token_ptr + pos, mask=pos_ok, other=0)
    x_row = x_ptr + row.to(tl.int64) * C
    if REDUCTION == REDUCE_LOG_MASS:
        sp = tl.arange(0, SPLIT)
        pm = tl.load(pmax_ptr + row * SPLIT + sp).to(ACC)
        ps = tl.load(psum_ptr + row * SPLIT + sp).to(ACC)
        big, total = lse_merge(pm, ps)
        big_safe = tl.where(big == float("-inf"), 0.0, big)
        s = tl.log(total)  # lse = big_safe + s, kept as the pair (as _row_normaliser's)
        x = tl.load(x_row + tok, mask=pos_ok, other=float("-inf"), eviction_policy="evict_last").to(
            ACC
        )
        v = ((x - big_safe) - s).to(tl.float32)
    else:
        v = tl.load(x_row + tok, mask=pos_ok, other=0.0, eviction_policy="evict_last").to(ACC)
    out_row = out_ptr + row.to(tl.int64) * N
    scr_row = scratch_ptr + row.to(tl.int64) * NS
    r0 = tl.load(range_ptr_ptr + t)
    r1 = tl.load(range_ptr_ptr + t + 1)
    for c in range(r0, r1, RB):
        r_ok, start, end, dest = _load_ranges(
            range_start_ptr, range_end_ptr, range_dest_ptr, c, r1, RB
        )
        res = _dense_reduce(v, pos, start, end, REDUCTION)
        _store_ranges(out_row, scr_row, dest, res.to(out_ptr.dtype.element_ty), r_ok)


@triton.jit
def _window_doubled(t, pos_l, w: tl.constexpr, TILE: tl.constexpr):
    """t[:, p] = max of the window [p, p + w) -> max of [p, p + 2w). Past the tile's end
    the index clamps to its last position: those windows are never queried (a query's
    window lies inside its range, which lies inside the tile)."""
    idx = tl.broadcast_to(tl.minimum(pos_l + w, TILE - 1)[None, :], t.shape)
    return tl.maximum(t, tl.gather(t, idx, axis=1))


@triton.jit
def _window_query(t, first, n, res, w: tl.constexpr):
    """Ranges of length n in [w, 2w): max of the windows of length w at ``first`` and at
    ``first + n - w``, which together cover the range; other ranges keep res."""
    last = tl.maximum(first + n - w, 0)  # clamped for the ranges this level does not answer
    both = tl.maximum(tl.gather(t, first, axis=1), tl.gather(t, last, axis=1))
    return tl.where((n >= w) & (n < 2 * w), both, res)


@triton.jit
def _tile_ranges_max(
    x_ptr,
    B,
    C,
    L,
    leaf_token_ptr,
    range_ptr_ptr,
    unit_end_ptr,
    range_start_ptr,
    range_end_ptr,
    range_dest_ptr,
    out_ptr,
    N,
    scratch_ptr,
    NS,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    RB: tl.constexpr,
):
    """One (tile, block of ROWS rows) per program: range maxima from a sparse table."""
    tl.static_assert(TILE <= 64, "the sparse table has levels for windows up to 64")
    t = tl.program_id(0)
    rb = tl.program_id(1)
    rows = rb * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    pos_l = tl.arange(0, TILE)
    pos = t * TILE + pos_l
    pos_ok = pos < L
    tok = tl.load(leaf_token_ptr + pos, mask=pos_ok, other=0)
    t0 = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * C + tok[None, :],
        mask=row_ok[:, None] & pos_ok[None, :],
        other=float("-inf"),
        eviction_policy="evict_last",
    )
    t1 = _window_doubled(t0, pos_l, 1, TILE)
    t2 = _window_doubled(t1, pos_l, 2, TILE)
    t3 = _window_doubled(t2, pos_l, 4, TILE)
    t4 = _window_doubled(t3, pos_l, 8, TILE)
    t5 = _window_doubled(t4, pos_l, 16, TILE)
    t6 = _window_doubled(t5, pos_l, 32, TILE)

    out_rows = out_ptr + rows.to(tl.int64)[:, None] * N
    scr_rows = scratch_ptr + rows.to(tl.int64)[:, None] * NS
    r0 = tl.load(range_ptr_ptr + t)
    u1 = tl.load(unit_end_ptr + t)
    r1 = tl.load(range_ptr_ptr + t + 1)
    for c in range(r0, u1, RB):  # unit ranges: their leaf's value
        u_ok, dest, at = _unit_positions(range_start_ptr, range_dest_ptr, c, u1, t, ROWS, RB, TILE)
        _store_ranges(
            out_rows,
            scr_rows,
            dest[None, :],
            tl.gather(t0, at, axis=1).to(out_ptr.dtype.element_ty),
            row_ok[:, None] & u_ok[None, :],
        )
    for c in range(u1, r1, RB):
        r_ok, start, end, dest = _load_ranges(
            range_start_ptr, range_end_ptr, range_dest_ptr, c, r1, RB
        )
        n = tl.broadcast_to((end - start)[None, :], (ROWS, RB))
        # tile-local positions, clamped for the chunk's padding (start = end = 0)
        first = tl.broadcast_to(
            tl.minimum(tl.maximum(start - t * TILE, 0), TILE - 1)[None, :], (ROWS, RB)
        )
        res = tl.zeros([ROWS, RB], dtype=t0.dtype)  # an empty range's max is 0
        res = _window_query(t0, first, n, res, 1)
        res = _window_query(t1, first, n, res, 2)
        res = _window_query(t2, first, n, res, 4)
        res = _window_query(t3, first, n, res, 8)
        res = _window_query(t4, first, n, res, 16)
        res = _window_query(t5, first, n, res, 32)
        res = _window_query(t6, first, n, res, 64)
        _store_ranges(
            out_rows,
            scr_rows,
            dest[None, :],
            res.to(out_ptr.dtype.element_ty),
            row_ok[:, None] & r_ok[None, :],
        )


@triton.jit
def _tile_ranges_dot(
    x_ptr,
    B,
    C,
    L,
    leaf_token_ptr,
    range_ptr_ptr,
    unit_end_ptr,
    range_start_ptr,
    range_end_ptr,
    range_dest_ptr,
    out_ptr,
    N,
    scratch_ptr,
    NS,
    pmax_ptr,
    psum_ptr,
    LOG_MASS: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    RB: tl.constexpr,
    UB: tl.constexpr,
    SUB: tl.constexpr,
    ACC: tl.constexpr,
    FAST_MIN_MASS: tl.constexpr,
    LEVEL_GAP: tl.constexpr,
):
    """One (tile, block of ROWS rows) per program: range sums as w @ membership-mask."""
    t = tl.program_id(0)
    rb = tl.program_id(1)
    rid = tl.arange(0, ROWS)
    rows = rb * ROWS + rid
    row_ok = rows < B
    pos = t * TILE + tl.arange(0, TILE)
    pos_ok = pos < L
    tok = tl.load(leaf_token_ptr + pos, mask=pos_ok, other=0)
    lmask = row_ok[:, None] & pos_ok[None, :]
    xptrs = x_ptr + rows.to(tl.int64)[:, None] * C + tok[None, :]
    if LOG_MASS:
        big_safe, lse_s = _row_normaliser(pmax_ptr, psum_ptr, rows, row_ok, SPLIT, ACC)
        x = tl.load(xptrs, mask=lmask, other=float("-inf"), eviction_policy="evict_last").to(ACC)
        # log-probabilities; -inf where masked
        v = ((x - big_safe[:, None]) - lse_s[:, None]).to(tl.float32)
        peak = tl.max(v, axis=1)
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        w = tl.exp(v - shift[:, None])  # in [0, 1]
        # only a row whose finite leaves here span > LEVEL_GAP can have a range with finite
        # leaves and S < FAST_MIN_MASS; elsewhere S < FAST_MIN_MASS means all -inf (S = 0)
        low = tl.min(tl.where(v > float("-inf"), v, float("inf")), axis=1)
        risky_row = (peak > float("-inf")) & (low < peak - LEVEL_GAP)
    else:
        v = tl.load(xptrs, mask=lmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        finite = tl.abs(v) < float("inf")
        risky_row = tl.max(tl.where(finite, 0, 1), axis=1) > 0
        w = tl.where(finite, v, 0.0)
        shift = tl.zeros([ROWS], tl.float32)
    w_hi, w_lo = _split_tf32(w)

    out_rows = out_ptr + rows.to(tl.int64)[:, None] * N
    scr_rows = scratch_ptr + rows.to(tl.int64)[:, None] * NS
    r0 = tl.load(range_ptr_ptr + t)
    u1 = tl.load(unit_end_ptr + t)
    r1 = tl.load(range_ptr_ptr + t + 1)
    # unit ranges: their leaf's own value, exact (log_mass: its log-probability; sum: its
    # weight, infinite ones included), gathered from the registers
    for c in range(r0, u1, UB):
        u_ok, dest, at = _unit_positions(range_start_ptr, range_dest_ptr, c, u1, t, ROWS, UB, TILE)
        _store_ranges(
            out_rows,
            scr_rows,
            dest[None, :],
            tl.gather(v, at, axis=1).to(out_ptr.dtype.element_ty),
            row_ok[:, None] & u_ok[None, :],
        )
    row_todo = tl.zeros([ROWS], tl.int32)  # rows with a range the fast path cannot do
    for c in range(u1, r1, RB):
        r_ok, start, end, dest = _load_ranges(
            range_start_ptr, range_end_ptr, range_dest_ptr, c, r1, RB
        )
        member = (pos[:, None] >= start[None, :]) & (pos[:, None] < end[None, :])
        mf = tl.where(member, 1.0, 0.0)  # [TILE, RB], exactly 0/1
        acc = tl.dot(w_hi, mf, input_precision="tf32")
        acc = tl.dot(w_lo, mf, acc, input_precision="tf32")  # [ROWS, RB]
        if LOG_MASS:
            res = shift[:, None] + tl.log(acc)  # acc == 0 -> -inf (empty range)
            todo = (acc < FAST_MIN_MASS) & (end > start)[None, :] & risky_row[:, None]
            row_todo = tl.maximum(row_todo, tl.max(todo.to(tl.int32), axis=1))
        else:
            res = acc
        _store_ranges(
            out_rows,
            scr_rows,
            dest[None, :],
            res.to(out_ptr.dtype.element_ty),
            row_ok[:, None] & r_ok[None, :],
        )

    if not LOG_MASS:
        row_todo = risky_row.to(tl.int32)
    if tl.max(row_todo, axis=0) > 0:
        # Rare second pass, kept out of the main loop so that it costs no registers there.
        # It overwrites values written above: the barrier orders the two writes.
        tl.debug_barrier()
        if LOG_MASS:
            # Ranges far below their tile's max, or all -inf. Redo the rows that have one,
            # level by level: level 0 is the fast path again (shift s = the tile max);
            # level k+1 shifts to the largest leaf below s_k - LEVEL_GAP, the largest value
            # any range still open can hold. A level is exact for every range it lifts to
            # >= FAST_MIN_MASS (> e^-LEVEL_GAP: it lifts all ranges whose max is >= s -
            # LEVEL_GAP) and each level passes at least one leaf, so at most TILE + 1 levels
            # run, usually 1 or 2. exp is capped at e^80: a member that high belongs to a
            # range an earlier level closed, so the cap never touches a result. A range
            # still open when no leaf is left below holds only -inf leaves: -inf.
            redo = row_todo > 0
            xr = tl.load(
                x_ptr + rows.to(tl.int64)[:, None] * C + tok[None, :],
                mask=lmask & redo[:, None],
                other=float("-inf"),
            ).to(ACC)
            vr = ((xr - big_safe[:, None]) - lse_s[:, None]).to(tl.float32)
            for c in range(u1, r1, RB):
                r_ok, start, end, dest = _load_ranges(
                    range_start_ptr, range_end_ptr, range_dest_ptr, c, r1, RB
                )
                member = (pos[:, None] >= start[None, :]) & (pos[:, None] < end[None, :])
                mf = tl.where(member, 1.0, 0.0)
                todo = (end > start)[None, :] & redo[:, None]
                late = todo & False  # open after level 0: what the first pass got wrong
                res = tl.full([ROWS, RB], float("-inf"), tl.float32)
                s_k = shift
                for k in range(TILE + 1):
                    if tl.max(tl.max(todo.to(tl.int32), axis=1), axis=0) > 0:
                        k_hi, k_lo = _split_tf32(tl.exp(tl.minimum(vr - s_k[:, None], 80.0)))
                        acc_k = tl.dot(k_hi, mf, input_precision="tf32")
                        acc_k = tl.dot(k_lo, mf, acc_k, input_precision="tf32")
                        res = tl.where(
                            todo & (acc_k >= FAST_MIN_MASS), s_k[:, None] + tl.log(acc_k), res
                        )
                        todo = todo & (acc_k < FAST_MIN_MASS)
                        late = late | (todo & (k == 0))
                        below = tl.where(vr < (s_k - LEVEL_GAP)[:, None], vr, float("-inf"))
                        nxt = tl.max(below, axis=1)
                        todo = todo & (nxt > float("-inf"))[:, None]
                        s_k = tl.where(nxt > float("-inf"), nxt, s_k)
                _store_ranges(
                    out_rows,
                    scr_rows,
                    dest[None, :],
                    res.to(out_ptr.dtype.element_ty),
                    late & r_ok[None, :],
                )
        else:
            # rows with an infinite weight in this tile (inf * 0 = NaN in the product):
            # rewrite their ranges with the dense path, SUB at a time
            for r in range(ROWS):
                if tl.sum(tl.where(rid == r, row_todo, 0), axis=0) > 0:
                    row = (rb * ROWS + r).to(tl.int64)
                    v_r = tl.load(x_ptr + row * C + tok, mask=pos_ok, other=0.0)
                    v_r = v_r.to(tl.float32)
                    for c2 in range(u1, r1, SUB):
                        s_ok, st, en, de = _load_ranges(
                            range_start_ptr, range_end_ptr, range_dest_ptr, c2, r1, SUB
                        )
                        d_r = _dense_reduce(v_r, pos, st, en, REDUCE_SUM)
                        _store_ranges(
                            out_ptr + row * N,
                            scratch_ptr + row * NS,
                            de,
                            d_r.to(out_ptr.dtype.element_ty),
                            s_ok,
                        )


@triton.jit
def _span_block(
    scratch_ptr,
    NS,
    out_ptr,
    N,
    row,
    sidx,
    s_ok,
    span_node_ptr,
    span_left_ptr,
    span_right_ptr,
    span_lo_ptr,
    span_hi_ptr,
    REDUCTION: tl.constexpr,
    TB: tl.constexpr,
):
    """The spanning nodes ``sidx`` (masked by s_ok) of one row: left piece + whole-tile
    totals + right piece, the tiles TB at a time up to the block's largest count."""
    node = tl.load(span_node_ptr + sidx, mask=s_ok, other=0)
    left = tl.load(span_left_ptr + sidx, mask=s_ok, other=-1)
    right = tl.load(span_right_ptr + sidx, mask=s_ok, other=-1)
    lo = tl.load(span_lo_ptr + sidx, mask=s_ok, other=0)
    hi = tl.load(span_hi_ptr + sidx, mask=s_ok, other=0)
    count = tl.where(s_ok, hi - lo, 0)
    n_chunks = tl.max(count, axis=0)
    scr = scratch_ptr + row.to(tl.int64) * NS
    j = tl.arange(0, TB)
    has_l = s_ok & (left >= 0)
    has_r = s_ok & (right >= 0)
    if REDUCTION == REDUCE_SUM:
        acc = tl.load(scr + left, mask=has_l, other=0.0).to(tl.float64)
        acc += tl.load(scr + right, mask=has_r, other=0.0).to(tl.float64)
        for j0 in range(0, n_chunks, TB):
            msk = (j0 + j)[None, :] < count[:, None]
            vals = tl.load(scr + lo[:, None] + j0 + j[None, :], mask=msk, other=0.0)
            acc += tl.sum(vals.to(tl.float64), axis=1)
        res = acc
    elif REDUCTION == REDUCE_MAX:
        acc = tl.load(scr + left, mask=has_l, other=float("-inf"))
        acc = tl.maximum(acc, tl.load(scr + right, mask=has_r, other=float("-inf")))
        for j0 in range(0, n_chunks, TB):
            msk = (j0 + j)[None, :] < count[:, None]
            vals = tl.load(scr + lo[:, None] + j0 + j[None, :], mask=msk, other=float("-inf"))
            acc = tl.maximum(acc, tl.max(vals, axis=1))
        res = acc
    else:
        lv = tl.load(scr + left, mask=has_l, other=float("-inf")).to(tl.float32)
        rv = tl.load(scr + right, mask=has_r, other=float("-inf")).to(tl.float32)
        m = tl.maximum(lv, rv)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = (tl.exp(lv - m_safe) + tl.exp(rv - m_safe)).to(tl.float64)
        for j0 in range(0, n_chunks, TB):
            msk = (j0 + j)[None, :] < count[:, None]
            vals = tl.load(scr + lo[:, None] + j0 + j[None, :], mask=msk, other=float("-inf")).to(
                tl.float32
            )
            m_new = tl.maximum(m, tl.max(vals, axis=1))
            new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            # m_safe <= new_safe; s == 0 while m == -inf (never multiply 0 by exp(+big))
            scale = tl.where(m == float("-inf"), 0.0, tl.exp(m_safe - new_safe))
            part = tl.sum(tl.exp(vals - new_safe[:, None]), axis=1)
            s = s * scale.to(tl.float64) + part.to(tl.float64)
            m = m_new
            m_safe = new_safe
        res = tl.where(m == float("-inf"), float("-inf"), m_safe + tl.log(s.to(tl.float32)))
    tl.store(
        out_ptr + row.to(tl.int64) * N + node,
        res.to(out_ptr.dtype.element_ty),
        mask=s_ok,
        cache_modifier=".cs",
    )


@triton.jit
def _spanning_nodes(
    scratch_ptr,
    NS,
    out_ptr,
    N,
    S,
    narrow,
    narrow_blocks,
    span_node_ptr,
    span_left_ptr,
    span_right_ptr,
    span_lo_ptr,
    span_hi_ptr,
    REDUCTION: tl.constexpr,
    SB: tl.constexpr,
    TB: tl.constexpr,
    WIDE_TB: tl.constexpr,
):
    """Grid (narrow_blocks + S - narrow, B). The first narrow_blocks programs take SB narrow
    spanning nodes each (at most SPAN_NARROW_TILES whole tiles: one chunk of TB); each
    other program takes one wide node (the root, the top levels), WIDE_TB tiles at a time,
    so that no program loops over the thousands of tiles of the root in small steps."""
    pid = tl.program_id(0)
    row = tl.program_id(1)
    # (the branches name their index vectors apart: Triton gives a name one type)
    if pid < narrow_blocks:
        nodes = pid * SB + tl.arange(0, SB)
        _span_block(
            scratch_ptr,
            NS,
            out_ptr,
            N,
            row,
            nodes,
            nodes < narrow,
            span_node_ptr,
            span_left_ptr,
            span_right_ptr,
            span_lo_ptr,
            span_hi_ptr,
            REDUCTION,
            TB,
        )
    else:
        wide = narrow + (pid - narrow_blocks) + tl.arange(0, 1)
        _span_block(
            scratch_ptr,
            NS,
            out_ptr,
            N,
            row,
            wide,
            wide < S,
            span_node_ptr,
            span_left_ptr,
            span_right_ptr,
            span_lo_ptr,
            span_hi_ptr,
            REDUCTION,
            WIDE_TB,
        )
