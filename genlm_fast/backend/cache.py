"""Caches for the language-model backends.

`OutputCache` is the bounded LRU map of genlm.backend (same constructor and mapping
behaviour). `KVTrie` stores key/value states of a causal transformer along a trie of
token ids, so that a query sharing a prefix with earlier queries only runs the model on
the tokens past that prefix.
"""

from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from typing import NamedTuple

import torch

__all__ = ["KVRun", "KVSegment", "KVTrie", "OutputCache", "kv_bytes_per_position", "trim_heap"]


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap():
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``;
    elsewhere nothing). A cache's entries are small allocations (an output row, a key/value
    segment of a few positions: tens to hundreds of KB), which glibc serves from its heap
    and keeps there when freed, so emptying the caches alone gives back only part of what
    they held."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def kv_bytes_per_position(config, element_size):
    """Bytes of key/value states that one position of a context takes in a `KVTrie`, for
    a Hugging Face model ``config`` computing in a dtype of ``element_size`` bytes: layers
    x 2 (keys and values) x key/value heads x head size x element size.

    Returns:
        (tuple[int, str]): The bytes, and how they were counted (for messages).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    total = layers * 2 * heads * head_dim * int(element_size)
    return total, f"{layers} layers x 2 x {heads} heads x {head_dim} x {element_size} bytes"


class OutputCache:
    """A size-bounded LRU mapping from keys to tensors.

    Args:
        maxsize (int): Most entries kept; the least recently used one is evicted first.
            A size of 0 or less keeps nothing.
        move_to_cpu (bool): Keep stored tensors on the CPU, and move them back to the
            device they came from when read.
    """

    def __init__(self, maxsize, move_to_cpu=False):
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        # key -> (original device, stored tensor); order = recency, oldest first
        self.cache = OrderedDict()

    def __getitem__(self, key):
        device, value = self.cache[key]  # KeyError propagates as for a dict
        self.cache.move_to_end(key)
        if self.move_to_cpu and value.device != device:
            return value.to(device)
        return value

    def get(self, key, default=None):
        """Return the entry for ``key`` (refreshing it), or ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key, value):
        if self.maxsize <= 0:
            return
        if key in self.cache:
            del self.cache[key]
        while len(self.cache) >= self.maxsize:
            self.cache.popitem(last=False)
        stored = value.cpu() if self.move_to_cpu else value
        self.cache[key] = (value.device, stored)

    def __contains__(self, key):
        return key in self.cache

    def __len__(self):
        return len(self.cache)

    def pop(self, key, default=None):
        """Remove ``key``; return its tensor (as stored) or ``default``."""
        entry = self.cache.pop(key, None)
        return default if entry is None else entry[1]

    def discard_where(self, predicate):
        """Remove every entry whose key satisfies ``predicate``."""
        for key in [k for k in self.cache if predicate(k)]:
            del self.cache[key]

    def clear(self):
        self.cache.clear()


class _Node:
    """A trie node: the prefix ending in ``token``. ``seg``/``off`` locate its KV, if any."""

    __slots__ = ("children", "off", "parent", "seg", "token")

    def __init__(self, parent, token):
        self.parent = parent
        self.token = token
        self.children = {}
        self.seg = None
        self.off = 0


class KVSegment:
    """Key/value states of a run of consecutive positions, computed by one forward pass.

    ``data`` has shape ``[layers, 2, kv_heads, length, head_dim]`` (index 0 keys, 1
    values). ``nodes`` are the trie nodes that read their KV from it. ``slot`` is its
    place in a `_SlotPool` (one position), or None when ``data`` is a tensor of its own:
    the slot goes back to the pool when the segment itself is freed, so that a caller
    still holding it (a forward's runs, matched before an eviction) reads its data intact.
    """

    __slots__ = ("__weakref__", "data", "nodes", "slot")

    def __init__(self, data):
        self.data = data
        self.nodes = []
        self.slot = None  # (pool, chunk, index)

    @property
    def length(self):
        return self.data.shape[3]

    @property
    def nbytes(self):
        return self.data.numel() * self.data.element_size()

    def __del__(self):
        if self.slot is not None:
            pool, chunk, index = self.slot
            self.slot = None
            pool.give_back(chunk, index)


class KVRun(NamedTuple):
    """Consecutive stored positions of a context, read from one segment: positions
    ``start .. stop - 1`` of ``segment.data`` (``[layers, 2, kv_heads, length, head_dim]``)."""

    segment: KVSegment
    start: int
    stop: int


