"""``ByteBeamState``: a byte-level LM from a token-level one, by beam summing over tokenizations.

The beam holds up to K ``LazyTrieState`` hypotheses (token context + position in the byte
trie). ``await beam.logp_next()`` gives the next-byte distribution, ``await (beam << b)``
reads a byte, ``beam.prune()`` keeps the K best. Semantics are those of genlm-bytes 0.2.0;
the work of a step runs on the fused path (see ``materialize``): the hypotheses that need a
new LM distribution in a step share one LM batch and one trie kernel launch, and the few
node values the beam reads come back in one transfer (or, in host memory, are read in place).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from genlm_fast.bytes.byte_lm.heal import TokenHealer
from genlm_fast.bytes.byte_lm.lm_state import StatefulByteLM
from genlm_fast.bytes.byte_lm.mass_rows import gather
from genlm_fast.bytes.byte_lm.materialize import batchable, materialize_states
from genlm_fast.bytes.byte_lm.trie_state import LazyTrieState, check_byte
from genlm_fast.bytes.trie import AsyncTokenByteTrie, TrieMode
from genlm_fast.bytes.util import (
    EOT_INDEX,
    NUM_SYMBOLS,
    LazyByteProbs,
    as_index,
    logsumexp,
    logsumexp_columns,
)

__all__ = ["BeamParams", "ByteBeamState", "EmptyBeamError"]

NEG_INF = -math.inf


class EmptyBeamError(ValueError, AssertionError):
    """The next-byte distribution of a beam that holds no hypothesis was asked for: the
    bytes read so far have probability zero (reading more bytes into such a beam gives an
    empty beam, logZ -inf, as in genlm-bytes).

    Also an ``AssertionError``, which is what genlm-bytes raises there ("Beam is empty"):
    callers may catch either."""


def _optional_count(value, name):
    if value is None:
        return None
    value = as_index(value, f"{name} must be None or a non-negative int")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


@dataclass
class BeamParams:
    """Parameters of the byte-level beam.

    Args:
        K (int): beam width, at least 1: ``prune()`` keeps the K heaviest hypotheses.
        prune_threshold (float): ``prune()`` also drops hypotheses whose share of the beam's
            probability is not above this; extensions below it are not computed. Default 0.
        verbose (bool): print the beam after each byte.
        eos_byte_strings (list[bytes]): tokens whose probability goes to EOS (byte 257)
            after prefilling. Default: none.
        heal (bool): when a byte empties the beam, look for another tokenization of the
            bytes of the current token that can read it (token healing). Default True.
        heal_max_backoff (int, optional): most bytes healing may back off.
        heal_max_splits (int, optional): most extra token boundaries inside one healing
            attempt (0: a single split).
        eos_tokens: deprecated name of ``eos_byte_strings``.
    """

    K: int
    prune_threshold: float = 0.0
    verbose: bool = False
    eos_byte_strings: list[bytes] = None
    heal: bool = True
    heal_max_backoff: int | None = None
    heal_max_splits: int | None = None
    eos_tokens: list[bytes] = None

    def __post_init__(self):
        self.K = as_index(self.K, "K must be an int (the beam width)")
        if self.K < 1:
            raise ValueError(f"K (the beam width) must be at least 1, got {self.K}")
        try:
            if isinstance(self.prune_threshold, (str, bytes, bytearray)):
                raise TypeError  # float("0.1") would read it, and keep the field a str
            threshold = float(self.prune_threshold)
        except (TypeError, ValueError):
            raise TypeError(
                f"prune_threshold must be a number, got {type(self.prune_threshold).__name__}"
            ) from None
        if math.isnan(threshold):
            raise ValueError("prune_threshold must be a number, got nan")
        if threshold < 0:
            raise ValueError(f"prune_threshold must be non-negative, got {self.prune_threshold}")
        if self.eos_tokens is not None:
            if self.eos_byte_strings is not None:
                raise TypeError(
                    "Cannot specify both 'eos_byte_strings' and the deprecated 'eos_tokens'."
                )
            warnings.warn(
                "'eos_tokens' is deprecated, use 'eos_byte_strings' instead.",
                DeprecationWarning,
                stacklevel=3,
            )
            self.eos_byte_strings = self.eos_tokens
            self.eos_tokens = None
        eos = self.eos_byte_strings
        if eos is None:
            eos = ()
        elif isinstance(eos, (bytes, str)):
            raise TypeError(
                "eos_byte_strings must be a collection of byte strings, e.g. "
                "[b'<|im_end|>'], not a single " + type(eos).__name__
            )
        checked = set()
        for item in eos:
            if not isinstance(item, (bytes, bytearray)):
                raise TypeError(
                    f"eos_byte_strings must hold bytes, got {type(item).__name__}: {item!r}"
                )
            checked.add(bytes(item))
        self.eos_byte_strings = checked
        self.heal_max_backoff = _optional_count(self.heal_max_backoff, "heal_max_backoff")
        self.heal_max_splits = _optional_count(self.heal_max_splits, "heal_max_splits")
        self.prune_threshold = threshold
        self.log_prune_threshold = math.log(threshold) if threshold > 0 else NEG_INF


# genlm-bytes' own BeamParams, known by where it is defined (an app that builds its
# parameters with genlm.bytes imported before genlm_fast.dropin)
_GENLM_BEAM_PARAMS = ("genlm.bytes.byte_lm.beam", "BeamParams")


def as_beam_params(params) -> BeamParams:
    """``params`` as our `BeamParams`: ours as is, genlm-bytes' copied field by field
    (checked as ours are), anything else a TypeError."""
    if isinstance(params, BeamParams):
        return params
    cls = type(params)
    if (cls.__module__, cls.__qualname__) == _GENLM_BEAM_PARAMS:
        return BeamParams(
            K=params.K,
            prune_threshold=params.prune_threshold,
            verbose=params.verbose,
            eos_byte_strings=params.eos_byte_strings,
            heal=params.heal,
            heal_max_backoff=params.heal_max_backoff,
            heal_max_splits=params.heal_max_splits,
        )
    raise TypeError(f"params must be a BeamParams, got {cls.__name__}")


# tries built by ByteBeamState.initial, per model and options (building one takes a while)
_TRIES = weakref.WeakKeyDictionary()


def _trie_for(llm, eos_byte_strings, trie_opts):
    opts = dict(trie_opts or {})
    opts["eos_byte_strings"] = eos_byte_strings
    key = repr(
        sorted((k, sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in opts.items())
    )
    try:
        cache = _TRIES.setdefault(llm, {})
    except TypeError:  # a model that cannot be weakly referenced
        cache = {}
    trie = cache.get(key)
    if trie is None:
        trie = cache[key] = AsyncTokenByteTrie.from_vocab(llm.byte_vocab, **opts)
    return trie


class ByteBeamState(StatefulByteLM):
    """The beam: hypotheses sorted by weight, heaviest first.

    Args:
        states (list[LazyTrieState]): the hypotheses.
        params (BeamParams): beam parameters.
    """

    def __init__(self, states, params):
        self.states = sorted(states, key=lambda s: -s.weight)
        self.params = params

    @classmethod
    async def initial(cls, llm, params, trie_opts=None):
        """The beam before any byte: the root state after BOS, materialized.

        Args:
            llm (AsyncLM): token-level model (genlm_fast or genlm.backend).
            params (BeamParams): beam parameters.
            trie_opts (dict, optional): more ``AsyncTokenByteTrie.from_vocab`` arguments.
                The trie is built once per model and options and reused.
        """
        params = as_beam_params(params)
        trie = _trie_for(llm, params.eos_byte_strings, trie_opts)
        state = LazyTrieState.initial(llm, trie, mode=TrieMode.WITH_EOS)
        return cls([await state.materialize()], params)

    def __iter__(self):
        return iter(self.states)

    def __len__(self):
        return len(self.states)

    @cached_property
    def logZ(self):
        """Log of the total weight: the estimated log-probability of the bytes read so far
        (``-inf`` for an empty beam)."""
        return logsumexp([s.weight for s in self.states])

    # ---------------------------------------------------------------- one step

    async def _ready(self, next_byte=None):
        """Prepare a step: every hypothesis's nodes read, its extensions computed.

        When no extension can be pruned (``prune_threshold == 0``) the extensions that are
        not computed yet are materialized right away: their LM batch and kernel launch do
        not wait for any value, and the reads of the whole beam share one transfer.

        With ``next_byte`` (the byte this step reads), that LM batch also computes, ahead,
        the logits of every token the next step's hypotheses could commit: when the next
        step only reads bytes (``prefill``), it then needs no LM call of its own.
        """
        states = self.states
        fresh = [s for s in states if s._mass is None]
        if fresh:  # only a hand-made beam holds unmaterialized states
            await materialize_states(fresh)
        views = [s._view_request() for s in states]
        if self.params.log_prune_threshold == NEG_INF:
            todo = [(s, s._extension_protos()) for s in states if s._extend is None]
            protos = [p for _, ps in todo for _, p in ps]
            if protos:
                ahead = () if next_byte is None else self._lookahead(next_byte, dict(todo))
                await materialize_states(protos, extra=views, lookahead=ahead)
            else:
                gather(views)
            for s, ps in todo:
                s._finish_extensions(ps)
        else:
            gather(views)

    def _lookahead(self, byte, protos):
        """``(model, context)`` of each token a hypothesis of the beam after ``byte`` could
        commit at the next step (a superset: pruning will drop some hypotheses)."""
        out = []
        for state in self.states:
            if state.terminated:
                continue
            info, children = state._info, state.children
            after = children[state.node].get(byte)
            if after is not None and batchable(state.lm_state):
                for _, token in info.eot_edges(after):
                    out.append((state.lm_state.model, (state.lm_state << int(token)).context))
            if state in protos:
                extensions = [p for _, p in protos[state]]
            else:
                extensions = state._extend or ()
            first = children[state.root].get(byte)
            if first is not None and extensions:
                tokens = [int(t) for _, t in info.eot_edges(first)]
                for ext in extensions:
                    if not batchable(ext.lm_state):  # e.g. a test double: no lookahead
                        continue
                    for token in tokens:
                        out.append((ext.lm_state.model, (ext.lm_state << token).context))
        return out

    async def __lshift__(self, a):
        """The beam after reading byte ``a`` (0..255, or 257 for EOS). From an empty beam,
        an empty beam (as genlm-bytes has it): its ``logZ`` is -inf, and reading its
        next-byte distribution raises EmptyBeamError."""
        a = check_byte(a)
        if not self.states:
            return ByteBeamState([], self.params)
        await self._ready(next_byte=a)
        new_states = []
        for state in self.states:
            nxt = state << a
            if nxt is not None:
                new_states.append(nxt)
        logZ = logsumexp([s.weight for s in new_states]) if new_states else NEG_INF
        for state in await self.extend(logZ):
            nxt = state << a
            if nxt is not None:
                new_states.append(nxt)
        beam = ByteBeamState(new_states, self.params)
        if self.params.heal and not beam.states:
            healed = await self._adaptive_heal(a)
            if healed is not None:
                if self.params.verbose:
                    print("[heal] Applied adaptive token healing")
                return healed
        if self.params.verbose:
            print()
            print(beam)
        return beam

    async def logp_next(self):
        """``LazyByteProbs`` of the next byte (and EOS), summed over the hypotheses and the
        tokens they can commit here."""
        if not self.states:
            raise EmptyBeamError(
                "cannot read the next-byte distribution of an empty beam: the bytes read so "
                "far have probability zero under the model (every hypothesis was dropped)"
            )
        await self._ready()
        rows = []
        for state in self.states:
            if state.weight == NEG_INF:
                continue
            row = state.logp_next.ps + state.weight
            row[EOT_INDEX] = NEG_INF  # a byte follows: end-of-token is not an outcome here
            rows.append(row)
        for state in await self.extend(self.logZ):
            if state.weight != NEG_INF:
                rows.append(state.logp_next.ps + state.weight)
        if not rows:
            return LazyByteProbs(np.full(NUM_SYMBOLS, NEG_INF))
        logps = logsumexp_columns(np.stack(rows))
        total = logsumexp(logps)
        if total == NEG_INF:
            return LazyByteProbs(np.full(NUM_SYMBOLS, NEG_INF))
        return LazyByteProbs(logps - total)

    async def extend(self, logZ):
        """Commit the token ending at each hypothesis (where one does).

        Returns the materialized extensions whose share of ``logZ`` (updated with the
        extensions themselves) is above the prune threshold.
        """
        if not self.states:
            return []
        await self._ready()
        extensions = []
        for state in self.states:
            for ext in state.extend_all():
                logZ = np.logaddexp(logZ, ext.weight)
                extensions.append(ext)
        threshold = self.params.log_prune_threshold
        keep = [e for e in extensions if e.weight - logZ > threshold]
        if any(e._mass is None for e in keep):
            await materialize_states(keep)
        return keep

    def prune(self):
        """The K heaviest hypotheses whose share of the beam is above the threshold."""
        logZ = self.logZ
        threshold = self.params.log_prune_threshold
        kept = [s for s in self.states if s.weight - logZ > threshold][: self.params.K]
        return ByteBeamState(kept, self.params)

    def with_mode(self, mode):
        """The beam with every hypothesis switched to trie mode ``mode``."""
        return ByteBeamState([s.with_mode(mode) for s in self.states], self.params)

    async def prefill(self, bs):
        """The beam after the bytes ``bs``, read with EOS tokens counted as ordinary tokens.

        Bytes of probability zero under the model give an empty beam, whose ``logZ`` is
        -inf (as genlm-bytes has it; reading its next-byte distribution raises
        EmptyBeamError).

        Args:
            bs (bytes | bytearray | iterable of int): the bytes (0..255 each).
        """
        data = _as_byte_list(bs)
        beam = self.with_mode(TrieMode.WITHOUT_EOS)
        for b in data:
            if not beam.states:
                break
            beam = await (beam.prune() << b)
        return beam.with_mode(TrieMode.WITH_EOS)

    async def cleanup(self):
        """Stop the tries' background tasks and drop logits computed ahead of need."""
        seen = set()
        for state in self.states:
            if id(state.trie) not in seen:
                seen.add(id(state.trie))
                state._info.logits_memo.clear()
                await state.cleanup()

    async def _adaptive_heal(self, next_byte):
        """A one-hypothesis beam advanced by ``next_byte`` through token healing, or None."""
        healer = TokenHealer(
            max_backoff=self.params.heal_max_backoff,
            max_splits=self.params.heal_max_splits,
            verbose=self.params.verbose,
        )
        for state in self.states:
            healed = await healer.try_heal(state, next_byte)
            if healed is not None:
                return ByteBeamState([healed], self.params)
        return None

    def __repr__(self):
        lines = [f"Z: {self.logZ}", "Candidates:"]
        for state in self.states:
            share = math.exp(state.weight - self.logZ) if self.logZ > NEG_INF else 0.0
            mark = "" if share > self.params.prune_threshold else " (pruned)"
            lines.append(f"({share:.4f}){mark} {state!r}")
        return "\n".join(lines) + "\n"


def _as_byte_list(bs):
    """The bytes to prefill as a list of ints: bytes-like, or any iterable of ints 0..255
    (a list, a numpy array, a range, a generator), as genlm-bytes reads them."""
    if isinstance(bs, str):
        raise TypeError(
            "prefill expects bytes, got a str: encode it first, e.g. text.encode('utf-8')"
        )
    if isinstance(bs, (bytes, bytearray, memoryview)):
        return list(bytes(bs))
    try:
        items = list(bs)
    except TypeError:
        raise TypeError(
            f"prefill expects bytes (or an iterable of ints 0..255), got {type(bs).__name__}"
        ) from None
    out = []
    for b in items:
        v = as_index(b, "prefill expects bytes (or an iterable of ints 0..255)")
        if not 0 <= v <= 255:
            raise ValueError(f"prefill expects bytes 0..255, found {v}")
        out.append(v)
    return out
