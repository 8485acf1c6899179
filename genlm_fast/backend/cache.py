"""Caches for the language-model backends.

`OutputCache` is the bounded LRU map of genlm.backend (same constructor and mapping
behaviour). `KVTrie` stores key/value states of a causal transformer along a trie of
token ids, so that a query sharing a prefix with earlier queries only runs the model on
the tokens past that prefix.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["KVSegment", "KVTrie", "OutputCache"]


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
    values). ``nodes`` are the trie nodes that read their KV from it.
    """

    __slots__ = ("__weakref__", "data", "nodes")

    def __init__(self, data):
        self.data = data
        self.nodes = []

    @property
    def length(self):
        return self.data.shape[3]


class KVTrie:
    """Key/value states of a causal LM, shared along a trie of token ids.

    Each node stands for a prefix and may hold the KV of its last position as a slice
    of a `KVSegment`. A prefix is usable as past only if every position of it has KV;
    `match` finds the longest usable prefix of a query and `gather` assembles it.
    Segments are evicted least-recently-used first once more than ``max_tokens``
    positions are held. Ancestors are always refreshed after their descendants, so
    leaves go before the prefixes they extend.

    Args:
        max_tokens (int): Budget, in positions, over all stored segments.
    """

    def __init__(self, max_tokens=8192):
        self.max_tokens = max_tokens
        self.root = _Node(None, None)
        self._lru = OrderedDict()  # id(segment) -> segment, oldest first
        self.n_tokens = 0

    def __len__(self):
        return len(self._lru)

    def clear(self):
        """Drop every node and segment."""
        self.root = _Node(None, None)
        self._lru.clear()
        self.n_tokens = 0

    def match(self, token_ids, limit=None):
        """Longest prefix of ``token_ids[:limit]`` whose KV is fully stored.

        Returns:
            (tuple[int, list]): The prefix length, and its KV as runs
            ``(segment, start, stop)`` in position order.
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
            if runs and runs[-1][0] is child.seg and runs[-1][2] == child.off:
                seg, start, _ = runs[-1]
                runs[-1] = (seg, start, child.off + 1)
            else:
                runs.append((child.seg, child.off, child.off + 1))
            depth += 1
        return depth, runs

    @staticmethod
    def gather(runs):
        """Concatenate the runs of `match` into one ``[layers, 2, heads, length, dim]`` tensor."""
        if not runs:
            return None
        parts = [seg.data[:, :, :, a:b] for seg, a, b in runs]
        if len(parts) == 1:
            return parts[0]
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
        self.touch(runs)
        self._evict()
        return seg

    def _evict(self):
        while self.n_tokens > self.max_tokens and self._lru:
            _, seg = self._lru.popitem(last=False)
            self._drop(seg)

    def _drop(self, seg):
        self.n_tokens -= seg.length
        for node in seg.nodes:
            if node.seg is seg:
                node.seg = None
                self._prune(node)
        seg.nodes = []

    @staticmethod
    def _prune(node):
        while node.parent is not None and node.seg is None and not node.children:
            parent = node.parent
            del parent.children[node.token]
            node.parent = None
            node = parent

    # ---- reading the trie by path (genlm's cache-trie API is built on these) ----------

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
