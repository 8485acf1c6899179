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

__all__ = ["CacheNode", "CacheTries", "GenlmCacheTrie"]


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


class GenlmCacheTrie:
    """genlm's ``AsyncTransformer`` cache internals (``_caches``, ``walk_cache``,
    ``add_query``; genlm's own tests use them), read from and fed to `AsyncTransformer`'s
    own caches and batcher. The host (`AsyncTransformer`) provides the batcher's
    ``_check_open``, ``_resolve_lora``, ``_check_context``, ``_prepare`` and ``_enqueue``,
    the key/value tries (``_kv_trie``, ``_kv_tries``) and ``_walked_pasts``, a
    ``WeakKeyDictionary`` from each past `walk_cache` returned to its adapter and prefix."""

    @property
    def _caches(self):
        """genlm's per-adapter cache tries: ``_caches[lora_name]`` is the root `CacheNode`
        of that adapter's key/value trie (None: the base model)."""
        return CacheTries(self)

    def walk_cache(self, token_ids, lora_name=None):
        """Follow ``token_ids`` down the adapter's key/value trie.

        Returns:
            (tuple): ``(node, next_token_index, past, base)``: the deepest `CacheNode` on
            the path and how many tokens it matched (all of them exactly when the answer
            for ``token_ids`` is cached or its states are stored); ``past``, a
            ``DynamicCache`` of the states of ``token_ids[:base]``, the longest fully stored
            prefix that leaves at least one token to run (None, with ``base`` 0, when there
            is none).
            ``add_query(token_ids[base:], future, past)`` runs the rest on it.
        """
        self._check_open()
        lora = self._resolve_lora(lora_name)
        ids = self._check_context(token_ids) if len(token_ids) else ()
        trie = self._kv_trie(lora)
        depth = matched(self, lora, ids)
        base, runs = trie.match(ids, max(len(ids) - 1, 0))
        past = None
        if base:
            past = dynamic_cache(trie.gather(runs))
            self._walked_pasts[past] = (lora, ids[:base])
        return CacheNode(self, lora, ids[:depth]), depth, past, base

    def add_query(self, query, future, past, lora_name=None):
        """Queue ``query`` for the next batch; ``future`` gets its next-token logits.

        Args:
            query (list[int]): The context's tokens after ``past`` (all of them if None).
            future (asyncio.Future): Set to the next-token logits ``[V']`` on the model's
                device (genlm_fast computes the last position only), or to the error that
                prevented them; it must belong to the running event loop.
            past: None, or a ``past`` that `walk_cache` returned for this adapter.
            lora_name (str, optional): The adapter; None for the default.

        Raises:
            ValueError: ``past`` did not come from `walk_cache` (genlm_fast finds stored
                states itself: pass the whole context and ``past=None``).
        """
        lora = self._resolve_lora(lora_name)
        prefix = ()
        if past is not None:
            try:
                walked = self._walked_pasts.get(past)
            except TypeError:  # not even weak-referenceable: not walk_cache's
                walked = None
            if walked is None or walked[0] != lora:
                raise ValueError(
                    "add_query's past must be one that walk_cache returned for the same "
                    "adapter; pass the whole context with past=None instead (stored "
                    "key/value states are found and reused automatically)"
                )
            prefix = walked[1]
        _, ids = self._prepare(list(prefix) + list(query), lora_name)
        self._enqueue(lora, ids, "raw", future=future)
