"""A paged key/value pool on the model's device and the trie of token ids that shares it.

The pool (`PagedKVPool`) is one tensor ``[layers, 2, blocks * page, kv_heads, head_dim]``:
fixed-size blocks of ``page`` positions, handed out and taken back by a free list. Block 0
is scratch (padding tokens write there, empty table entries point there) and never holds a
context's states.

The trie (`PagedKVTrie`) has a node per position of every context the model ran, as the
CPU path's `KVTrie` has; a node's states are one slot ``(block, offset)`` with ``offset =
position % page``. One invariant makes every row's past a plain block table: **a node at
offset ``o`` of block ``X`` finds its own path's positions ``position - o .. position - 1``
at offsets ``0 .. o - 1`` of ``X``**. So the block of a row's position ``n`` is the block of
its ancestor at the last position of ``n``'s page range (or of the row's deepest node, for
the last range), found by one jump per page (`_Node.page_start`). Rows that share a prefix
share its blocks. A row that extends a node whose block is already continued by a sibling
(two particles resampled from one) cannot append to that block: it gets a fresh block with
the first ``o`` offsets copied from it (copy-on-write, at most ``page - 1`` positions), as
vLLM does with a shared partial block.

A forward is planned (`plan`: each row's block table, the slots its new tokens write, the
copies to make first), run, then committed (`commit`: the new positions become nodes) or,
if it failed, rolled back (`release_plan`: every block it took goes back). Blocks are
evicted least recently used first when the pool runs out, never one that the batch being
planned reads or writes; a batch that needs more blocks than that leaves raises
`PagedPoolFull`, naming the budget. A block goes back to the free list when no node holds
a slot in it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from genlm_fast.backend.cache import TriePaths

__all__ = ["PagedKVPool", "PagedKVTrie", "PagedPlan", "PagedPoolFull", "RowPlan"]


class PagedPoolFull(RuntimeError):
    """A batch needs more blocks than the paged key/value pool can free for it."""


class PagedKVPool:
    """``kv``: ``[layers, 2, blocks * page, kv_heads, head_dim]`` on the model's device, and
    the free list of its blocks (block 0 is scratch, never handed out)."""

    def __init__(self, layers, kv_heads, head_dim, dtype, device, blocks, page):
        if blocks < 2:
            raise ValueError(
                f"a paged key/value pool needs at least 2 blocks of {page} positions (one is "
                f"scratch), got {blocks}: raise kv_cache_tokens / kv_cache_bytes"
            )
        self.page = page
        self.blocks = blocks
        self.kv = torch.zeros(
            (layers, 2, blocks * page, kv_heads, head_dim), dtype=dtype, device=device
        )
        self.free = list(range(blocks - 1, 0, -1))  # pop() hands out low blocks first

    @property
    def bytes_per_block(self):
        return self.kv[:, :, : self.page].numel() * self.kv.element_size()

    def copy_prefixes(self, copies):
        """For each ``(src_block, dst_block, n)``, offsets ``0 .. n - 1`` of ``src_block``
        into ``dst_block``, every layer, keys and values: one gather and one scatter."""
        if not copies:
            return
        src, dst = [], []
        for s, d, n in copies:
            src.extend(range(s * self.page, s * self.page + n))
            dst.extend(range(d * self.page, d * self.page + n))
        device = self.kv.device
        src_t = torch.tensor(src, device=device)
        dst_t = torch.tensor(dst, device=device)
        self.kv.index_copy_(2, dst_t, self.kv.index_select(2, src_t))


class _Node:
    """A prefix ending in ``token`` at ``position``; ``block`` holds its states at offset
    ``position % page`` (None: not stored). ``page_start``: the ancestor at the last position
    of the previous page range (None in the first range)."""

    __slots__ = ("block", "children", "page_start", "parent", "position", "token")

    def __init__(self, parent, token, position, page_start):
        self.parent = parent
        self.token = token
        self.position = position
        self.page_start = page_start
        self.children = {}
        self.block = None


@dataclass
class RowPlan:
    """One row of a planned forward.

    Attributes:
        ids: the row's whole context.
        depth: how many leading positions have stored states (the past).
        node: the trie node of position ``depth - 1`` (the root for no past).
        table: the row's blocks in position order, the new positions' included.
        slots: the pool slot each new token (positions ``depth ..``) writes.
    """

    ids: list
    depth: int
    node: _Node
    table: list
    slots: list

    @property
    def new(self):
        return len(self.ids) - self.depth


@dataclass
class PagedPlan:
    """A forward's rows, the blocks it took (given back if it fails), the copy-on-write
    copies to make before it runs (``(src_block, dst_block, offsets)``) and the blocks it
    continues (``(block, fill before)``, restored if it fails)."""

    rows: list
    taken: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    appended: list = field(default_factory=list)  # (block, its fill before) of blocks continued


class PagedKVTrie(TriePaths):
    """Key/value states of contexts in a `PagedKVPool`, shared along a trie of token ids
    (module docstring). ``match`` / ``gather`` / ``walk`` / ``next_tokens`` /
    ``drop_extensions`` / ``clear`` read and edit it as genlm's cache API does the CPU
    path's `KVTrie` (``match``'s second item is the matched node, which ``gather`` takes)."""

    STATE = "block"

    def __init__(self, pool):
        self.pool = pool
        self.page = pool.page
        self.root = _Node(None, None, -1, None)
        self._owners = {}  # block -> the nodes whose states it holds
        self._fill = {}  # block -> offsets written (copies and own nodes), in order
        self._lru = OrderedDict()  # block -> None, least recently used first
        # block -> the block that holds the nodes of its first offsets (they were copied on
        # write, or computed twice): a row that reads the block keeps that one too (pinned
        # and refreshed with it), or the row's path would lose its ancestors
        self._source = {}
        self._sourced = {}  # block -> the blocks whose source it is
        # the contexts of the last committed forward -> their last node, while no node has
        # lost its states since: the next step's rows extend them (found by one hash of the
        # context, not a walk down the trie)
        self._ends = {}

    def __len__(self):
        return len(self._owners)

    @property
    def blocks_used(self):
        return len(self._owners)

    # ---- reading ----------------------------------------------------------------------

    def match(self, token_ids, limit=None):
        """The longest prefix of ``token_ids[:limit]`` whose every position is stored:
        ``(length, node)``."""
        if limit is None:
            limit = len(token_ids)
        node, depth = self.root, 0
        children = node.children
        while depth < limit:
            child = children.get(token_ids[depth])
            if child is None or child.block is None:
                break
            node, children = child, child.children
            depth += 1
        return depth, node

    def table(self, node):
        """The blocks of ``node``'s path in position order (one per page range)."""
        blocks = []
        while node is not None and node.block is not None:
            blocks.append(node.block)
            node = node.page_start
        blocks.reverse()
        return blocks

    def gather(self, node):
        """The states of ``node``'s whole path, ``[layers, 2, kv_heads, length, head_dim]``
        (a copy), or None for the root."""
        if node is None or node is self.root:
            return None
        length = node.position + 1
        blocks = torch.tensor(self.table(node), device=self.pool.kv.device)
        n = torch.arange(length, device=blocks.device)
        slots = blocks[n // self.page] * self.page + n % self.page
        return self.pool.kv[:, :, slots].permute(0, 1, 3, 2, 4).contiguous()

    # ---- a forward: plan, then commit or release ------------------------------------

    def plan(self, rows):
        """Plan a forward of ``rows`` (lists of token ids, each with a new token at least):
        match each row's past, give its new positions slots, and list the copy-on-write
        copies. Raises `PagedPoolFull` (taking nothing) when the pool cannot make room."""
        plan = PagedPlan([])
        pinned = set()
        matched = []
        ends = self._ends
        for ids in rows:
            node = ends.get(tuple(ids[:-1]))
            if node is not None:
                depth = len(ids) - 1
            else:
                depth, node = self.match(ids, len(ids) - 1)
            table = self.table(node)
            pinned.update(self._with_sources(table))
            matched.append((ids, depth, node, table))
        try:
            for ids, depth, node, table in matched:
                slots = []
                offset = depth % self.page
                if offset:  # the row continues the page range of its last past position
                    block = table[-1]
                    if self._fill.get(block, 0) == offset:
                        plan.appended.append((block, offset))
                    else:  # a sibling continued it already: copy-on-write
                        fresh = self._take(plan, pinned)
                        plan.copies.append((block, fresh, offset))
                        table[-1] = block = fresh
                for position in range(depth, len(ids)):
                    offset = position % self.page
                    if offset == 0:
                        block = self._take(plan, pinned)
                        table.append(block)
                    self._fill[block] = offset + 1
                    slots.append(block * self.page + offset)
                plan.rows.append(RowPlan(list(ids), depth, node, table, slots))
        except PagedPoolFull:
            self.release_plan(plan)
            raise
        return plan

    def _with_sources(self, blocks):
        """``blocks`` and the blocks their copied offsets came from, transitively."""
        for block in blocks:
            while block is not None:
                yield block
                block = self._source.get(block)

    def _take(self, plan, pinned):
        """A free block for ``plan`` (evicting the least recently used block that no row of
        it reads, if none is free)."""
        pool = self.pool
        if not pool.free:
            for block in self._lru:
                if block not in pinned:
                    self._evict(block)
                    break
        if not pool.free:
            raise PagedPoolFull(
                f"the paged key/value pool holds {pool.blocks - 1} blocks of {pool.page} "
                f"positions ({(pool.blocks - 1) * pool.page} positions, "
                f"{(pool.blocks - 1) * pool.bytes_per_block} bytes: kv_cache_tokens / "
                "kv_cache_bytes), and this batch's pasts and new positions need more than "
                "that: raise the budget or send fewer or shorter rows per batch"
            )
        block = pool.free.pop()
        self._fill[block] = 0
        plan.taken.append(block)
        pinned.add(block)
        return block

    def commit(self, plan):
        """The planned forward ran: its new positions become nodes holding their slots.
        A position some other row of the batch (or an earlier one) stored already keeps
        those states; a block left holding no node goes back to the pool."""
        page = self.page
        touched = []
        ends = self._ends = {}
        for row in plan.rows:
            node = row.node
            for position in range(row.depth, len(row.ids)):
                tok = row.ids[position]
                child = node.children.get(tok)
                if child is None:
                    start = node if position % page == 0 else node.page_start
                    if position % page == 0 and node is self.root:
                        start = None
                    child = node.children[tok] = _Node(node, tok, position, start)
                if child.block is None:
                    block = row.table[position // page]
                    child.block = block
                    self._owners.setdefault(block, []).append(child)
                    if position % page and node.block != block:
                        # its ancestors in this range are nodes of another block (a
                        # copy-on-write, or the same prefix computed twice in one batch)
                        if block not in self._source:
                            self._source[block] = node.block
                            self._sourced.setdefault(node.block, set()).add(block)
                node = child
            touched.append(row.table)
            ends[tuple(row.ids)] = node
        for block in plan.taken:
            if block not in self._owners:
                self._give_back(block)
        lru = self._lru
        for table in touched:  # deepest first, so that a path's shallow blocks stay longest
            for block in self._with_sources(reversed(table)):
                if block in self._owners:
                    lru[block] = None
                    lru.move_to_end(block)

    def release_plan(self, plan):
        """The planned forward failed: every block it took goes back, and the blocks it
        continued are as they were."""
        for block in plan.taken:
            self._give_back(block)
        for block, fill in plan.appended:
            if block in self._fill:
                self._fill[block] = fill

    # ---- forgetting -------------------------------------------------------------------

    def _give_back(self, block):
        source = self._source.pop(block, None)
        if source is not None:
            self._sourced[source].discard(block)
        for copy in self._sourced.pop(block, ()):  # their ancestors' states are gone
            del self._source[copy]
        self._owners.pop(block, None)
        self._fill.pop(block, None)
        self._lru.pop(block, None)
        self.pool.free.append(block)

    def _evict(self, block):
        """Forget the states block ``block`` holds. Their stored descendants in other blocks
        stay, unreachable (``match`` stops at the gap) until they are evicted in turn or
        the gap is computed again."""
        self._ends = {}
        for node in self._owners.get(block, ()):
            node.block = None
            if not node.children:
                self._prune(node)
        self._give_back(block)

    def _forget_below(self, node):
        """Forget the states of ``node`` and of everything below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            block, n.block = n.block, None
            if block is None:
                continue
            self._ends = {}
            owners = self._owners.get(block)
            if owners is not None:
                owners.remove(n)
                if not owners:
                    self._give_back(block)
        self._prune(node)

    def drop_extensions(self, token_ids):
        """Forget the states of every context that strictly extends ``token_ids``."""
        node = self.root
        for tok in token_ids:
            node = node.children.get(tok)
            if node is None:
                return
        for child in list(node.children.values()):
            self._forget_below(child)
            if child.parent is not None:  # kept by nothing now
                del node.children[child.token]
                child.parent = None

    def clear(self):
        """Forget every context; every block goes back to the pool."""
        for block in list(self._owners):
            self._give_back(block)
        self._ends = {}
        self._fill.clear()
        self._source.clear()
        self._sourced.clear()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children = {}
            node.parent = node.page_start = None
        self.root = _Node(None, None, -1, None)
