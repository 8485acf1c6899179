"""The byte-level beam (genlm_fast.bytes) against genlm-bytes 0.2.0 on two deterministic
mock LMs that give the same distributions (ours over genlm_fast's ``MockAsyncLM``,
genlm-bytes over genlm.backend's), peaked so that beams hold several tokenizations: whole
trajectories agree (next-byte log-probabilities, logZ, greedy and seeded sampling), for
several K, with and without EOS, with pruning, with healing; the state-level API agrees
too, and the beam takes genlm.backend's models and genlm.bytes' BeamParams as they are.
"""

from __future__ import annotations

import genlm.bytes as ref_bytes
import numpy as np
import pytest
from genlm.bytes.byte_lm import beam as ref_beam_module

from genlm_fast.bytes import (
    EOS,
    BeamParams,
    ByteBeamState,
    LazyTrieState,
    TrieMode,
    fused_stats,
)
from genlm_fast.bytes.byte_lm import beam as fast_beam_module
from genlm_fast.bytes.byte_lm import mass_rows
from tests.bytes.beam_support import (
    GPT2_EOS,
    PeakedMock,
    assert_identical,
    compare,
    heal_spy,
    trajectory,
)

MOCK_CASES = [
    # K, eos, prune_threshold, prompt, continuation
    (1, False, 0.0, b"Hello world, this", b" is fine."),
    (3, True, 0.0, b"Hello world, this", b" is fine."),
    (8, False, 0.0, b"The cat sat", b" on the mat"),
    (8, True, 0.0, b"The cat sat", b" on the mat"),
    (4, False, 0.02, b"The cat sat", b" on the mat"),  # pruning: the non-speculative path
]


@pytest.mark.asyncio
@pytest.mark.parametrize("K,eos,threshold,prompt,continuation", MOCK_CASES)
async def test_mock_trajectories_agree(
    mock, ref_mock, ref_tries, K, eos, threshold, prompt, continuation
):
    eos_strings = [GPT2_EOS] if eos else None
    ours, _ = await trajectory(
        await ByteBeamState.initial(
            mock, BeamParams(K=K, prune_threshold=threshold, eos_byte_strings=eos_strings)
        ),
        prompt,
        continuation,
    )
    ref, _ = await trajectory(
        await ref_tries.initial(
            ref_bytes.BeamParams(K=K, prune_threshold=threshold, eos_byte_strings=eos_strings)
        ),
        prompt,
        continuation,
    )
    compare(ours, ref, tol=2e-4, logz_tol=1e-3, what=f"K={K} eos={eos}")
    if eos:  # after prefill, EOS is an outcome of its own
        assert all(np.isfinite(lp[EOS]) for lp, _ in ours)


@pytest.mark.asyncio
async def test_mock_healing_agrees(mock, ref_mock, ref_tries, monkeypatch, capsys):
    # K=1 keeps one tokenization, here inside a long token at b"internat", which is no
    # token itself: no token continues it with b"x", so the beam must heal
    prompt, continuation = b"internat", b"xion al"
    ours_calls = heal_spy(monkeypatch, fast_beam_module)
    ref_calls = heal_spy(monkeypatch, ref_beam_module)
    ours, _ = await trajectory(
        await ByteBeamState.initial(mock, BeamParams(K=1)), prompt, continuation
    )
    ref, _ = await trajectory(
        await ref_tries.initial(ref_bytes.BeamParams(K=1)), prompt, continuation
    )
    compare(ours, ref, tol=2e-4, logz_tol=1e-3, what="healing")
    assert ours_calls == ref_calls
    assert any(ok for _, ok in ours_calls), "the case was meant to exercise healing"
    # verbose healing tells what it did
    beam = await (await ByteBeamState.initial(mock, BeamParams(K=1, verbose=True))).prefill(prompt)
    await (beam << continuation[0])
    out = capsys.readouterr().out
    assert "[heal] SUCCESS" in out and "Candidates:" in out


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "K,prompt,continuation", [(3, b"The cat", b" sat on"), (1, b"internat", b"xion al")]
)
async def test_rows_read_in_place_or_gathered(tokenizer, monkeypatch, K, prompt, continuation):
    """A pool in host memory is read in place, a device pool through gathers of the nodes the
    states read (kept per row): both ways give the same trajectories bit for bit, healing
    included (the second case heals). The gather path is forced here, on the CPU, by giving
    every row a dict of values read, as rows of a device pool have; each run gets a fresh LM
    (and so a fresh trie, pool and memo)."""
    params = BeamParams(K=K, eos_byte_strings=[GPT2_EOS])
    in_place, beam = await trajectory(
        await ByteBeamState.initial(PeakedMock(tokenizer), params), prompt, continuation
    )
    assert all(isinstance(s.mass.values, mass_rows._PoolValues) for s in beam.states)
    assert fused_stats(beam)["gathers"] == 0
    original = mass_rows._Row.__init__

    def gathered(self, *args):
        original(self, *args)
        self.values = {}

    monkeypatch.setattr(mass_rows._Row, "__init__", gathered)
    via_gathers, beam = await trajectory(
        await ByteBeamState.initial(PeakedMock(tokenizer), params), prompt, continuation
    )
    assert all(isinstance(s.mass.values, dict) for s in beam.states)
    assert fused_stats(beam)["gathers"] > 0
    assert_identical(in_place, via_gathers)


