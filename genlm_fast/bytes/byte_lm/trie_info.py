"""What the states of one trie share (`info_of`): its structure, its mass pools, the rows
computed from it (remembered per model, see `model_key`) and the fused path's counters
(`fused_stats`)."""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
import torch

from genlm_fast.bytes.byte_lm.mass_rows import MassPool

__all__ = ["fused_stats", "info_of", "model_key"]

LOOKAHEAD_ROWS = 64  # most logit rows computed ahead of need kept per trie


def model_key(model):
    """What results computed from ``model`` are remembered under: its identity and its
    ``state_epoch``, which genlm_fast's LMs move whenever calls without ``lora_name`` may
    start giving other answers (the default adapter changed, clear_cache())."""
    return id(model), getattr(model, "state_epoch", 0)


class _TrieInfo:
    """What the states of one trie share: structure, device pools, memo of rows, counters.

    Kept in a WeakKeyDictionary keyed by the trie, so it holds no reference to the trie.
    """

    def __init__(self, trie):
        self.children = trie.children
        self.root = trie.root
        self.eos_node = trie.eos_node
        self.eot_sentinel = trie.eot_sentinel
        self.num_nodes = int(trie.layout.num_nodes)
        self._edge_arrays = {}  # node -> edge_arrays(node), or False
        self.pools = {}
        # (model_key(model), mode, context) -> _Row while some state uses that row
        self.memo = weakref.WeakValueDictionary()
        # (model_key(model), context) -> (weakref to model, logits row): contexts computed ahead of
        # need (see ``materialize_states``), consumed by the first materialization using them
        self.logits_memo = OrderedDict()
        self.stats = {
            "lm_batches": 0,
            "lm_rows": 0,
            "kernel_launches": 0,
            "gathers": 0,
            "gathered_values": 0,
            "memo_hits": 0,
            "lookahead_rows": 0,
            "lookahead_hits": 0,
        }

    def take_logits(self, model, ctx):
        entry = self.logits_memo.pop((model_key(model), ctx), None)
        if entry is not None and entry[0]() is model:
            return entry[1]
        return None

    def keep_logits(self, model, ctx, row, key_model):
        """Keep ``row``, the logits of ``ctx``, under ``key_model``: the model's key
        (``model_key``) when the row was asked for."""
        try:
            ref = weakref.ref(model)
        except TypeError:  # a model that cannot be weakly referenced: no lookahead
            return
        memo = self.logits_memo
        key = (key_model, ctx)
        memo[key] = (ref, row)
        memo.move_to_end(key)
        while len(memo) > LOOKAHEAD_ROWS:
            memo.popitem(last=False)

    def pool(self, device):
        key = str(device)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = MassPool(self.num_nodes, torch.device(device), self.stats)
        return pool

    def edge_arrays(self, node):
        """The edges out of ``node`` as index arrays, in the children's order: (bytes,
        their child nodes, the end-of-token leaves); None when an edge is keyed by anything
        else (logp_next then names it)."""
        got = self._edge_arrays.get(node)
        if got is None:
            keys, kids, eots = [], [], []
            for key, child in self.children[node].items():
                if isinstance(key, tuple):
                    eots.append(child)
                elif isinstance(key, (int, np.integer)):
                    keys.append(int(key))
                    kids.append(child)
                else:
                    got = False
                    break
            else:
                got = tuple(np.array(a, dtype=np.intp) for a in (keys, kids, eots))
            self._edge_arrays[node] = got
        return got or None

    def eot_edges(self, node):
        sentinel = self.eot_sentinel
        return [
            (child, key[1])
            for key, child in self.children[node].items()
            if isinstance(key, tuple) and key[0] == sentinel
        ]


_INFOS = weakref.WeakKeyDictionary()


def info_of(trie) -> _TrieInfo:
    info = _INFOS.get(trie)
    if info is None:
        info = _INFOS[trie] = _TrieInfo(trie)
    return info


def fused_stats(obj) -> dict:
    """Counters of the fused path for the trie of ``obj`` (a state, beam or trie).

    ``lm_batches`` (LM calls), ``lm_rows`` (contexts sent), ``kernel_launches``
    (``batch_log_mass`` calls), ``gathers`` (index_select + device-to-host transfers),
    ``gathered_values`` (floats transferred), ``memo_hits`` (rows reused).
    """
    states = getattr(obj, "states", None)
    if states is not None:
        if not states:
            raise ValueError("an empty beam has no trie to report on")
        obj = states[0]
    trie = getattr(obj, "trie", obj)
    trie = getattr(trie, "trie", trie)
    return info_of(trie).stats
