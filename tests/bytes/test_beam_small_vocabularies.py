"""The byte-level beam (genlm_fast.bytes) on tiny vocabularies: duplicate tokens against a
float64 brute-force oracle, and token healing, beam options (prune thresholds, heal limits,
EOS strings, zero-probability tokens) and greedy decoding step by step against genlm-bytes
0.2.0.
"""

from __future__ import annotations

import genlm.bytes as ref_bytes
import numpy as np
import pytest
import torch
from genlm.bytes.byte_lm import beam as ref_beam_module

from genlm_fast.backend.tokenization import Token
from genlm_fast.bytes import (
    EOS,
    AsyncTokenByteTrie,
    BeamParams,
    ByteBeamState,
    LazyTrieState,
    TrieMode,
)
from tests.bytes.beam_support import LogpOnlyState, heal_spy

# ---------------------------------------------------------------------------- duplicate tokens


class _LengthLM:
    """A token-level LM whose next-token logits depend only on the context's length (a
    fixed float64 table), for brute-force oracles over a tiny vocabulary."""

    def __init__(self, V, seed=0):
        self.table = np.random.default_rng(seed).standard_normal((16, V)) * 2.0

    def logp64(self, context):
        row = self.table[len(context) % len(self.table)]
        return row - np.logaddexp.reduce(row)

    async def next_token_logprobs(self, context):
        return torch.from_numpy(self.logp64(context)).float()


# distinct ids, equal bytes: b"ab" three times, b"a" twice; b"<e>" is the EOS token
DUP_VOCAB = [b"a", b"ab", b"ab", b"b", b"abc", b"a", b"ab", b"ba", b"<e>", b"c"]


def _brute_next(logp, vocab, prefix, eos=()):
    """float64 oracle of a state at ``prefix``: log P(next symbol) over 258 symbols (bytes,
    EOT, EOS), from the token distribution ``logp``, EOS tokens counting only towards EOS."""
    p = np.exp(logp)
    byte_tokens = [i for i, t in enumerate(vocab) if t not in eos]
    z = sum(p[i] for i in byte_tokens if vocab[i].startswith(prefix))
    if not prefix:
        z += sum(p[i] for i, t in enumerate(vocab) if t in eos)
    out = np.zeros(258)
    for i in byte_tokens:
        t = vocab[i]
        if t == prefix:
            out[256] += p[i]
        elif t.startswith(prefix):
            out[t[len(prefix)]] += p[i]
    if not prefix:
        out[257] = sum(p[i] for i, t in enumerate(vocab) if t in eos)
    with np.errstate(divide="ignore"):
        return np.log(out / z)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", [TrieMode.WITHOUT_EOS, TrieMode.WITH_EOS])
async def test_state_next_byte_and_extensions_with_duplicate_tokens(mode):
    # Distinct token ids sharing their bytes each end at their own leaf under one node: the
    # end-of-token probability there is the SUM of their masses, and every one of them
    # gives its own extension, weighted by its own probability (float64 brute force).
    vocab = [Token(i, b) for i, b in enumerate(DUP_VOCAB)]
    eos = {b"<e>"}
    trie = AsyncTokenByteTrie.from_vocab(vocab, eos_byte_strings=eos, device="cpu")
    lm = _LengthLM(len(vocab), seed=4)
    state = LazyTrieState(LogpOnlyState(lm, [1, 2]), trie, trie.trie.root, 0.0, mode=mode)
    await state.materialize()
    logp = lm.logp64([1, 2])
    counted_eos = eos if mode == TrieMode.WITH_EOS else set()
    for prefix in [b"", b"a", b"ab", b"b"]:
        s = state
        for byte in prefix:
            s = s << byte
        want = _brute_next(logp, DUP_VOCAB, prefix, counted_eos)
        got = np.asarray(s.logp_next.ps, dtype=np.float64)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), prefix
        np.testing.assert_allclose(got[finite], want[finite], atol=1e-5, err_msg=repr(prefix))
        # the path weight is the log-mass of the prefix (the root holds all the mass)
        mass = sum(
            np.exp(logp[i])
            for i, t in enumerate(DUP_VOCAB)
            if t.startswith(prefix) and (t not in counted_eos or not prefix)
        )
        assert abs(s.weight - np.log(mass)) <= 1e-5, prefix
        exts = s.extend_all()
        ids = sorted(i for i, t in enumerate(DUP_VOCAB) if t == prefix and t not in counted_eos)
        assert sorted(e.lm_state._context[-1] for e in exts) == ids, prefix
        for e in exts:
            assert abs(e.weight - logp[e.lm_state._context[-1]]) <= 1e-5, prefix
    await state.cleanup()