@pytest.mark.asyncio
async def test_a_second_run_on_one_lm_repeats_the_first(tokenizer):
    """The second run finds the LM's rows in its output cache (and the trie's masses in the
    beam's pool) where the first computed them: the trajectories are equal bit for bit."""
    lm = PeakedMock(tokenizer)
    params = BeamParams(K=3, eos_byte_strings=[GPT2_EOS])
    runs = []
    for _ in range(2):
        runs.append(
            await trajectory(await ByteBeamState.initial(lm, params), b"The cat", b" sat on")
        )
    (first, _), (second, _) = runs
    assert lm.stats["cache_hits"] > 0
    assert_identical(first, second)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "options",
    [
        {"heal": False},
        {"heal_max_backoff": 0},
        {"heal_max_backoff": 2},
        {"heal_max_splits": 0},
        {"heal_max_splits": 1},
    ],
)
async def test_mock_healing_options_agree(mock, ref_mock, ref_tries, options):
    ours = await (await ByteBeamState.initial(mock, BeamParams(K=1, **options))).prefill(
        b"internat"
    )
    ref = await (await ref_tries.initial(ref_bytes.BeamParams(K=1, **options))).prefill(b"internat")
    ours, ref = await (ours.prune() << ord("x")), await (ref.prune() << ord("x"))
    assert len(ours) == len(ref)
    assert ours.logZ == pytest.approx(ref.logZ, abs=1e-3)
    if len(ours):
        assert [s.lm_state.context for s in ours] == [s.lm_state.context for s in ref]
    # reading on, from a beam that may be empty (heal=False): the same beam, logZ -inf
    # where genlm-bytes' is
    ours, ref = await ours.prefill(b"yz"), await ref.prefill(b"yz")
    assert len(ours) == len(ref)
    assert ours.logZ == pytest.approx(ref.logZ, abs=1e-3)


@pytest.mark.asyncio
async def test_runs_on_a_genlm_backend_model(mock, ref_mock):
    # a genlm app may keep genlm.backend's LM: its Tokens and log-probabilities are used
    # as they are (no raw logits there: log-probabilities are valid logits)
    ours, _ = await trajectory(
        await ByteBeamState.initial(mock, BeamParams(K=3)), b"The c", b"at sat"
    )
    on_ref, _ = await trajectory(
        await ByteBeamState.initial(ref_mock, BeamParams(K=3)), b"The c", b"at sat"
    )
    compare(on_ref, ours, tol=1e-5, logz_tol=1e-5, what="genlm.backend model")