class _SlotPool:
    """Storage for a `KVTrie`'s one-position segments (one per particle and step of SMC: most
    of them), in slots of chunks ``[layers, 2, kv_heads, S, head_dim]`` of at least 33 MiB.

    Each such segment on its own was a small allocation (46 KB for SmolLM2) with a lifetime
    set by the eviction order, and glibc's heap fragmented under them: with SmolLM2's caches
    full (956 MB), 370 MB of free heap stayed resident. A chunk this size is a mapping of its
    own (glibc maps anything over 32 MiB), so the slots are reused in place and a chunk
    whose slots are all free goes straight back to the system.
    """

    CHUNK_BYTES = 33 << 20

    def __init__(self, like, capacity):
        layers, two, heads, _, dim = like.shape
        self.shape = (layers, two, heads, dim)
        self.dtype, self.device = like.dtype, like.device
        per_slot = like.numel() // like.shape[3] * like.element_size()
        # (no bigger than the trie's budget: a small budget's chunk is a heap allocation,
        # but a single long-lived one)
        self.slots = max(1, min(capacity, -(-self.CHUNK_BYTES // per_slot)))
        self.chunks = {}  # chunk number -> tensor
        self.free = []  # (chunk, index) of free slots
        self.used = {}  # chunk number -> slots in use
        self._next = 0

    def fits(self, data):
        return (
            data.shape[3] == 1
            and (data.shape[:3] + data.shape[4:]) == self.shape
            and data.dtype == self.dtype
            and data.device == self.device
        )

    def take(self, data):
        """A slot holding a copy of ``data`` ``[layers, 2, heads, 1, dim]``: (its view,
        (pool, chunk, index))."""
        if not self.free:
            chunk = self._next
            self._next += 1
            layers, two, heads, dim = self.shape
            self.chunks[chunk] = torch.empty(
                (layers, two, heads, self.slots, dim), dtype=self.dtype, device=self.device
            )
            self.used[chunk] = 0
            self.free = [(chunk, i) for i in range(self.slots - 1, -1, -1)]
        chunk, i = self.free.pop()
        view = self.chunks[chunk][:, :, :, i : i + 1]
        view.copy_(data)
        self.used[chunk] += 1
        return view, (self, chunk, i)

    def give_back(self, chunk, i):
        self.used[chunk] -= 1
        self.free.append((chunk, i))
        if self.used[chunk] == 0 and sum(1 for n in self.used.values() if n == 0) > 1:
            # no segment reads it any more, and another empty chunk is spare already: its
            # memory goes back (one spare stays, so that a trie at its budget, evicting
            # segments a forward still holds, does not map and unmap a chunk each time)
            del self.chunks[chunk], self.used[chunk]
            self.free = [(c, j) for c, j in self.free if c != chunk]


class TriePaths:
    """What a trie of token ids (``self.root``, nodes with ``children`` by token and a
    ``parent``) answers by path; the key/value tries share it. ``STATE``: the node attribute
    that holds its key/value states (None: not stored)."""

    STATE = "seg"

    def walk(self, token_ids):
        """How many leading tokens of ``token_ids`` the trie has nodes for (with or
        without key/value states)."""
        node = self.root
        depth = 0
        for tok in token_ids:
            node = node.children.get(tok)
            if node is None:
                break
            depth += 1
        return depth

    def next_tokens(self, token_ids):
        """The tokens that extend the prefix ``token_ids`` in the trie, in insertion order
        (empty if the trie has no node for that prefix)."""
        node = self.root
        for tok in token_ids:
            node = node.children.get(tok)
            if node is None:
                return []
        return list(node.children)

    def _prune(self, node):
        """Unlink ``node`` and its ancestors while they hold no states and no children."""
        state = self.STATE
        while node.parent is not None and getattr(node, state) is None and not node.children:
            parent = node.parent
            del parent.children[node.token]
            node.parent = None
            node = parent


class KVTrie(TriePaths):
    """Key/value states of a causal LM, shared along a trie of token ids.

    Each node stands for a prefix and may hold the KV of its last position as a slice
    of a `KVSegment`. A prefix is usable as past only if every position of it has KV;
    `match` finds the longest usable prefix of a query and `gather` assembles it.
    Segments are evicted least-recently-used first once more than ``max_tokens``
    positions, or more than ``max_bytes`` bytes, are held. Ancestors are always
    refreshed after their descendants, so leaves go before the prefixes they extend.

    Args:
        max_tokens (int): Budget, in positions, over all stored segments.
        max_bytes (int, optional): Budget, in bytes of key/value data, over all stored
            segments; None for none (the positions' budget alone).
    """

    def __init__(self, max_tokens=8192, max_bytes=None):
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.root = _Node(None, None)
        self._lru = OrderedDict()  # id(segment) -> segment, oldest first
        self.n_tokens = 0
        self.n_bytes = 0
        self._pool = None  # _SlotPool of the one-position segments (CPU), made on first use

    def __len__(self):
        return len(self._lru)

    def clear(self):
        """Drop every node and segment. The nodes are unlinked one by one: a child points
        back to its parent, so a tree merely dropped would hold its segments (and their
        memory) until the garbage collector found the cycles."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children = {}
            node.parent = node.seg = None
        for seg in self._lru.values():
            seg.nodes = []
        self.root = _Node(None, None)
        self._lru.clear()
        self._pool = None
        self.n_tokens = 0
        self.n_bytes = 0

    def match(self, token_ids, limit=None):
        """Longest prefix of ``token_ids[:limit]`` whose KV is fully stored.

        Returns:
            (tuple[int, list[KVRun]]): The prefix length, and its KV as runs in position
            order.
        """
        if limit is None:
            limit = len(token_ids)
        node = self.root
        runs = []
        depth = 0
        while depth < limit:
            child = node.children.get(token_ids[depth])
            if child is None or child.seg is None:
                break
            node = child
            if runs and runs[-1].segment is child.seg and runs[-1].stop == child.off:
                runs[-1] = runs[-1]._replace(stop=child.off + 1)
            else:
                runs.append(KVRun(child.seg, child.off, child.off + 1))
            depth += 1
        return depth, runs

    @staticmethod
    def gather(runs):
        """Concatenate the runs of `match` into one ``[layers, 2, heads, length, dim]`` tensor
        (a view of a segment's data only when that is a tensor of its own: a pooled slot is
        reused once its segment is gone)."""
        if not runs:
            return None
        parts = [seg.data[:, :, :, a:b] for seg, a, b in runs]
        if len(parts) == 1:
            return parts[0].clone() if runs[0][0].slot is not None else parts[0]
        return torch.cat(parts, dim=3)

    def touch(self, runs):
        """Mark the segments of ``runs`` as just used, the shallowest most recent."""
        for seg, _, _ in reversed(runs):
            key = id(seg)
            if key in self._lru:
                self._lru.move_to_end(key)

    def insert(self, token_ids, start, data, runs=()):
        """Store ``data`` as the KV of positions ``start .. start + data.shape[3] - 1``.

        Nodes along ``token_ids`` are created as needed; nodes that already have KV keep
        it. ``runs`` (the past this data was computed on) are refreshed together with
        the new segment. Returns the segment, or None when no node needed it.
        """
        length = data.shape[3]
        node = self.root
        for pos in range(start):
            child = node.children.get(token_ids[pos])
            if child is None:
                child = node.children[token_ids[pos]] = _Node(node, token_ids[pos])
            node = child
        seg = KVSegment(data)
        for off in range(length):
            tok = token_ids[start + off]
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node(node, tok)
            if child.seg is None:
                child.seg = seg
                child.off = off
                seg.nodes.append(child)
            node = child
        if not seg.nodes:
            self.touch(runs)
            return None
        self._lru[id(seg)] = seg
        self.n_tokens += length
        self.n_bytes += seg.nbytes
        self.touch(runs)
        self._evict()
        if length == 1 and data.device.type == "cpu" and id(seg) in self._lru:
            # into the pool once eviction made room, so the pool outgrows the budget by no
            # more than its spare chunk
            if self._pool is None:
                self._pool = _SlotPool(data, self._capacity(seg.nbytes))
            if self._pool.fits(data):
                seg.data, seg.slot = self._pool.take(data)
        return seg

    def _capacity(self, per_position):
        """The most positions the budgets allow."""
        if self.max_bytes is None:
            return max(1, self.max_tokens)
        return max(1, min(self.max_tokens, self.max_bytes // max(1, per_position)))

    def _over(self):
        return self.n_tokens > self.max_tokens or (
            self.max_bytes is not None and self.n_bytes > self.max_bytes
        )

    def _evict(self):
        while self._lru and self._over():
            _, seg = self._lru.popitem(last=False)
            self._drop(seg)

    def _drop(self, seg):
        self.n_tokens -= seg.length
        self.n_bytes -= seg.nbytes
        for node in seg.nodes:
            if node.seg is seg:
                node.seg = None
                self._prune(node)
        seg.nodes = []

    def drop_extensions(self, token_ids):
        """Forget the states of every context that strictly extends ``token_ids`` (the
        prefix's own states stay). A segment that also holds positions of the prefix
        keeps its memory until those are evicted too."""
        node = self.root
        for tok in token_ids:
            node = node.children.get(tok)
            if node is None:
                return
        stack = list(node.children.values())
        node.children = {}
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            below.children = {}
            below.parent = None
            seg, below.seg = below.seg, None
            if seg is None:
                continue
            seg.nodes.remove(below)
            if not seg.nodes and self._lru.pop(id(seg), None) is not None:
                self.n_tokens -= seg.length
        self._prune(node)
