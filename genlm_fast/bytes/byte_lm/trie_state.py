"""``LazyTrieState``: one hypothesis of the byte-level beam.

A state is a token context (``StatefulTokenizedLM``) plus a position in the byte trie (the
bytes of a token not yet committed). Its weight is the log-probability of the bytes read so
far along this tokenization. Reading the next byte only needs the log-mass of the trie
nodes around the current position: the current node and its children (and, for token
healing, the nodes of its path). Those masses come from materializing the state (see
``materialize``), which keeps them in the trie's pool (see ``mass_rows``).
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np

from genlm_fast.bytes.byte_lm.lm_state import StatefulTokenizedLM
from genlm_fast.bytes.byte_lm.mass_rows import as_row, gather
from genlm_fast.bytes.byte_lm.materialize import materialize_states
from genlm_fast.bytes.byte_lm.trie_info import info_of
from genlm_fast.bytes.trie import (
    EOS,
    AsyncTokenByteTrie,
    TokenByteTrie,
    TrieMode,
    as_mode,
)
from genlm_fast.bytes.util import (
    EOT_INDEX,
    NUM_SYMBOLS,
    LazyByteProbs,
    as_index,
    escape,
)

__all__ = ["EOS", "LazyTrieState", "TrieMode", "check_byte"]

NEG_INF = -math.inf


def check_byte(b) -> int:
    """``b`` as an int in 0..255, or 257 (EOS); TypeError / ValueError otherwise. 256 (the
    end-of-token slot of next-byte distributions) is not a byte one can append."""
    hint = " (use b[0] or ord(c) for a single byte)" if isinstance(b, (bytes, str)) else ""
    value = as_index(b, "a byte must be an int in 0..255, or 257 for EOS", hint)
    if not (0 <= value < 256 or value == EOS):
        what = " (256 is the end-of-token slot, not a byte)" if value == 256 else ""
        raise ValueError(f"byte {value} is out of range: expected 0..255, or 257 for EOS{what}")
    return value


def _as_async_trie(trie):
    if isinstance(trie, AsyncTokenByteTrie):
        return trie
    if isinstance(trie, TokenByteTrie):
        return AsyncTokenByteTrie(trie)
    inner = getattr(trie, "trie", None)
    if inner is not None and hasattr(inner, "batch_log_mass") and hasattr(inner, "layout"):
        return trie
    raise TypeError(
        f"LazyTrieState needs a genlm_fast AsyncTokenByteTrie (or TokenByteTrie), "
        f"got {type(trie).__module__}.{type(trie).__name__}"
    )


class LazyTrieState:
    """A position in the byte trie under a token context, with a log-weight.

    Args:
        lm_state (StatefulTokenizedLM): the committed tokens.
        trie (AsyncTokenByteTrie): the byte trie of the model's vocabulary.
        node (int): the current trie node (the bytes of the token being read).
        weight (float): log-probability of every byte read so far along this path.
        mass (optional): the log-masses of the trie nodes under this context: normally set
            by materialization (a device-resident row); a 1-D array is also accepted.
        mode (TrieMode): how EOS tokens count (``WITH_EOS``: towards the EOS node only).
        terminated (bool): whether EOS was read.
    """

    def __init__(
        self, lm_state, trie, node, weight, mass=None, mode=TrieMode.WITH_EOS, terminated=False
    ):
        self.lm_state = lm_state
        self.trie = _as_async_trie(trie)
        self._info = info_of(self.trie.trie)
        self.node = node
        self.weight = weight
        self._mass = as_row(mass)
        self._extend = None
        self.mode = as_mode(mode)
        self.root = self._info.root
        self.children = self._info.children
        self.terminated = terminated

    @classmethod
    def initial(cls, lm, trie, mode=TrieMode.WITH_EOS):
        """The root state after the tokenizer's BOS token, with weight 0."""
        trie = _as_async_trie(trie)
        return cls(
            lm_state=StatefulTokenizedLM.initial(lm),
            trie=trie,
            node=trie.trie.root,
            weight=0.0,
            mode=mode,
        )

    # ---------------------------------------------------------------- reading

    @property
    def partial(self):
        """The bytes of the current node (those of the token being read), as a list."""
        return self.trie.trie.prefix_of(self.node)

    @property
    def mass(self):
        """Log-mass of every trie node under this context, indexable by node id.

        Reads are served from the device row, a node at a time (``np.asarray`` copies all).

        Raises:
            ValueError: the state was not materialized yet.
        """
        if self._mass is None:
            raise ValueError("State is not yet materialized.")
        return self._mass

    @property
    def is_materialized(self):
        return self._mass is not None

    def _view_request(self):
        return (self._mass, (self.node, *self.children[self.node].values()))

    def _ensure_view(self):
        gather([self._view_request()])

    def with_mode(self, mode):
        """The same state under another trie mode (its masses, if any, are kept)."""
        return LazyTrieState(
            lm_state=self.lm_state,
            trie=self.trie,
            node=self.node,
            weight=self.weight,
            mass=self._mass,
            mode=mode,
            terminated=self.terminated,
        )

    def actions(self):
        """Edges out of the current node: byte -> child, EOS, and end-of-token leaves."""
        return self.children[self.node]

    def get_all_EOT(self):
        """``[(leaf_node, token_id), ...]``: the tokens that end at the current node."""
        return self._info.eot_edges(self.node)

    def get_EOT(self):
        """The first end-of-token leaf of the current node, or None (older genlm API)."""
        edges = self.get_all_EOT()
        return edges[0][0] if edges else None

    def __lshift__(self, b):
        """The state after reading byte ``b``, or None if the trie has no such edge here
        (or the state already read EOS)."""
        b = check_byte(b)
        if self.terminated:
            return None
        child = self.children[self.node].get(b)
        if child is None:
            return None
        row = self.mass
        here, there = row[self.node], row[child]
        weight = NEG_INF if there == NEG_INF else self.weight + there - here
        return LazyTrieState(
            lm_state=self.lm_state,
            trie=self.trie,
            node=child,
            weight=weight,
            mass=row,
            mode=self.mode,
            terminated=b == EOS,
        )

    def extend_all(self):
        """Commit the token ending here: one new root state per token id that ends here
        (several when distinct tokens share these bytes). Cached."""
        if self._extend is None:
            protos = self._extension_protos()
            self._finish_extensions(protos)
        return self._extend

    def extend(self):
        """The first of ``extend_all()``, or None (older genlm API)."""
        out = self.extend_all()
        return out[0] if out else None

    def _extension_protos(self):
        """The extensions with their contexts but no weight yet (no mass needed)."""
        return [
            (
                leaf,
                LazyTrieState(
                    lm_state=self.lm_state << int(token_id),
                    trie=self.trie,
                    node=self.root,
                    weight=math.nan,
                    mode=self.mode,
                ),
            )
            for leaf, token_id in self.get_all_EOT()
        ]

    def _finish_extensions(self, protos):
        if self._extend is not None:
            return
        if protos:
            row = self.mass
            here = row[self.node]
            for leaf, state in protos:
                there = row[leaf]
                state.weight = NEG_INF if there == NEG_INF else self.weight + there - here
        self._extend = [state for _, state in protos]

    @cached_property
    def logp_next(self):
        """``LazyByteProbs`` of the next symbol given this state: bytes, EOT (256), EOS."""
        row = self.mass
        self._ensure_view()
        values = row.values
        logps = np.full(NUM_SYMBOLS, NEG_INF)
        z = values[self.node]
        if z == NEG_INF:
            return LazyByteProbs(logps)
        edges = None if isinstance(values, dict) else self._info.edge_arrays(self.node)
        if edges is not None:  # a row in host memory: the same arithmetic, array-wise
            keys, kids, eots = edges
            logps[keys] = values.take(kids) - z
            if len(eots):
                eot = values.take(eots) - z
                logps[EOT_INDEX] = eot[0] if len(eot) == 1 else np.logaddexp.reduce(eot)
            return LazyByteProbs(logps)
        eot = []
        for key, child in self.children[self.node].items():
            v = values[child] - z
            if isinstance(key, tuple):
                eot.append(v)
            elif isinstance(key, (int, np.integer)):
                logps[key] = v
            else:
                raise ValueError(  # noqa: TRY004 - the error genlm-bytes raises here
                    f"unexpected edge key {key!r} ({type(key).__name__}): a byte-level "
                    "state needs byte edges (no atomic byte strings)"
                )
        if eot:
            logps[EOT_INDEX] = eot[0] if len(eot) == 1 else np.logaddexp.reduce(eot)
        return LazyByteProbs(logps)

    async def materialize(self):
        """Compute this state's masses (an LM call and a kernel launch); returns self."""
        await materialize_states([self])
        return self

    def __repr__(self):
        partial = self.partial
        text = escape(bytes(b for b in partial if isinstance(b, int) and 0 <= b <= 255))
        tail = "<EOS>" if self.terminated else ""
        return f"{self.weight:.2f}: {self.lm_state}|{text}{tail}"

    async def cleanup(self):
        """Stop the trie's background task (the trie stays usable)."""
        await self.trie.cleanup()