@pytest.mark.asyncio
async def test_takes_genlm_bytes_beam_params(mock):
    # parameters an app built with genlm.bytes (imported before the drop-in) mean the same
    options = {
        "K": 2,
        "prune_threshold": 0.01,
        "eos_byte_strings": [GPT2_EOS],
        "heal_max_backoff": 3,
    }
    ours, _ = await trajectory(
        await ByteBeamState.initial(mock, BeamParams(**options)), b"The c", b"at"
    )
    theirs_params = ref_bytes.BeamParams(**options)
    via_genlm, _ = await trajectory(
        await ByteBeamState.initial(mock, theirs_params), b"The c", b"at"
    )
    compare(via_genlm, ours, tol=0, logz_tol=0, what="genlm.bytes BeamParams")
    for bad in ({"K": 2}, 2, None):
        with pytest.raises(TypeError, match="params must be a BeamParams"):
            await ByteBeamState.initial(mock, bad)


@pytest.mark.asyncio
async def test_mock_greedy_and_sample_agree(mock, ref_mock, ref_tries):
    params = {"K": 4, "eos_byte_strings": [GPT2_EOS]}
    ours = await (await ByteBeamState.initial(mock, BeamParams(**params))).greedy(b"Once", 8)
    ref = await (await ref_tries.initial(ref_bytes.BeamParams(**params))).greedy(b"Once", 8)
    assert ours == ref
    np.random.seed(7)
    ours = await (await ByteBeamState.initial(mock, BeamParams(**params))).sample(b"Once", 8)
    np.random.seed(7)
    ref = await (await ref_tries.initial(ref_bytes.BeamParams(**params))).sample(b"Once", 8)
    assert ours == ref


@pytest.mark.asyncio
async def test_state_level_api_agrees(mock, ref_mock, ref_tries):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2))
    ref = await ref_tries.initial(ref_bytes.BeamParams(K=2))
    (state,), (rstate,) = beam.states, ref.states
    assert state.node == rstate.node == state.root
    np.testing.assert_allclose(state.logp_next.ps, rstate.logp_next.ps, atol=1e-4)
    full = np.asarray(state.mass)  # an explicit full copy, same numbering as genlm's
    assert full.shape == (len(rstate.mass),)
    finite = np.isfinite(rstate.mass) & (rstate.mass > -60)
    np.testing.assert_allclose(full[finite], rstate.mass[finite], atol=1e-4)
    # apps use genlm's mass as the float32 array it is: so can they ours (on a host copy)
    mass = state.mass
    assert (mass.dtype, mass.ndim, mass.shape) == (rstate.mass.dtype, 1, rstate.mass.shape)
    assert mass.max() == pytest.approx(float(rstate.mass.max()), abs=1e-4)
    for got, want in (
        (mass - 1, rstate.mass - 1),
        (2 * mass, 2 * rstate.mass),
        (np.asarray(mass.tolist()), rstate.mass),
        (mass.astype(np.float64), rstate.mass),
    ):
        np.testing.assert_allclose(np.asarray(got)[finite], want[finite], atol=2e-4)
    with pytest.raises(AttributeError, match="no attribute 'pool_size'"):
        _ = mass.pool_size
    s, r = state << ord("H"), rstate << ord("H")
    assert s.node == r.node and s.partial == r.partial == [ord("H")]
    assert abs(s.weight - r.weight) < 1e-4
    assert [(n, t) for n, t in s.get_all_EOT()] == [(int(n), int(t)) for n, t in r.get_all_EOT()]
    (e,), (re_,) = s.extend_all(), r.extend_all()
    assert e.lm_state.context == re_.lm_state.context and abs(e.weight - re_.weight) < 1e-4
    assert s.extend() is e and s.get_EOT() == s.get_all_EOT()[0][0]
    assert state.with_mode(TrieMode.WITHOUT_EOS).mode is TrieMode.WITHOUT_EOS
    assert state.with_mode("without_eos").mass is state.mass  # masses are kept
    assert (state << EOS).terminated  # EOS hangs off the root
    await e.materialize()
    assert e.is_materialized and np.isclose(e.mass[e.root], 0.0, atol=1e-5)
    # a state built on a caller's full mass vector (genlm style) reads it as is
    host = LazyTrieState(state.lm_state, state.trie, state.root, 0.0, mass=rstate.mass)
    np.testing.assert_allclose(host.logp_next.ps, rstate.logp_next.ps, atol=1e-6)
    assert (host << ord("H")).weight == pytest.approx(r.weight, abs=1e-6)
