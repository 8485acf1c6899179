"""The compiled layout of a vocabulary trie: flat index arrays the kernels read.

Numbering. Nodes are numbered in post-order (children before parents, siblings in the
order they were first created, root last), exactly as genlm numbers them. In post-order
every subtree is a contiguous id range ``[node_first[n], n]``; sorting the leaves by node
id therefore makes the leaves beneath any node a contiguous range of *leaf positions*
``[leaf_start[n], leaf_end[n])``. Every kernel is built on that fact: a node's value is a
reduction over one contiguous slice of the leaf order, never a difference of prefix sums.

Modes. ``WITH_EOS`` (genlm.bytes) moves the EOS tokens' leaves out of their byte paths and
under the EOS node; it is just a second leaf order (EOS leaves re-keyed to the EOS node's
id), so both modes share one kernel.

Tiles (GPU backends). The leaf order is cut into tiles of ``TILE`` positions. A node whose
range lies inside one tile ("local") is reduced by the program that owns that tile. A node
whose range crosses tile boundaries ("spanning") is split into a left piece, whole tiles and
a right piece; pieces and tile totals are themselves local ranges written to a small
per-row scratch buffer, then combined by a second kernel. Scratch holds ``n_tiles`` tile
totals followed by the pieces: O(n_tiles * depth) values per row, far below ``V``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

import genlm_fast

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


def _number_postorder(parent, depth):
    """Post-order ids and each node's first subtree id, for a tree given by ``parent`` and
    ``depth`` in creation order (a parent is created before its children, and siblings in
    the order they are visited). Vectorised level by level: subtree sizes bottom-up, then
    each subtree's first id top-down (its parent's first id + the sizes of its earlier
    siblings); the node itself comes last in its subtree."""
    n = len(parent)
    by_depth = np.argsort(depth, kind="stable")
    level_end = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2), side="left")
    levels = [by_depth[level_end[d] : level_end[d + 1]] for d in range(1, len(level_end) - 1)]
    size = np.ones(n, dtype=np.int64)
    for nodes in reversed(levels):  # deepest first: a node's size is final before it is added
        np.add.at(size, parent[nodes], size[nodes])
    by_parent = np.argsort(parent, kind="stable")  # siblings stay in creation order
    sizes = size[by_parent]
    before = np.cumsum(sizes) - sizes  # sizes of everything earlier in by_parent
    group_parent = parent[by_parent]
    group_start = np.flatnonzero(np.r_[True, group_parent[1:] != group_parent[:-1]])
    group_len = np.diff(np.r_[group_start, n])
    offset = np.empty(n, dtype=np.int64)
    offset[by_parent] = before - np.repeat(before[group_start], group_len)
    first = np.zeros(n, dtype=np.int64)
    for nodes in levels:
        first[nodes] = first[parent[nodes]] + offset[nodes]
    return first + size - 1, first


def build_structure(words, leaf_keys, add_eos_node=False, eos_key=None):
    """Build the trie over ``words`` (each an iterable of edge keys) in genlm's numbering.

    ``leaf_keys[i]`` is the dict key of word i's leaf edge. With ``add_eos_node`` an empty
    node hangs from the root under ``eos_key`` after all words (genlm.bytes' EOS node).
    Returns (parent, node_first, leaf_node, edge_key, eos_node) in post-order ids.
    """
    words = list(words)
    if (
        words
        and all(type(w) is bytes for w in words)
        and (len(words) * max(map(len, words)) <= _MAX_PADDED_CELLS)
    ):
        parent_old, depth_old, edge_keys, old_leaf = _creation_order_of_bytes(words, leaf_keys)
    else:
        parent_old, depth_old, edge_keys, old_leaf = _creation_order(words, leaf_keys)
    old_eos = None
    if add_eos_node:
        old_eos = len(parent_old)
        parent_old = np.append(parent_old, 0)
        depth_old = np.append(depth_old, 1)
        edge_keys.append(eos_key)

    post, first = _number_postorder(parent_old, depth_old)
    n = len(post)
    node_first = np.empty(n, dtype=np.int32)
    node_first[post] = first
    parent = np.full(n, -1, dtype=np.int32)
    parent[post[1:]] = post[parent_old[1:]]
    old_of = np.empty(n, dtype=np.int64)  # post-order id -> old id
    old_of[post] = np.arange(n)
    edge_key = [edge_keys[old] for old in old_of.tolist()]
    leaf_node = post[old_leaf].astype(np.int32)
    eos_node = int(post[old_eos]) if old_eos is not None else None
    return parent, node_first, leaf_node, edge_key, eos_node


# the bytes path pads every word to the longest: above this many cells it takes the loop
_MAX_PADDED_CELLS = 1 << 26


def _creation_order(words, leaf_keys):
    """Insert the words one by one into a dict trie. Returns, for the nodes in creation
    ("old") order, with the root first: parent, depth, edge key, and each word's leaf."""
    children = [{}]  # None for a leaf: nothing descends through it
    parent_old = [-1]
    edge_key_old = [None]
    depth_old = [0]
    old_leaf = []
    for word, leaf_key in zip(words, leaf_keys):
        node = 0
        for letter in word:
            kids = children[node]
            nxt = kids.get(letter)
            if nxt is None:
                nxt = kids[letter] = len(children)
                children.append({})
                parent_old.append(node)
                edge_key_old.append(letter)
                depth_old.append(depth_old[node] + 1)
            node = nxt
        leaf = children[node][leaf_key] = len(children)
        children.append(None)
        parent_old.append(node)
        edge_key_old.append(leaf_key)
        depth_old.append(depth_old[node] + 1)
        old_leaf.append(leaf)
    return (
        np.asarray(parent_old, dtype=np.int64),
        np.asarray(depth_old, dtype=np.int64),
        edge_key_old,
        np.asarray(old_leaf, dtype=np.int64),
    )


def _creation_order_of_bytes(words, leaf_keys):
    """``_creation_order`` for ``bytes`` words, vectorised (the same result).

    The inner nodes are the distinct non-empty prefixes. With the words sorted, the words
    sharing a prefix of length d are one run of the order, and a word starts a new run at
    depth d exactly when its common prefix with the word before it is shorter than d, so
    one pass per depth over the words that long numbers that depth's nodes. The loop would
    create a prefix while inserting the first word that has it, after that word's shorter
    prefixes, and a word's leaf after all its prefixes: sorting the nodes by (first word,
    depth) gives its creation order.
    """
    count = len(words)
    order = np.array(sorted(range(count), key=words.__getitem__), dtype=np.int64)
    length = np.fromiter(map(len, words), dtype=np.int64, count=count)[order]
    longest = int(length.max())
    # the words in sorted order as rows padded with 256, which is no byte
    padded = np.full((count, max(longest, 1)), 256, dtype=np.uint16)
    flat = np.frombuffer(b"".join(map(words.__getitem__, order.tolist())), dtype=np.uint8)
    starts = np.cumsum(length) - length
    padded[
        np.repeat(np.arange(count), length), np.arange(flat.size) - np.repeat(starts, length)
    ] = flat
    common = np.zeros(count, dtype=np.int64)  # common prefix with the word before, sorted
    if count > 1:
        differ = padded[1:] != padded[:-1]
        first_difference = np.where(differ.any(axis=1), differ.argmax(axis=1), longest)
        common[1:] = np.minimum(first_difference, length[1:])

    inner = int((length - common).sum())  # temporary ids: root 0, inner 1..inner, then leaves
    total = 1 + inner + count
    parent_tmp = np.full(total, -1, dtype=np.int64)
    depth_tmp = np.zeros(total, dtype=np.int64)
    letter_tmp = np.zeros(inner + 1, dtype=np.int64)
    first_word = np.full(total, -1, dtype=np.int64)
    node_at = np.zeros(count, dtype=np.int64)  # each sorted word's prefix node, this depth
    rows = np.arange(count)
    next_id = 1
    for depth in range(1, longest + 1):
        rows = rows[length[rows] >= depth]
        new = common[rows] < depth
        run_start = np.flatnonzero(new)
        ids = next_id + np.arange(run_start.size)
        starter = rows[run_start]
        parent_tmp[ids] = node_at[starter]
        depth_tmp[ids] = depth
        letter_tmp[ids] = padded[starter, depth - 1]
        first_word[ids] = np.minimum.reduceat(order[rows], run_start)
        node_at[rows] = ids[np.cumsum(new) - 1]
        next_id += run_start.size
    leaf_tmp = 1 + inner + np.arange(count)  # word i's leaf: 1 + inner + i
    parent_tmp[leaf_tmp[order]] = node_at
    depth_tmp[leaf_tmp[order]] = length + 1
    first_word[leaf_tmp] = np.arange(count)

    creation = np.argsort(first_word * (longest + 2) + depth_tmp, kind="stable")  # root first
    old_id = np.empty(total, dtype=np.int64)
    old_id[creation] = np.arange(total)
    parent_old = np.full(total, -1, dtype=np.int64)
    parent_old[1:] = old_id[parent_tmp[creation[1:]]]
    edge_key_tmp = letter_tmp.tolist()
    edge_key_tmp[0] = None
    edge_key_tmp.extend(leaf_keys)
    edge_key_old = [edge_key_tmp[t] for t in creation.tolist()]
    return parent_old, depth_tmp[creation], edge_key_old, old_id[leaf_tmp]


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


# --------------------------------------------------------------------------- disk cache


def default_cache_dir() -> str:
    """Where layouts are cached: ``<genlm_fast cache root>/tries`` (`genlm_fast.cache_dir`)."""
    return genlm_fast.cache_dir("tries")


def vocab_digest(*parts) -> str:
    """A key for the on-disk cache: a hash of the vocabulary's contents and options."""
    h = hashlib.sha256(f"v{LAYOUT_VERSION}/tile{TILE}".encode())
    for part in parts:
        h.update(pickle.dumps(part, protocol=4))
    return h.hexdigest()[:32]


# A cache file: _CACHE_MAGIC, the SHA-256 of the payload, the pickled TrieLayout. The
# checksum turns a damaged file (a flipped byte, a foreign file) into a rebuild instead of
# an exception or, worse, a layout that silently computes wrong masses.
_CACHE_MAGIC = b"genlm_fast trie layout\n"


def load_cached(digest: str, cache_dir: str | None):
    """The cached layout of ``digest``, or None when there is none or it is damaged."""
    path = os.path.join(cache_dir or default_cache_dir(), digest + ".pkl")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(_CACHE_MAGIC) + 32
    if (
        not data.startswith(_CACHE_MAGIC)
        or hashlib.sha256(memoryview(data)[head:]).digest() != data[len(_CACHE_MAGIC) : head]
    ):
        return None
    try:
        layout = pickle.loads(memoryview(data)[head:])
    except Exception:
        return None
    return layout if isinstance(layout, TrieLayout) else None


def store_cached(digest: str, layout: TrieLayout, cache_dir: str | None) -> None:
    directory = cache_dir or default_cache_dir()
    payload = pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_CACHE_MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
        os.replace(tmp, os.path.join(directory, digest + ".pkl"))
    except OSError:
        pass  # a read-only home must not break trie construction
