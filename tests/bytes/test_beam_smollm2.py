"""The byte-level beam (genlm_fast.bytes) against genlm-bytes 0.2.0 on the real
SmolLM2-135M-Instruct (genlm-bytes on genlm.backend's AsyncTransformer, ours on genlm_fast's,
same local directory): K in {1, 5, 16}, with and without EOS, a prompt that needs healing,
greedy decoding, a repeated run and a switched default adapter.
"""

from __future__ import annotations

import warnings

import genlm.backend.llm as ref_llm
import genlm.bytes as ref_bytes
import numpy as np
import pytest
from genlm.bytes.byte_lm import beam as ref_beam_module

from genlm_fast.bytes import EOS, BeamParams, ByteBeamState
from genlm_fast.bytes.byte_lm import beam as fast_beam_module
from tests.bytes.beam_support import RefTries, assert_identical, compare, heal_spy, trajectory


@pytest.fixture(scope="module")
def smollm2_dir():
    from genlm_fast.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def lms(smollm2_dir):
    """(ours, reference) AsyncTransformers over the same local SmolLM2 directory."""
    from genlm_fast.backend.llm import AsyncTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_llm.AsyncTransformer.from_name(smollm2_dir)  # offline: a local directory
        ours = AsyncTransformer.from_name(smollm2_dir)
    assert str(ref.device) == "cpu" and str(ours.device) == "cpu"
    yield ours, ref
    ours.cleanup()


@pytest.fixture(scope="module")
def smol_ref_tries(lms):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield RefTries(lms[1])


IM_END = b"<|im_end|>"
SMOL_CASES = [
    # K, eos, prompt, continuation, whether EOS gets some probability on the way
    (5, False, b"The capital of France is", b" Paris.", False),
    (1, True, b"Q: Is water wet?\nA: Yes", b".", True),
    (16, True, b"Hello, my name", b" is", False),
]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("K,eos,prompt,continuation,eos_likely", SMOL_CASES)
async def test_smollm2_agrees(lms, smol_ref_tries, K, eos, prompt, continuation, eos_likely):
    ours_lm, _ = lms
    eos_strings = [IM_END] if eos else None
    ours, beam = await trajectory(
        await ByteBeamState.initial(ours_lm, BeamParams(K=K, eos_byte_strings=eos_strings)),
        prompt,
        continuation,
    )
    ref, ref_beam = await trajectory(
        await smol_ref_tries.initial(ref_bytes.BeamParams(K=K, eos_byte_strings=eos_strings)),
        prompt,
        continuation,
    )
    compare(ours, ref, what=f"SmolLM2 K={K} eos={eos}")
    assert len(beam) == len(ref_beam)
    if eos_likely:  # EOS is a real outcome here, and its probability agrees (compare)
        assert any(np.exp(lp[EOS]) > 1e-4 for lp, _ in ours)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_smollm2_second_run_repeats_the_first(lms):
    """The real model: the first run computes its rows (logits for the trie), the second
    finds them in the output cache; the trajectories are equal bit for bit."""
    ours_lm, _ = lms
    params = BeamParams(K=4)
    hits = ours_lm.stats["cache_hits"]
    first, _ = await trajectory(
        await ByteBeamState.initial(ours_lm, params), b"Once upon a", b" time"
    )
    second, _ = await trajectory(
        await ByteBeamState.initial(ours_lm, params), b"Once upon a", b" time"
    )
    assert ours_lm.stats["cache_hits"] > hits
    assert_identical(first, second)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_smollm2_healing_agrees(lms, smol_ref_tries, monkeypatch):
    ours_lm, _ = lms
    ours_calls = heal_spy(monkeypatch, fast_beam_module)
    ref_calls = heal_spy(monkeypatch, ref_beam_module)
    # with K=1 the beam sits inside " Paris" at " Pari"; no token continues " Parix"
    prompt, continuation = b"The capital of France is Parix", b" and"
    ours, _ = await trajectory(
        await ByteBeamState.initial(ours_lm, BeamParams(K=1)), prompt, continuation
    )
    ref, _ = await trajectory(
        await smol_ref_tries.initial(ref_bytes.BeamParams(K=1)), prompt, continuation
    )
    compare(ours, ref, what="SmolLM2 healing")
    assert ours_calls == ref_calls and (ord("x"), True) in ours_calls


@pytest.mark.slow
@pytest.mark.asyncio
async def test_smollm2_greedy_agrees(lms, smol_ref_tries):
    ours_lm, _ = lms
    context = b"The capital of France is"
    ours = await (await ByteBeamState.initial(ours_lm, BeamParams(K=5))).greedy(context, 6)
    ref = await (await smol_ref_tries.initial(ref_bytes.BeamParams(K=5))).greedy(context, 6)
    assert ours == ref
    assert ours.startswith(context) and len(ours) == len(context) + 6


@pytest.mark.slow
@pytest.mark.asyncio
async def test_smollm2_beam_follows_the_default_adapter(lms, smollm2_dir, tmp_path):
    """The beam remembers node masses of live states and logits it computed a byte ahead.
    After set_lora / clear_lora (calls without lora_name answer differently) a beam must not
    reuse what was computed under the previous default: checked against a fresh LM that only
    ever had the adapter."""
    from genlm_fast.backend.llm import AsyncTransformer
    from tests.lora import make_lora_adapter

    ours_lm, _ = lms
    make_lora_adapter(smollm2_dir, tmp_path / "adapter")
    text = b"Hello there, general Kenobi"

    async def run(lm):
        beam = await (await ByteBeamState.initial(lm, BeamParams(K=2))).prefill(text)
        return beam, float(beam.logZ), np.asarray((await beam.logp_next()).ps)

    fresh = AsyncTransformer.from_name(smollm2_dir)
    fresh.add_new_lora(str(tmp_path / "adapter"), "a")
    fresh.set_lora(lora_name="a")
    _, want_z, want_lp = await run(fresh)
    fresh.cleanup()

    ours_lm.add_new_lora(str(tmp_path / "adapter"), "a")
    try:
        base_beam, base_z, base_lp = await run(ours_lm)  # stays alive: its rows stay memoized
        ours_lm.set_lora(lora_name="a")
        _, got_z, got_lp = await run(ours_lm)
        assert abs(got_z - want_z) < 1e-3 and abs(got_z - base_z) > 0.5
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-3)
        ours_lm.clear_lora()
        _, again_z, again_lp = await run(ours_lm)
        assert abs(again_z - base_z) < 1e-3
        np.testing.assert_allclose(again_lp, base_lp, atol=1e-3)
        del base_beam
    finally:
        ours_lm.clear_lora()
        ours_lm.remove_lora("a")