# ---------------------------------------------------------------------------- tiny vocabularies


class _ContextLM:
    """A token-level LM over a tiny vocabulary: float64 log-probabilities seeded by the whole
    context (so that tokenizations get different weights); ``masked`` token ids get
    probability zero."""

    def __init__(self, V, seed=0, masked=()):
        self.V, self.seed, self.masked = V, seed, tuple(masked)

    def logp64(self, context):
        s = (
            self.seed * 1000003 + sum((i + 1) * (t + 1) * 7919 for i, t in enumerate(context))
        ) % 2**32
        row = np.random.RandomState(s).randn(self.V) * 2.0
        row[list(self.masked)] = -np.inf
        return row - np.logaddexp.reduce(row)

    async def next_token_logprobs(self, context):
        return torch.from_numpy(self.logp64(context)).float()


async def tiny_beams(vocab, params, seed=0, masked=(), eos=()):
    """(ours, genlm-bytes) root beams over the same tiny vocabulary (token 0 is BOS) and LM."""
    from genlm.backend.tokenization import Token as RefToken

    lm = _ContextLM(len(vocab), seed, masked)
    trie = AsyncTokenByteTrie.from_vocab(
        [Token(i, b) for i, b in enumerate(vocab)], eos_byte_strings=set(eos), device="cpu"
    )
    ref_trie = ref_bytes.AsyncTokenByteTrie.from_vocab(
        [RefToken(i, b) for i, b in enumerate(vocab)], eos_byte_strings=set(eos)
    )
    ours = LazyTrieState(LogpOnlyState(lm, [0]), trie, trie.trie.root, 0.0)
    ref = ref_bytes.LazyTrieState(LogpOnlyState(lm, [0]), ref_trie, ref_trie.trie.root, 0.0)
    return (
        ByteBeamState([await ours.materialize()], BeamParams(**params)),
        ref_bytes.ByteBeamState([await ref.materialize()], ref_bytes.BeamParams(**params)),
    )


def hypotheses(beam):
    """The tokenizations a beam holds: (committed token ids, bytes of the current token)."""
    return [(tuple(s.lm_state._context), bytes(s.partial)) for s in beam.states]


async def agree_on_tiny_vocab(ours, ref, text, what):
    """Read ``text`` into both beams (prune, then read): after each byte the same hypotheses,
    weights and next-byte distribution. Returns the number of bytes read before a beam
    emptied (both beams empty there)."""
    for i, b in enumerate(text):
        ours, ref = ours.prune(), ref.prune()
        assert hypotheses(ours) == hypotheses(ref), f"{what}: pruned before byte {i}"
        if not len(ref):
            return i
        ours, ref = await (ours << b), await (ref << b)
        assert hypotheses(ours) == hypotheses(ref), f"{what}: after byte {i}"
        np.testing.assert_allclose(
            [s.weight for s in ours],
            [s.weight for s in ref],
            atol=1e-4,
            err_msg=f"{what}: after byte {i}",
        )
        # genlm-bytes' logp_next turns a zero-probability hypothesis into NaNs for the whole
        # distribution; such a hypothesis adds no mass, so the answer is that of the
        # reference beam without it
        alive = [s for s in ref.states if np.isfinite(s.weight)]
        if alive:
            lp = np.asarray((await ours.logp_next()).ps, dtype=np.float64)
            lq = np.asarray(
                (await ref_bytes.ByteBeamState(alive, ref.params).logp_next()).ps, dtype=np.float64
            )
            assert not np.isnan(lq).any(), f"{what}: the reference's answer after byte {i}"
            np.testing.assert_allclose(
                np.exp(lp), np.exp(lq), atol=1e-5, err_msg=f"{what}: next byte after byte {i}"
            )
    return len(text)


