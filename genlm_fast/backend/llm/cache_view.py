"""genlm.backend's cache trie, read from `AsyncTransformer`'s own caches.

genlm's ``AsyncTransformer`` keeps one trie of token ids per adapter (``_caches``), whose
nodes hold the next-token log probabilities of their prefix and, where ``cache_kv`` put
them, its key/value states; ``walk_cache`` follows a context down that trie. genlm_fast
keeps key/value states in a `KVTrie` per adapter (one node per position) and log
probabilities in the output cache; `CacheNode` shows them in genlm's shape:

* a node is a prefix of a context that either holds: the key/value trie (every context this
  model ran, and every prompt given to ``cache_kv``, until evicted) or the output cache
  (every context whose answer is cached). So, as in genlm, ``walk_cache`` matches a whole
  context exactly when asking for it again would be answered without the model;
* ``past_key_values`` is a ``DynamicCache`` of the whole prefix (batch 1) when every one of
  its positions has key/value states, else None; ``logprobs`` the prefix's next-token log
  probabilities when the output cache holds them, else None.

A node is a view by path (model, adapter, prefix), so it always shows the caches as they
are now and never keeps evicted states alive.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["CacheNode", "CacheTries"]


def dynamic_cache(kv):
    """A transformers ``DynamicCache`` (batch 1) holding ``kv``, ``[layers, 2, heads, T,
    dim]`` as the `KVTrie` stores it (copied: the trie's tensors stay its own)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None].clone(), kv[layer, 1][None].clone(), layer)
    return cache


class CacheNode:
    """One prefix of an adapter's key/value trie, with genlm's ``TokenTrie`` reading API
    (``children``, ``has_token``, ``get_token``, ``past_key_values``, ``logprobs``)."""

    __slots__ = ("_lm", "_lora", "prefix")

    def __init__(self, lm, lora, prefix):
        self._lm = lm
        self._lora = lora
        self.prefix = tuple(prefix)

    def _trie(self):
        return self._lm._kv_trie(self._lora)

    def has_token(self, token_id):
        """Whether the prefix extended by ``token_id`` is in the trie."""
        path = (*self.prefix, token_id)
        return matched(self._lm, self._lora, path) == len(path)

    def get_token(self, token_id):
        """The child node for ``token_id``; KeyError if the trie has none."""
        if not self.has_token(token_id):
            raise KeyError(token_id)
        return CacheNode(self._lm, self._lora, (*self.prefix, token_id))

    @property
    def children(self):
        """``{token_id: CacheNode}`` of the prefixes one token longer that the trie holds."""
        n = len(self.prefix)
        tokens = dict.fromkeys(self._trie().next_tokens(self.prefix))
        for context in _cached_contexts(self._lm, self._lora):
            if len(context) > n and context[:n] == self.prefix:
                tokens[context[n]] = None
        return {tok: CacheNode(self._lm, self._lora, (*self.prefix, tok)) for tok in tokens}

    @property
    def past_key_values(self):
        """The key/value states of the whole prefix as a ``DynamicCache``, or None."""
        if not self.prefix:
            return None
        trie = self._trie()
        depth, runs = trie.match(self.prefix)
        if depth < len(self.prefix):
            return None
        return dynamic_cache(trie.gather(runs))

    @property
    def logprobs(self):
        """The cached next-token log probabilities of the prefix (a copy), or None."""
        with self._lm._lock:
            row = self._lm._outputs.get((self._lora, self.prefix))
        return None if row is None else row.clone()

    def _has_past(self):
        return bool(self.prefix) and self._trie().match(self.prefix)[0] == len(self.prefix)

    def __repr__(self):
        # genlm's format: [token: child, ...], a node with key/value states marked '*'
        parts = [f"{tok}: {child!r}" for tok, child in self.children.items()]
        return ("*" if self._has_past() else "") + "[" + ", ".join(parts) + "]"


def _cached_contexts(lm, lora):
    with lm._lock:
        return [key[1] for key in lm._outputs.cache if key[0] == lora]


def _common_length(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def matched(lm, lora, token_ids):
    """How many leading tokens of ``token_ids`` are a node (see the module's docstring)."""
    depth = lm._kv_trie(lora).walk(token_ids)
    for context in _cached_contexts(lm, lora):
        depth = max(depth, _common_length(context, token_ids))
    return depth


class CacheTries(Mapping):
    """genlm's ``_caches``: adapter name (None for the base model) -> the root
    `CacheNode` of that adapter's key/value trie (made empty on first use, as genlm's
    ``defaultdict`` does)."""

    def __init__(self, lm):
        self._lm = lm

    def __getitem__(self, lora):
        self._lm._kv_trie(lora)
        return CacheNode(self._lm, lora, ())

    def __iter__(self):
        return iter(list(self._lm._kv_tries))

    def __len__(self):
        return len(self._lm._kv_tries)
