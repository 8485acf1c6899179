"""``genlm_fast.demo``'s numbers on the real SmolLM2-135M-Instruct.

The demo's numbers are checked against computations that do not go through genlm_fast:

* the next-byte distribution after the prompt, and the greedy and seeded sampled
  continuations, against genlm-bytes 0.2.0's beam on genlm-backend 0.3.1's AsyncTransformer
  (same model directory, same K and EOS; the sampled one drawn by genlm-bytes' own sampler,
  arsenal's inverse-CDF ``sample_dict``, from the same uniform draws);
* with an empty prompt, the first-byte distribution against a brute-force sum over the
  vocabulary of a float64 forward pass: P(first byte = b) = sum of p(token) over the tokens
  whose bytes start with b (the end-of-sequence token counting as EOS instead);
* the prefix log-probability: the sum of its per-byte terms, each equal to the reference
  beam's next-byte log-probability along the string;
* importance sampling: weights normalized, every particle within the mask (token count and
  token lengths), its text the bytes of its tokens, its log-weight recomputed from
  genlm-backend's next-token log-probabilities with the same mask.


The command line is in test_cli.py.
"""

from __future__ import annotations

import asyncio
import math
import warnings

import numpy as np
import pytest
import torch

from genlm_fast.bytes.util import EOS_INDEX
from genlm_fast.demo import demo
from tests.cli_fixtures import cli_environment as cli_environment  # autouse
from tests.cli_fixtures import model_dir as model_dir  # a fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = "The capital of France is"
STRING = " Paris"
SMALL = {
    "n_bytes": 4,
    "n_particles": 4,
    "max_tokens": 3,
    "max_token_length": 4,
    "K": 5,
    "seed": 3,
    "top": 10,
}
TOL, FLOOR = 2e-3, 1e-4  # next-byte log-probabilities, on outcomes with p > FLOOR


@pytest.fixture(scope="module")
def ours(model_dir):
    from genlm_fast.backend.llm import AsyncTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = AsyncTransformer.from_name(model_dir)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def ref_lm(model_dir):
    import genlm.backend.llm as ref_llm  # the reference, a pinned test dependency

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref_llm.AsyncTransformer.from_name(model_dir)  # offline: a local directory


@pytest.fixture(scope="module")
def result(ours):
    return demo(llm=ours, prompt=PROMPT, string=STRING, verbose=False, **SMALL)


@pytest.fixture(scope="module")
def reference(ref_lm, result):
    """genlm-bytes on genlm-backend: the same four byte-level computations as the demo."""
    import genlm.bytes as ref_bytes
    from arsenal.maths import sample_dict  # genlm-bytes' own sampler (its default draw)

    eos = [bytes(ref_lm.byte_vocab[ref_lm.tokenizer.eos_token_id])]
    prompt, string = PROMPT.encode(), STRING.encode()

    async def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = await ref_bytes.ByteBeamState.initial(
                ref_lm, ref_bytes.BeamParams(K=SMALL["K"], eos_byte_strings=eos)
            )
        beam = await start.prefill(prompt)
        first = np.asarray((await beam.logp_next()).ps, dtype=np.float64)
        per_byte = []
        for b in string:
            per_byte.append(np.asarray((await beam.logp_next()).ps, dtype=np.float64)[b])
            beam = await (beam.prune() << b)
        greedy = await start.greedy(prompt, SMALL["n_bytes"])
        rng = np.random.default_rng(SMALL["seed"])
        sampled = await start.sample(
            prompt, SMALL["n_bytes"], draw=lambda q: sample_dict(q, u=rng.uniform())
        )
        return {"first": first, "per_byte": per_byte, "greedy": greedy, "sampled": sampled}

    return asyncio.run(run())


def close_logps(ours, ref):
    big = (np.exp(ours) > FLOOR) | (np.exp(ref) > FLOOR)
    return float(np.max(np.abs(ours[big] - ref[big])))


# ---------------------------------------------------------------------------- 1. next byte


def test_next_byte_distribution_is_normalized_and_sorted(result):
    logps = result.next_byte_logps
    assert logps.shape == (258,)
    assert abs(np.exp(logps).sum() - 1.0) < 1e-6
    probs = [p for _, p in result.top_bytes]
    assert len(probs) == SMALL["top"] and probs == sorted(probs, reverse=True)
    for symbol, p in result.top_bytes:
        assert p == pytest.approx(math.exp(logps[symbol]))
    assert result.top_bytes[0][0] == ord(" ")  # "The capital of France is" -> " Paris"


def test_next_byte_distribution_matches_genlm_bytes(result, reference):
    assert close_logps(result.next_byte_logps, reference["first"]) <= TOL


