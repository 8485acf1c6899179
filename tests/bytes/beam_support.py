"""Helpers shared by the byte-level beam tests (tests/bytes/test_beam_*.py), which check
genlm_fast.bytes against genlm-bytes 0.2.0: two deterministic mock LMs that give the same
peaked distributions (ours over genlm_fast's ``MockAsyncLM``, genlm-bytes over
genlm.backend's), recording and comparing byte-by-byte trajectories, genlm-bytes tries built
once per EOS configuration, a spy on token healing, and a token-level LM state that offers
only ``logp_next``.
"""

from __future__ import annotations

import genlm.backend.llm as ref_llm
import genlm.bytes as ref_bytes
import numpy as np
import torch
from genlm.bytes.trie import TrieMode as RefTrieMode

from genlm_fast.backend.llm import MockAsyncLM

GPT2_EOS = b"<|endoftext|>"


def peaked(scores):
    """Uniform [0, 1) scores -> logits of a peaked distribution (a few dozen likely tokens)."""
    return 60.0 * scores**64


class PeakedMock(MockAsyncLM):
    """genlm_fast's mock with peaked logits (same seeds, same uniform draws)."""

    def _forward(self, lora_name, rows):
        return peaked(super()._forward(lora_name, rows))


class RefPeakedMock(ref_llm.MockAsyncLM):
    """genlm.backend's mock with the same peaked logits."""

    def _get_logprobs(self, token_ids):
        seed = sum((i + 1) * t for i, t in enumerate(token_ids)) % (2**32)
        scores = np.random.RandomState(seed).rand(len(self.byte_vocab)).astype(np.float32)
        return torch.log_softmax(peaked(torch.from_numpy(scores)), dim=-1)


# ---------------------------------------------------------------------------- helpers


def compare(ours, ref, *, tol=2e-3, floor=1e-4, logz_tol=1e-2, what=""):
    """Two trajectories of ``(log-probs [258], logZ)``: same length, close values."""
    assert len(ours) == len(ref), what
    for step, ((lp, z), (lq, zq)) in enumerate(zip(ours, ref)):
        big = (np.exp(lp) > floor) | (np.exp(lq) > floor)
        err = np.max(np.abs(lp[big] - lq[big]), initial=0.0)
        assert err <= tol, f"{what} step {step}: next-byte log-prob differs by {err:.2e}"
        assert abs(z - zq) <= logz_tol, f"{what} step {step}: logZ {z} vs {zq}"


def assert_identical(ours, again):
    """Two trajectories of ``(log-probs [258], logZ)``: same length, equal bit for bit."""
    assert len(ours) == len(again)
    for step, ((lp, z), (lq, zq)) in enumerate(zip(ours, again)):
        np.testing.assert_array_equal(lp, lq, err_msg=f"step {step}")
        assert z == zq, step


async def trajectory(beam, prompt, continuation):
    """Prefill ``prompt``; then, byte by byte through ``continuation``, record
    ``(logp_next, logZ)`` before each byte and once at the end."""
    beam = await beam.prefill(prompt)
    out = []
    for b in continuation:
        out.append((np.asarray((await beam.logp_next()).ps, dtype=np.float64), float(beam.logZ)))
        beam = await (beam.prune() << b)
    out.append((np.asarray((await beam.logp_next()).ps, dtype=np.float64), float(beam.logZ)))
    return out, beam


class RefTries:
    """genlm-bytes tries, one per EOS configuration (built once: seconds each)."""

    def __init__(self, llm):
        self.llm = llm
        self.tries = {}

    async def initial(self, params):
        """``genlm.bytes.ByteBeamState.initial`` with a cached trie."""
        key = frozenset(params.eos_byte_strings)
        if key not in self.tries:
            self.tries[key] = ref_bytes.AsyncTokenByteTrie.from_vocab(
                self.llm.byte_vocab, eos_byte_strings=params.eos_byte_strings
            )
        state = ref_bytes.LazyTrieState.initial(
            self.llm, self.tries[key], mode=RefTrieMode.WITH_EOS
        )
        return ref_bytes.ByteBeamState([await state.materialize()], params)


def heal_spy(monkeypatch, module):
    """Record each call of ``module.ByteBeamState._adaptive_heal`` and whether it healed."""
    calls = []
    original = module.ByteBeamState._adaptive_heal

    async def spy(self, next_byte):
        out = await original(self, next_byte)
        calls.append((next_byte, out is not None))
        return out

    monkeypatch.setattr(module.ByteBeamState, "_adaptive_heal", spy)
    return calls


class LogpOnlyState:
    """A token-level LM state offering only what genlm-bytes' LazyTrieState uses:
    ``<< token`` and ``await logp_next()`` (no ``model`` / ``context``)."""

    def __init__(self, model, context):
        self._model, self._context = model, list(context)

    def __lshift__(self, token):
        return LogpOnlyState(self._model, self._context + [token])

    async def logp_next(self):
        return await self._model.next_token_logprobs(self._context)