TINY_HEAL_CASES = [
    # id, vocab (token 0: BOS), text, params, LM seed
    # "abc" sits inside "abcd"; reading "x" commits "a", then splits twice (b|c|x)
    ("two-splits", [b"<s>", b"a", b"b", b"c", b"x", b"abcd", b"bb"], b"abcx", {"K": 1}, 0),
    (
        "two-splits-max1",
        [b"<s>", b"a", b"b", b"c", b"x", b"abcd", b"bb"],
        b"abcx",
        {"K": 1, "heal_max_splits": 1},
        0,
    ),
    (
        "two-splits-max2",
        [b"<s>", b"a", b"b", b"c", b"x", b"abcd", b"bb"],
        b"abcx",
        {"K": 1, "heal_max_splits": 2},
        0,
    ),
    # duplicate tokens (b"a" and b"b" twice): healing commits the first of each
    ("duplicates", [b"<s>", b"a", b"b", b"abz", b"x", b"a", b"b"], b"abx", {"K": 1}, 0),
    # after the split at b"b" no token starts with b"x": healing fails, the beam is empty
    ("split-cannot-read", [b"<s>", b"a", b"b", b"abz", b"z"], b"abx", {"K": 1}, 0),
    # a beam of several hypotheses, none can read the byte: the first (heaviest) that heals
    (
        "several-first-fails",
        [b"<s>", b"a", b"aax", b"axb", b"ba", b"bca", b"bxx", b"xcb", b"xcx", b"xx", b"xxb"],
        b"xxaaxcx",
        {"K": 2},
        1171,
    ),
    (
        "several-both-heal",
        [b"<s>", b"a", b"aa", b"aaa", b"b", b"bcc", b"bcx", b"bxb", b"cc", b"cxa", b"xc"],
        b"xcbccbxc",
        {"K": 2},
        172,
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "what,vocab,text,params,seed", TINY_HEAL_CASES, ids=[c[0] for c in TINY_HEAL_CASES]
)
async def test_tiny_vocab_healing_agrees(monkeypatch, what, vocab, text, params, seed):
    # Token healing, step by step against genlm-bytes on tiny vocabularies built for it:
    # several splits (and heal_max_splits), duplicate tokens at the commit and at a split,
    # a split after which the byte still cannot be read, several stuck hypotheses.
    calls = heal_spy(monkeypatch, ref_beam_module)
    ours, ref = await tiny_beams(vocab, params, seed)
    await agree_on_tiny_vocab(ours, ref, text, what)
    assert calls, f"{what} was meant to exercise healing"


TINY_OPTION_CASES = [
    # id, vocab, EOS strings, masked token ids (probability zero), prefill, then read, params,
    # LM seed (cases found by a fuzzer against genlm-bytes, each pins the behaviour named)
    # the prune threshold of extensions counts the extensions themselves in logZ
    (
        "threshold-extensions",
        [
            b"<s>",
            b"a",
            b"xac",
            b"xxc",
            b"cbb",
            b"ba",
            b"cbc",
            b"xa",
            b"xc",
            b"bxx",
            b"bxx",
            b"ba",
            b"a",
            b"<e>",
        ],
        [b"<e>"],
        (),
        b"axaca",
        b"xaa",
        {"K": 3, "prune_threshold": 0.05, "heal_max_splits": 2},
        0,
    ),
    # heal_max_backoff=0 (with a threshold, after a prefill): only k = len(partial)
    (
        "threshold-backoff-0",
        [
            b"<s>",
            b"a",
            b"aa",
            b"cxx",
            b"cbb",
            b"xa",
            b"xax",
            b"ab",
            b"c",
            b"bc",
            b"xax",
            b"xa",
            b"xax",
            b"<e>",
        ],
        [b"<e>"],
        (),
        b"cxxxaxcx",
        b"ax",
        {"K": 2, "prune_threshold": 0.1, "heal_max_backoff": 0},
        23,
    ),
    # the EOS string is an ordinary token's bytes: healing inside prefill keeps the beam's
    # mode (EOS tokens count as ordinary tokens there)
    (
        "eos-token-bytes-prefill-heal",
        [
            b"<s>",
            b"a",
            b"cca",
            b"bab",
            b"c",
            b"bxa",
            b"cbx",
            b"ab",
            b"xbb",
            b"bb",
            b"bab",
            b"bxa",
            b"cbx",
            b"<e>",
        ],
        [b"bab"],
        (),
        b"bxacba",
        b"bcbxc",
        {"K": 2, "prune_threshold": 0.2, "heal_max_splits": 0},
        5,
    ),
    # tokens of probability zero: prune() drops hypotheses of weight -inf
    (
        "zero-probability-prune",
        [
            b"<s>",
            b"a",
            b"cbc",
            b"cx",
            b"ac",
            b"x",
            b"aab",
            b"ab",
            b"ba",
            b"cac",
            b"cx",
            b"cbc",
            b"cx",
            b"<e>",
        ],
        [b"<e>"],
        [8, 13],
        b"",
        b"abcxaba",
        {"K": 2, "heal_max_splits": 2},
        35,
    ),
    # ... and so does extend(): no extension of weight -inf joins the beam
    (
        "zero-probability-extend",
        [
            b"<s>",
            b"a",
            b"axc",
            b"xc",
            b"ac",
            b"bxa",
            b"ca",
            b"cac",
            b"cxa",
            b"b",
            b"ca",
            b"cxa",
            b"ac",
            b"<e>",
        ],
        [b"<e>"],
        [11, 12],
        b"acxacaacc",
        b"a",
        {"K": 2, "heal_max_splits": 1},
        6,
    ),
    # healing tries k = len(partial) first: it commits a token of probability zero there
    (
        "zero-probability-heal",
        [
            b"<s>",
            b"a",
            b"ccb",
            b"acx",
            b"xb",
            b"abx",
            b"bc",
            b"ab",
            b"c",
            b"aaa",
            b"aaa",
            b"xb",
            b"ccb",
            b"<e>",
        ],
        [b"<e>"],
        [7, 8],
        b"",
        b"xbabacx",
        {"K": 3, "heal_max_backoff": 1},
        12,
    ),
]


# a beam whose every hypothesis has weight -inf has logZ -inf: both implementations compare
# NaN shares there (and drop those hypotheses), which numpy warns about
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "what,vocab,eos,masked,prompt,text,params,seed",
    TINY_OPTION_CASES,
    ids=[c[0] for c in TINY_OPTION_CASES],
)
async def test_tiny_vocab_beam_options_agree(what, vocab, eos, masked, prompt, text, params, seed):
    # prune thresholds, heal limits, EOS strings and zero-probability tokens, against
    # genlm-bytes: prefill, then byte by byte
    ours, ref = await tiny_beams(vocab, params, seed, masked, eos)
    ours, ref = await ours.prefill(prompt), await ref.prefill(prompt)
    assert hypotheses(ours) == hypotheses(ref), f"{what}: after prefill"
    assert ours.logZ == pytest.approx(ref.logZ, abs=1e-4)
    await agree_on_tiny_vocab(ours, ref, text, what)  # (some beams empty on the way)