def test_first_byte_matches_brute_force_over_the_vocabulary(ours, model_dir):
    """Empty prompt: the beam's first-byte distribution is a sum over the vocabulary."""
    from transformers import AutoModelForCausalLM

    res = demo(
        llm=ours,
        prompt="",
        string="T",
        n_bytes=0,
        n_particles=1,
        max_tokens=1,
        max_token_length=4,
        K=2,
        seed=0,
        verbose=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    bos, eos = ours.tokenizer.bos_token_id, ours.tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([[bos]])).logits[0, -1]
    probs = torch.softmax(logits, dim=-1).numpy()
    eos_bytes = bytes(ours.byte_vocab[eos])
    expected = np.zeros(258)
    for token_id, token in enumerate(ours.byte_vocab):
        if bytes(token) == eos_bytes:
            expected[EOS_INDEX] += probs[token_id]
        elif len(token):
            expected[token[0]] += probs[token_id]
    got = np.exp(res.next_byte_logps)
    assert abs(expected.sum() - 1.0) < 1e-9  # every token has a first byte (or is EOS)
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-6)
    # and the prefix probability of one byte is that byte's probability
    assert res.prefix_logp == pytest.approx(math.log(expected[ord("T")]), abs=2e-3)


# ---------------------------------------------------------------------------- 2. continuations


def test_continuations_match_genlm_bytes(result, reference):
    prompt = PROMPT.encode()
    for text in (result.greedy, result.sampled):
        assert text.startswith(prompt) and len(text) == len(prompt) + SMALL["n_bytes"]
    assert result.greedy == reference["greedy"]
    assert result.sampled == reference["sampled"]  # same seed, same inverse-CDF draws


def test_sampling_is_seeded(ours, result):
    again = demo(
        llm=ours,
        prompt=PROMPT,
        string="",
        verbose=False,
        **{**SMALL, "n_particles": 1, "max_tokens": 1},
    )
    assert again.sampled == result.sampled and again.greedy == result.greedy


# ---------------------------------------------------------------------------- 3. prefix


def test_prefix_probability(result, reference):
    per_byte = result.string_byte_logps
    assert len(per_byte) == len(STRING.encode())
    assert result.prefix_logp == pytest.approx(sum(per_byte), abs=1e-12)
    assert per_byte[0] == pytest.approx(result.next_byte_logps[ord(" ")], abs=1e-12)
    np.testing.assert_allclose(per_byte, reference["per_byte"], atol=TOL)
    assert -3.0 < result.prefix_logp < 0.0  # " Paris" is likely after the prompt


# ---------------------------------------------------------------------------- 4. SIS


def test_importance_sampling_particles_respect_the_mask(ours, result):
    assert len(result.particles) == SMALL["n_particles"]
    assert sum(p.weight for p in result.particles) == pytest.approx(1.0, abs=1e-9)
    ess = 1.0 / sum(p.weight**2 for p in result.particles)
    assert result.effective_sample_size == pytest.approx(ess)
    assert 1.0 - 1e-9 <= ess <= SMALL["n_particles"] + 1e-9
    eos = ours.tokenizer.eos_token_id
    for p in result.particles:
        assert 0.0 <= p.weight <= 1.0 and math.isfinite(p.log_weight)
        assert len(p.token_ids) <= SMALL["max_tokens"]
        assert eos not in p.token_ids
        assert all(len(ours.byte_vocab[t]) <= SMALL["max_token_length"] for t in p.token_ids)
        text = b"".join(bytes(ours.byte_vocab[t]) for t in p.token_ids)
        assert p.text == text.decode("utf-8", "replace")
    ids = result.sis_prompt_ids
    assert ids[0] == ours.tokenizer.bos_token_id
    assert ids[1:] == ours.tokenizer.encode(PROMPT, add_special_tokens=False)


def test_importance_weights_match_genlm_backend(ref_lm, result):
    """log-weight = sum over steps of log sum_{allowed t} p(t | context), recomputed."""
    eos, L = ref_lm.tokenizer.eos_token_id, SMALL["max_token_length"]
    allowed = torch.tensor([len(t) <= L for t in ref_lm.byte_vocab])
    allowed[eos] = True
    contexts, owners = [], []
    for i, p in enumerate(result.particles):
        for n in range(len(p.token_ids) + 1):  # every step, the last one drawing EOS
            contexts.append(result.sis_prompt_ids + p.token_ids[:n])
            owners.append((i, n))
    rows = ref_lm.batch_next_token_logprobs_sync(contexts).double().cpu()
    rows = rows[:, : len(ref_lm.byte_vocab)]
    expected = np.zeros(len(result.particles))
    for (i, n), row in zip(owners, rows):
        if n >= SMALL["max_tokens"]:
            expected[i] += float(row[eos])
        else:
            expected[i] += float(torch.logsumexp(row[allowed], dim=0))
    got = np.array([p.log_weight for p in result.particles])
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_timings_are_reported(result):
    for section in (
        "load model",
        "build byte trie",
        "next-byte distribution",
        "greedy continuation",
        "sampled continuation",
        "prefix probability",
        "importance sampling",
    ):
        assert result.timings[section] >= 0.0
    assert result.timings["importance sampling"] > 0.0
