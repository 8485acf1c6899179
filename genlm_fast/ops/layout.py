"""The compiled layout of a vocabulary trie: flat index arrays the kernels read.

Numbering. Nodes are numbered in post-order (children before parents, siblings in the
order they were first created, root last), exactly as genlm numbers them (the trie is
built by ``trie_structure.build_structure``). In post-order every subtree is a contiguous
id range ``[node_first[n], n]``; sorting the leaves by node id therefore makes the leaves
beneath any node a contiguous range of *leaf positions* ``[leaf_start[n], leaf_end[n])``.
Every kernel is built on that fact: a node's value is a reduction over one contiguous slice
of the leaf order, never a difference of prefix sums.

Modes. ``WITH_EOS`` (genlm.bytes) moves the EOS tokens' leaves out of their byte paths and
under the EOS node; it is just a second leaf order (EOS leaves re-keyed to the EOS node's
id), so both modes share one kernel.

Tiles (GPU backends). The leaf order is cut into tiles of ``TILE`` positions. A node whose
range lies inside one tile ("local") is reduced by the program that owns that tile. A node
whose range crosses tile boundaries ("spanning") is split into a left piece, whole tiles and
a right piece; pieces and tile totals are themselves local ranges written to a small
per-row scratch buffer, then combined by a second kernel. Scratch holds ``n_tiles`` tile
totals followed by the pieces: O(n_tiles * depth) values per row, far below ``V``.

Compiled layouts are kept on disk by ``layout_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

TILE = 64  # leaf positions per tile; a power of two (Triton block shapes)
# Spanning nodes with at most this many whole tiles are "narrow": the GPU backends reduce
# one per thread (CUDA) or per lane (Triton), the wider ones (the top levels of the trie)
# with a warp (CUDA, up to SPAN_WARP_TILES tiles), a block (CUDA, wider still: the root and
# a few more; Llama-3: 2 of 5,171) or a program (Triton) each. Spanning nodes are sorted by
# tile count, so each class is a slice: narrow [0, span_class_end(ml, SPAN_NARROW_TILES)),
# then CUDA's warp class up to span_class_end(ml, SPAN_WARP_TILES).
SPAN_NARROW_TILES = 16
SPAN_WARP_TILES = 256
LAYOUT_VERSION = 8  # bump when the pickled layout changes (the disk cache key has it)

# The index arrays each backend reads (TrieLayout.device_arrays hands it these alone): the
# reference and the CPU kernel walk nodes by their leaf ranges, the Triton kernels read the
# tiles' local ranges, the CUDA kernels their sources and runs; both GPU backends the
# spanning nodes.
_SPANNING = ("span_node", "span_left", "span_right", "span_tile_lo", "span_tile_hi")
BACKEND_ARRAYS = {
    "reference": ("leaf_token", "leaf_start", "leaf_end"),
    "cpu": ("leaf_token", "leaf_start", "leaf_end", "parent"),
    "triton": (
        "leaf_token",
        "tile_range_ptr",
        "tile_unit_end",
        "range_start",
        "range_end",
        "range_dest",
        *_SPANNING,
    ),
    "cuda": (
        "leaf_token",
        "tile_node_lo",
        "tile_run_ptr",
        "run_bounds",
        "node_src",
        "tile_scratch_ptr",
        "scratch_src",
        "scratch_slot",
        *_SPANNING,
    ),
}


@dataclass
class ModeLayout:
    """Index arrays for one leaf order (one trie mode). All int32 numpy arrays."""

    leaf_token: np.ndarray  # [L] token column of the leaf at each leaf position
    leaf_start: np.ndarray  # [N] first leaf position beneath each node
    leaf_end: np.ndarray  # [N] one past the last leaf position beneath each node
    # tile decomposition (GPU backends)
    tile: int  # leaf positions per tile (TILE)
    tile_range_ptr: np.ndarray  # [n_tiles + 1] CSR over local ranges, by tile
    # [n_tiles] within a tile, the unit ranges (one leaf: the value is that leaf's own) come
    # first, [tile_range_ptr[t], tile_unit_end[t]); the others (empty, or 2+ leaves) follow
    tile_unit_end: np.ndarray
    # [n_tiles + 1] the node ids a tile owns, [tile_node_lo[t], tile_node_lo[t + 1]): the
    # nodes whose last leaf lies in the tile (an empty node: its last leaf before it). One
    # block of ids, as leaf_end is non-decreasing in the post-order id; it holds the tile's
    # local nodes, its empty nodes and the spanning nodes that end there. The CUDA tile
    # kernel writes the block of each row whole.
    tile_node_lo: np.ndarray
    # The same local ranges as the CUDA tile kernel reads them: where each owned node's
    # value comes from inside its tile. A tile's distinct ranges of two leaves or more, but
    # the whole tile, are its *runs* (at most tile - 2: they nest), tile_run_ptr
    # [n_tiles + 1] the CSR over run_bounds [runs] (local positions a | b << 16, longest
    # first). node_src [N]: the node's source code, a leaf position p < tile (one leaf: its
    # own value), tile + r (the tile's run r), 2 * tile - 2 (the whole tile, 2+ leaves) or
    # 2 * tile - 1 (none: an empty node, or a spanning node, which the span pass writes).
    # tile_scratch_ptr [n_tiles + 1] the CSR over the tile's scratch values (its total and
    # pieces): scratch_src [P] a source code, scratch_slot [P] the slot.
    tile_run_ptr: np.ndarray
    run_bounds: np.ndarray
    node_src: np.ndarray
    tile_scratch_ptr: np.ndarray
    scratch_src: np.ndarray
    scratch_slot: np.ndarray
    range_start: np.ndarray  # [R] absolute leaf position (inclusive)
    range_end: np.ndarray  # [R] absolute leaf position (exclusive)
    range_dest: np.ndarray  # [R] >= 0: output node column; < 0: scratch slot -1 - dest
    span_node: np.ndarray  # [S] spanning node ids
    span_left: np.ndarray  # [S] scratch slot of the left piece, or -1
    span_right: np.ndarray  # [S] scratch slot of the right piece, or -1
    span_tile_lo: np.ndarray  # [S] first whole tile (its total is at scratch slot = tile id)
    span_tile_hi: np.ndarray  # [S] one past the last whole tile
    num_scratch: int  # scratch slots per row: tile totals, then left and right pieces


@dataclass
class TrieLayout:
    """Structure of a trie in genlm's numbering plus the per-mode kernel layouts.

    ``parent[n]`` is -1 for the root. ``edge_key[n]`` is the dict key under which ``n``
    hangs from its parent (a byte/char, an atomic byte string, a leaf key, or EOS).
    """

    num_nodes: int
    root: int
    parent: np.ndarray  # [N] int32
    leaf_node: np.ndarray  # [V] int32: leaf node of vocabulary position i
    token_column: np.ndarray  # [V] int32: weight column of vocabulary position i
    edge_key: list
    eos_node: int | None
    modes: dict = field(default_factory=dict)  # mode name -> ModeLayout
    _device_cache: dict = field(default_factory=dict, repr=False)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_device_cache"] = {}  # tensors and backend scratch are rebuilt per process
        return state

    @cached_property  # read on every call, and a max over the whole vocabulary
    def num_columns(self) -> int:
        """Smallest width a weight/logit row must have."""
        return int(self.token_column.max()) + 1 if len(self.token_column) else 0

    def device_arrays(self, mode: str, device, backend: str) -> dict:
        """The index arrays ``backend`` reads (``BACKEND_ARRAYS``) for ``mode``, as int32
        tensors on ``device``, with ``num_columns`` and the spanning nodes' class bounds
        (``span_narrow``, ``span_warp``). Built once per (mode, device, backend), each tensor
        copied to the device once whichever backends read it; the backend may cache what it
        derives from them in the dict, under a key of its own."""
        if backend not in BACKEND_ARRAYS:
            raise ValueError(
                f"unknown backend {backend!r}; expected one of {tuple(BACKEND_ARRAYS)}"
            )
        device = torch.device(device)
        key = (mode, str(device), backend)
        cached = self._device_cache.get(key)
        if cached is None:
            ml = self.modes[mode]
            cached = {
                name: self._device_array(mode, device, name) for name in BACKEND_ARRAYS[backend]
            }
            cached["num_columns"] = self.num_columns
            cached["span_narrow"] = span_class_end(ml, SPAN_NARROW_TILES)
            cached["span_warp"] = span_class_end(ml, SPAN_WARP_TILES)
            self._device_cache[key] = cached
        return cached

    def _device_array(self, mode: str, device: torch.device, name: str) -> torch.Tensor:
        """One index array on ``device`` (the trie's ``parent``, else the mode's), cached."""
        key = ("array", mode, str(device), name)
        tensor = self._device_cache.get(key)
        if tensor is None:
            array = self.parent if name == "parent" else getattr(self.modes[mode], name)
            tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
            self._device_cache[key] = tensor
        return tensor


def span_class_end(ml: ModeLayout, max_tiles: int) -> int:
    """How many spanning nodes (a prefix: they are sorted by tile count) have at most
    ``max_tiles`` whole tiles."""
    count = ml.span_tile_hi.astype(np.int64) - ml.span_tile_lo
    return int(np.searchsorted(count, max_tiles, side="right"))


# --------------------------------------------------------------------------- building


def _mode_layout(num_nodes, node_first, token_column, deposit_node):
    """Leaf order, node ranges and tile decomposition for one mode (tiles of ``TILE``).

    ``deposit_node[i]`` is the node whose subtree receives vocabulary position i: its own
    leaf normally, the EOS node for EOS tokens under WITH_EOS.
    """
    tile = TILE
    order = np.argsort(deposit_node, kind="stable")
    sorted_keys = deposit_node[order]
    nodes = np.arange(num_nodes, dtype=np.int64)
    leaf_start = np.searchsorted(sorted_keys, node_first, side="left").astype(np.int64)
    leaf_end = np.searchsorted(sorted_keys, nodes, side="right").astype(np.int64)
    L = len(order)
    n_tiles = max(1, -(-L // tile))

    tile_first = leaf_start // tile
    tile_last = (leaf_end - 1) // tile
    empty = leaf_end <= leaf_start
    local = empty | (tile_first == tile_last)

    # local nodes
    loc_nodes = nodes[local]
    loc_start = leaf_start[local]
    loc_end = leaf_end[local]
    loc_tile = np.where(empty[local], 0, tile_first[local])
    loc_dest = loc_nodes

    # tile totals: scratch slots [0, n_tiles)
    t_ids = np.arange(n_tiles, dtype=np.int64)
    tot_start = t_ids * tile
    tot_end = np.minimum(tot_start + tile, L)
    tot_dest = -1 - t_ids

    # spanning nodes: optional left piece, whole tiles, optional right piece
    span = nodes[~local]
    s_start = leaf_start[~local]
    s_end = leaf_end[~local]
    lo_tile = -(-s_start // tile)  # first whole tile
    hi_tile = s_end // tile  # one past the last whole tile
    has_left = (s_start % tile) != 0
    has_right = (s_end % tile) != 0
    n_left = int(has_left.sum())
    n_right = int(has_right.sum())
    left_slot = np.full(len(span), -1, dtype=np.int64)
    right_slot = np.full(len(span), -1, dtype=np.int64)
    left_slot[has_left] = n_tiles + np.arange(n_left)
    right_slot[has_right] = n_tiles + n_left + np.arange(n_right)
    lp_start = s_start[has_left]
    lp_end = lo_tile[has_left] * tile
    rp_start = hi_tile[has_right] * tile
    rp_end = s_end[has_right]

    r_start = np.concatenate([loc_start, tot_start, lp_start, rp_start])
    r_end = np.concatenate([loc_end, tot_end, lp_end, rp_end])
    r_dest = np.concatenate(
        [loc_dest, tot_dest, -1 - left_slot[has_left], -1 - right_slot[has_right]]
    )
    r_tile = np.concatenate([loc_tile, t_ids, lp_start // tile, rp_start // tile])
    # by tile, unit ranges first (~80% of all ranges on real vocabularies: leaves and the
    # single-child chains above them); otherwise in the order above
    unit = (r_end - r_start) == 1
    by_tile = np.lexsort((~unit, r_tile))
    counts = np.bincount(r_tile, minlength=n_tiles)
    ptr = np.zeros(n_tiles + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    unit_end = ptr[:-1] + np.bincount(r_tile[unit], minlength=n_tiles)
    owner = np.maximum(leaf_end - 1, 0) // tile  # non-decreasing in the node id
    node_lo = np.searchsorted(owner, np.arange(n_tiles + 1), side="left")

    sources = _tile_sources(
        num_nodes, tile, n_tiles, r_start, r_end, r_dest, r_tile, tot_end - tot_start
    )

    def i32(a):
        return np.ascontiguousarray(a, dtype=np.int32)

    # spanning nodes sorted by how many whole tiles they sum, so a block of them loops alike
    span_order = np.argsort(hi_tile - lo_tile, kind="stable")
    return ModeLayout(
        leaf_token=i32(token_column[order]),
        leaf_start=i32(leaf_start),
        leaf_end=i32(leaf_end),
        tile=tile,
        tile_range_ptr=i32(ptr),
        tile_unit_end=i32(unit_end),
        tile_node_lo=i32(node_lo),
        **{name: i32(a) for name, a in sources.items()},
        range_start=i32(r_start[by_tile]),
        range_end=i32(r_end[by_tile]),
        range_dest=i32(r_dest[by_tile]),
        span_node=i32(span[span_order]),
        span_left=i32(left_slot[span_order]),
        span_right=i32(right_slot[span_order]),
        span_tile_lo=i32(lo_tile[span_order]),
        span_tile_hi=i32(hi_tile[span_order]),
        num_scratch=int(n_tiles + n_left + n_right),
    )


def _tile_sources(num_nodes, tile, n_tiles, r_start, r_end, r_dest, r_tile, tile_len):
    """The CUDA tile kernel's view of the local ranges (``ModeLayout``'s tile_run_ptr ..
    scratch_slot): each range becomes a source code inside its tile (a leaf position, the
    tile's total, or the run of its distinct bounds), each node and scratch slot points at
    its range's. ``tile_len``: the leaves in each tile."""
    a = r_start - r_tile * tile  # local bounds
    b = r_end - r_tile * tile
    length = b - a
    code = np.full(len(a), 2 * tile - 1, dtype=np.int64)  # empty ranges: none
    code[length == 1] = a[length == 1]
    # the whole tile (its total, and any node whose leaves are all of the tile's): the
    # kernel sums it as it gathers, not as a run
    whole = (length >= 2) & (a == 0) & (b == tile_len[r_tile])
    code[whole] = 2 * tile - 2
    multi = np.flatnonzero((length >= 2) & ~whole)
    # runs: the distinct (tile, a, b) of two leaves or more, longest first within a tile
    # (the kernel deals them round-robin to its thread groups)
    key = (r_tile[multi] * (tile + 1) + (tile - length[multi])) * (tile + 1) + a[multi]
    uniq, inverse = np.unique(key, return_inverse=True)
    run_tile = uniq // ((tile + 1) * (tile + 1))
    run_len = tile - (uniq // (tile + 1)) % (tile + 1)
    run_a = uniq % (tile + 1)
    run_ptr = np.zeros(n_tiles + 1, dtype=np.int64)
    np.cumsum(np.bincount(run_tile, minlength=n_tiles), out=run_ptr[1:])
    code[multi] = tile + inverse - run_ptr[run_tile[inverse]]
    node_src = np.full(num_nodes, 2 * tile - 1, dtype=np.int64)
    is_node = (r_dest >= 0) & (length >= 1)
    node_src[r_dest[is_node]] = code[is_node]
    to_scratch = np.flatnonzero(r_dest < 0)
    to_scratch = to_scratch[np.argsort(r_tile[to_scratch], kind="stable")]
    scratch_ptr = np.zeros(n_tiles + 1, dtype=np.int64)
    np.cumsum(np.bincount(r_tile[to_scratch], minlength=n_tiles), out=scratch_ptr[1:])
    return {
        "tile_run_ptr": run_ptr,
        "run_bounds": run_a | ((run_a + run_len) << 16),
        "node_src": node_src,
        "tile_scratch_ptr": scratch_ptr,
        "scratch_src": code[to_scratch],
        "scratch_slot": -1 - r_dest[to_scratch],
    }


def compile_layout(
    parent, node_first, leaf_node, token_column, edge_key, eos_node, eos_positions=()
) -> TrieLayout:
    """Turn a numbered trie into a ``TrieLayout`` with a ``without_eos`` mode and, when
    the trie has an EOS node, a ``with_eos`` mode where ``eos_positions`` deposit there."""
    num_nodes = len(parent)
    token_column = np.asarray(token_column, dtype=np.int64)
    # each column feeds at most one leaf (the CUDA tile kernel drops from L2 the staged values
    # it has read: no other leaf may need them)
    if len(token_column) and (token_column.min() < 0 or np.bincount(token_column).max() > 1):
        raise ValueError("token columns must be distinct and non-negative")
    leaf_node = np.asarray(leaf_node, dtype=np.int64)
    layout = TrieLayout(
        num_nodes=num_nodes,
        root=num_nodes - 1,
        parent=np.ascontiguousarray(parent, dtype=np.int32),
        leaf_node=leaf_node.astype(np.int32),
        token_column=token_column.astype(np.int32),
        edge_key=edge_key,
        eos_node=eos_node,
    )
    layout.modes["without_eos"] = _mode_layout(num_nodes, node_first, token_column, leaf_node)
    if eos_node is not None:
        deposit = leaf_node.copy()
        deposit[np.asarray(list(eos_positions), dtype=np.int64)] = eos_node
        layout.modes["with_eos"] = _mode_layout(num_nodes, node_first, token_column, deposit)
    return layout