def test_token_context_keeps_the_most_recent_tokens():
    # max_context_length: every later state too holds the last max_context_length tokens
    # of the whole sequence (genlm-bytes only truncates at the first step, and forgets the
    # limit afterwards)
    from genlm_fast.bytes import StatefulTokenizedLM

    tokens = [5, 1, 4, 1, 5, 9, 2, 6]
    for limit in (1, 2, 3):
        state = StatefulTokenizedLM(None, [7, 3], max_context_length=limit)
        seen = [7, 3]
        for t in tokens:
            state = state << t
            seen.append(t)
            assert state.context == seen[-limit:] and state.max_context_length == limit
    assert (StatefulTokenizedLM(None, [7, 3]) << 1).context == [7, 3, 1]


@pytest.mark.asyncio
async def test_tiny_vocab_greedy_stops_at_eos():
    # greedy() stops when EOS is the most likely next symbol (EOS is not a byte: genlm-bytes
    # would append it and fail); the bytes before it are those genlm-bytes' beam picks
    vocab = [b"<s>", b"a", b"b", b"ab", b"ba", b"<e>"]
    eos = [b"<e>"]
    for seed in range(20):
        ours, ref = await tiny_beams(vocab, {"K": 2}, seed, eos=eos)
        want = []
        for _ in range(12):
            q = (await ref.logp_next()).materialize()
            b = q.argmax()
            if b == EOS:
                break
            want.append(b)
            ref = await (ref.prune() << b)
        else:
            continue
        if len(want) < 2:
            continue
        assert await ours.greedy(b"", 12) == bytes(want)
        break
    else:
        pytest.fail("no seed makes EOS the most likely symbol after 2 to 12 bytes")
    with pytest.raises(ValueError, match="non-negative"):
        await ours.greedy(b"", -1)
