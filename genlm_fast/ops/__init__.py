"""The kernel-facing layer: two ops, each with interchangeable backends.

``trie_reduce(values, layout, reduction, mode, backend)`` maps rows of per-token values
``[B, C]`` to per-node values ``[B, N]``:

* ``"sum"``      node = sum of its leaves' weights (0 for a node with no leaves)
* ``"max"``      node = max of its leaves' weights (0 for a node with no leaves)
* ``"log_mass"`` values are raw logits; node = log of the softmax mass beneath it
                 (log-softmax over the whole row, then log-sum-exp over the leaves;
                 ``-inf`` for a node with no leaves or only ``-inf`` logits)

Backends (same semantics, tested against each other):
``reference`` (plain torch, float64), ``triton`` (fused GPU kernels in ``genlm_fast.kernels``),
``cuda`` and ``cpu`` (C++ extension built from ``csrc/``).

``log_softmax.log_softmax_rows(logits, src, dst, out)`` writes the log-softmax of selected
logit rows into selected rows of a buffer (how the vLLM backend captures log-probabilities
inside the engine): ``reference`` (torch, float64) and ``triton``.
"""

from genlm_fast.ops.dispatch import (
    BACKENDS,
    REDUCTIONS,
    available_backends,
    resolve_backend,
    trie_reduce,
)
from genlm_fast.ops.layout import TILE, TrieLayout

__all__ = [
    "BACKENDS",
    "REDUCTIONS",
    "TILE",
    "TrieLayout",
    "available_backends",
    "resolve_backend",
    "trie_reduce",
]
