"""The byte-level beam (genlm_fast.bytes) against genlm-bytes 0.2.0.

* On two deterministic mock LMs that give the same distributions (ours over genlm_fast's
  ``MockAsyncLM``, genlm-bytes over genlm.backend's), peaked so that beams hold several
  tokenizations: whole trajectories agree (next-byte log-probabilities, logZ, greedy and
  seeded sampling), for several K, with and without EOS, with pruning, with healing.
* The fused path: one LM batch, one kernel launch and one gather per step, no full row
  ever copied to the host.
* Bad input: each a clear exception.
* On the real SmolLM2-135M-Instruct (genlm-bytes on genlm.backend's AsyncTransformer, ours
  on genlm_fast's, same local directory): K in {1, 5, 16}, with and without EOS, a prompt
  that needs healing, greedy decoding.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import genlm.backend.llm as ref_llm
import genlm.bytes as ref_bytes
import numpy as np
import pytest
import torch
from genlm.bytes.byte_lm import beam as ref_beam_module
from genlm.bytes.trie import TrieMode as RefTrieMode

from bench.vocabs import gpt2_tokenizer
from genlm_fast.backend.llm import MockAsyncLM
from genlm_fast.backend.tokenization import Token
from genlm_fast.bytes import (
    EOS,
    AsyncTokenByteTrie,
    BeamParams,
    ByteBeamState,
    Chart,
    EmptyBeamError,
    LazyByteProbs,
    LazyTrieState,
    TokenHealer,
    TrieMode,
    fused_stats,
)
from genlm_fast.bytes.byte_lm import beam as fast_beam_module
from genlm_fast.bytes.byte_lm import mass_rows

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


# ---------------------------------------------------------------------------- mock LMs


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Run single-threaded: these are small, latency-bound tensor ops, and on a shared
    2-core machine OpenMP hand-offs make them 10-100x slower (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def mock(tokenizer):
    return PeakedMock(tokenizer)


@pytest.fixture(scope="module")
def ref_mock(tokenizer):
    return RefPeakedMock(tokenizer)


@pytest.fixture(scope="module")
def ref_tries(ref_mock):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield RefTries(ref_mock)


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


# ---------------------------------------------------------------------------- the fused path


class Counter:
    """Counts the calls (and rows) of the model's batched logits and the trie's kernel."""

    def __init__(self, monkeypatch, llm, trie):
        self.lm_calls, self.lm_rows, self.kernels = 0, [], 0
        lm_fn, kernel_fn = llm.batch_next_token_logits, trie.batch_log_mass

        async def lm(contexts, *args, **kwargs):
            self.lm_calls += 1
            self.lm_rows.append(len(contexts))
            return await lm_fn(contexts, *args, **kwargs)

        def kernel(logits, mode=None):
            self.kernels += 1
            return kernel_fn(logits, mode)

        monkeypatch.setattr(llm, "batch_next_token_logits", lm)
        monkeypatch.setattr(trie, "batch_log_mass", kernel)


@pytest.mark.asyncio
@pytest.mark.parametrize("K", [1, 5, 16])
async def test_one_lm_batch_one_kernel_one_transfer_per_step(mock, monkeypatch, K):
    def no_full_rows(self):
        raise AssertionError("a full mass row was copied to the host")

    monkeypatch.setattr(mass_rows._Row, "numpy", no_full_rows)
    beam = await ByteBeamState.initial(mock, BeamParams(K=K, eos_byte_strings=[GPT2_EOS]))
    trie = beam.states[0].trie.trie
    count = Counter(monkeypatch, mock, trie)
    stats = fused_stats(beam)
    beam = await beam.prefill(b"The cat")
    steps = 0
    for b in b" sat on the mat":
        before = (
            count.lm_calls,
            count.kernels,
            stats["gathers"],
            stats["gathered_values"],
            stats["lookahead_hits"],
        )
        # the contexts of every token that can end at a hypothesis: all in one LM batch
        # (but for those whose logits the last prefill step computed ahead)
        contexts = {
            tuple(s.lm_state.context) + (int(t),)
            for s in beam.states
            if s._extend is None
            for _, t in s.get_all_EOT()
        }
        # each hypothesis reads its node and the node's children (at most the root's)
        budget = (len(beam.states) + len(contexts)) * (len(trie.children[trie.root]) + 1)
        await beam.logp_next()
        beam = await (beam.prune() << b)
        lm, kernels, gathers, values = (
            count.lm_calls - before[0],
            count.kernels - before[1],
            stats["gathers"] - before[2],
            stats["gathered_values"] - before[3],
        )
        ahead = stats["lookahead_hits"] - before[4]
        assert kernels == (1 if contexts else 0) and lm == (1 if len(contexts) > ahead else 0)
        if lm:
            assert count.lm_rows[-1] + ahead == len(contexts)
        assert gathers <= 1
        assert values <= budget and values < trie.num_nodes / 10
        steps += 1
    assert steps == len(b" sat on the mat")


@pytest.mark.asyncio
@pytest.mark.parametrize("K", [1, 3])
async def test_prefill_looks_one_byte_ahead(mock, monkeypatch, K):
    # reading bytes without logp_next: each LM batch also computes the logits of the tokens
    # the next step can commit, so about every other step needs no LM call; every step
    # still runs one kernel launch and one gather
    beam = await ByteBeamState.initial(mock, BeamParams(K=K))
    trie = beam.states[0].trie.trie
    count = Counter(monkeypatch, mock, trie)
    stats = fused_stats(beam)
    data = b"The capital of France is Paris"
    for b in data:
        before = (count.lm_calls, count.kernels, stats["gathers"])
        beam = await (beam.prune() << b)
        assert count.lm_calls - before[0] <= 1
        assert count.kernels - before[1] <= 1 and stats["gathers"] - before[2] <= 1
    assert count.lm_calls <= len(data) // 2 + 2 < count.kernels
    ref = await (await ByteBeamState.initial(mock, BeamParams(K=K))).prefill(data)
    assert ref.logZ == pytest.approx(beam.with_mode(TrieMode.WITH_EOS).logZ, abs=1e-9)
    await beam.cleanup()
    assert not beam.states[0]._info.logits_memo


@pytest.mark.asyncio
async def test_masses_stay_on_the_device_pool(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=3))
    beam = await beam.prefill(b"Hi there")
    rows = {id(s._mass) for s in beam.states}
    pool = beam.states[0]._mass.pool
    assert pool.live >= len(rows) and pool.data.shape[1] == beam.states[0].trie.trie.num_nodes
    state = beam.states[0]
    full = np.asarray(state.mass)
    for node in [state.node, state.root, *state.children[state.node].values()]:
        assert state.mass[node] == pytest.approx(float(full[node]), abs=1e-6)
    del beam, state, full
    import gc

    gc.collect()
    assert pool.live == 0 and pool.data is None  # every row released, memory returned


@pytest.mark.asyncio
async def test_rows_are_reused_across_beams(mock):
    a = await ByteBeamState.initial(mock, BeamParams(K=2))
    b = await ByteBeamState.initial(mock, BeamParams(K=2))
    assert a.states[0].trie is b.states[0].trie  # one trie per model and options
    assert a.states[0]._mass is b.states[0]._mass  # same context: the row is shared
    stats = fused_stats(a)
    hits = stats["memo_hits"]
    a2 = await a.prefill(b"ab")  # rows are shared while a state holds them
    await a2.logp_next()
    calls = stats["lm_batches"]
    b2 = await b.prefill(b"ab")
    await b2.logp_next()
    assert stats["lm_batches"] == calls and stats["memo_hits"] > hits
    assert [s._mass for s in a2.states] == [s._mass for s in b2.states]


class AdapterMock(PeakedMock):
    """A mock with one LoRA-like adapter, ``"b"``: it answers for ``context + [7]``.
    With ``switch_after_batch`` set, the next LM batch switches the default adapter to
    ``"b"`` once its rows are computed: another task calling ``set_lora`` while a beam
    step's batch is in flight."""

    switch_after_batch = False

    def _resolve_lora(self, lora_name):
        return self._active_lora if lora_name is None else lora_name

    def _forward(self, lora_name, rows):
        if lora_name == "b":
            rows = [list(r) + [7] for r in rows]
        return super()._forward(None, rows)

    async def batch_next_token_logits(self, token_ids_list, lora_name=None):
        out = await super().batch_next_token_logits(token_ids_list, lora_name=lora_name)
        if self.switch_after_batch:
            self.switch_after_batch = False
            self._active_lora = "b"  # moves state_epoch, as set_lora does
        return out


class RefAdapterB(RefPeakedMock):
    """genlm.backend's mock giving what ``AdapterMock`` gives under adapter ``"b"``."""

    def _get_logprobs(self, token_ids):
        return super()._get_logprobs(list(token_ids) + [7])


class LogpOnlyState:
    """A token-level LM state offering only what genlm-bytes' LazyTrieState uses:
    ``<< token`` and ``await logp_next()`` (no ``model`` / ``context``)."""

    def __init__(self, model, context):
        self._model, self._context = model, list(context)

    def __lshift__(self, token):
        return LogpOnlyState(self._model, self._context + [token])

    async def logp_next(self):
        return await self._model.next_token_logprobs(self._context)


@pytest.mark.asyncio
async def test_beam_over_logp_only_lm_states(mock, ref_mock, ref_tries):
    # states whose LM state only offers logp_next() are materialized on their own; reading
    # a byte must not look ahead through ``lm_state.model``, which they lack
    bos = [mock.tokenizer.bos_token_id]
    trie = (await ByteBeamState.initial(mock, BeamParams(K=3))).states[0].trie
    state = LazyTrieState(LogpOnlyState(mock, bos), trie, trie.trie.root, 0.0)
    ours, _ = await trajectory(
        ByteBeamState([await state.materialize()], BeamParams(K=3)), b"The c", b"at sat"
    )
    ref_trie = (await ref_tries.initial(ref_bytes.BeamParams(K=3))).states[0].trie
    ref_state = ref_bytes.LazyTrieState(
        LogpOnlyState(ref_mock, bos), ref_trie, ref_trie.trie.root, 0.0
    )
    ref, _ = await trajectory(
        ref_bytes.ByteBeamState([await ref_state.materialize()], ref_bytes.BeamParams(K=3)),
        b"The c",
        b"at sat",
    )
    compare(ours, ref, tol=2e-4, logz_tol=1e-3, what="logp-only LM states")


@pytest.mark.asyncio
async def test_adapter_switch_during_a_step_is_not_remembered(tokenizer):
    # A step's LM batch also computes logits of the next step's contexts (lookahead).
    # If the default adapter changes while that batch is in flight, those logits (of the
    # old adapter) were kept under the new adapter's key, and a beam under the new
    # adapter read them: its next-byte distribution was off by tens of nats.
    lm = AdapterMock(tokenizer)
    beam = await (await ByteBeamState.initial(lm, BeamParams(K=3))).prefill(b"Hel")
    lm.switch_after_batch = True
    await (beam.prune() << ord("l"))
    assert lm._active_lora == "b" and not lm.switch_after_batch
    ours = await (await ByteBeamState.initial(lm, BeamParams(K=3))).prefill(b"Hell")
    ours_lp = np.asarray((await ours.logp_next()).ps, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = await (
            await RefTries(RefAdapterB(tokenizer)).initial(ref_bytes.BeamParams(K=3))
        ).prefill(b"Hell")
        ref_lp = np.asarray((await ref.logp_next()).ps, dtype=np.float64)
    compare(
        [(ours_lp, float(ours.logZ))],
        [(ref_lp, float(ref.logZ))],
        tol=2e-4,
        logz_tol=1e-3,
        what="after an adapter switch",
    )


# ---------------------------------------------------------------------------- bad input


@pytest.mark.asyncio
async def test_bad_bytes(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2))
    for bad in (256, 258, -1, 1000):
        with pytest.raises(ValueError, match="out of range"):
            await (beam << bad)
    for bad in ("a", b"a", 1.5, None, True):
        with pytest.raises(TypeError, match="byte"):
            await (beam << bad)
    for bad in (256, 300):
        with pytest.raises(ValueError, match="out of range"):
            beam.states[0] << bad
    with pytest.raises(ValueError, match="Invalid index"):
        (await beam.logp_next())[258]
    await (beam << np.int64(72))  # numpy ints are fine


@pytest.mark.asyncio
async def test_empty_beam(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2, eos_byte_strings=[GPT2_EOS]))
    done = await (beam << EOS)  # reading EOS ends every hypothesis
    assert len(done) == 1 and done.states[0].terminated
    # nothing can follow EOS: every next byte has log-probability -inf (genlm-bytes: NaN)
    assert np.isneginf(np.asarray((await done.logp_next()).ps)).all()
    empty = await (done.prune() << ord("a"))  # nothing follows EOS: probability zero
    assert len(empty) == 0 and empty.logZ == -np.inf
    # reading on stays empty, as in genlm-bytes (text of probability zero scores -inf);
    # reading the next-byte distribution of an empty beam raises
    for later in (await (empty << ord("b")), await empty.prefill(b"bc")):
        assert len(later) == 0 and later.logZ == -np.inf
    with pytest.raises(EmptyBeamError, match="empty beam"):
        await empty.logp_next()
    with pytest.raises(EmptyBeamError):
        await ByteBeamState([], BeamParams(K=1)).logp_next()
    with pytest.raises(AssertionError):  # what genlm-bytes raises there: callers catch it
        await empty.logp_next()
    with pytest.raises(AssertionError, match="Beam is empty"):
        await ref_bytes.ByteBeamState([], ref_bytes.BeamParams(K=1)).logp_next()
    assert len(empty.prune()) == 0 and await empty.extend(0.0) == []


def test_bad_params():
    for K in (0, -3):
        with pytest.raises(ValueError, match="at least 1"):
            BeamParams(K=K)
    for K in (1.5, "5", True, None):
        with pytest.raises(TypeError, match="K must be an int"):
            BeamParams(K=K)
    with pytest.raises(ValueError, match="non-negative"):
        BeamParams(K=2, prune_threshold=-0.1)
    with pytest.raises(ValueError):
        BeamParams(K=2, prune_threshold=float("nan"))
    for bad in ("0.1", b"0.1", None):  # genlm-bytes raises TypeError for these too
        with pytest.raises(TypeError, match="prune_threshold must be a number"):
            BeamParams(K=2, prune_threshold=bad)
    assert BeamParams(K=2, prune_threshold=np.float32(0.25)).prune_threshold == 0.25
    with pytest.raises(TypeError, match="collection of byte strings"):
        BeamParams(K=2, eos_byte_strings=b"<|endoftext|>")
    with pytest.raises(TypeError, match="bytes"):
        BeamParams(K=2, eos_byte_strings=["<|endoftext|>"])
    with pytest.raises(TypeError, match="both"):
        BeamParams(K=2, eos_byte_strings=[b"a"], eos_tokens=[b"a"])
    with pytest.raises(ValueError, match="heal_max_backoff"):
        BeamParams(K=2, heal_max_backoff=-1)
    for name in ("max_backoff", "max_splits"):  # the healer itself, used directly
        for bad in (-1, True, 1.5, "2"):
            with pytest.raises(ValueError, match=name):
                TokenHealer(**{name: bad})
        assert getattr(TokenHealer(**{name: 0}), name) == 0
    with pytest.warns(DeprecationWarning, match="eos_tokens"):
        p = BeamParams(K=2, eos_tokens=[b"x"])
    assert p.eos_byte_strings == {b"x"} and p.eos_tokens is None
    assert BeamParams(K=2, eos_byte_strings=[bytearray(b"x"), b"x"]).eos_byte_strings == {b"x"}
    assert BeamParams(K=3).log_prune_threshold == -np.inf


@pytest.mark.asyncio
async def test_bad_prefill(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2))
    with pytest.raises(TypeError, match="encode it first"):
        await beam.prefill("Hello")
    for bad in (None, 42, 3.0, [b"a"]):
        with pytest.raises(TypeError, match="prefill expects bytes"):
            await beam.prefill(bad)
    with pytest.raises(ValueError, match="0..255"):
        await beam.prefill([72, 300])
    with pytest.raises(ValueError, match="0..255"):
        await beam.prefill([257])
    ok = await beam.prefill(bytearray(b"Hi"))
    # any iterable of ints 0..255, as genlm-bytes reads it
    for same in (
        [72, 105],
        np.array([72, 105]),
        np.frombuffer(b"Hi", dtype=np.uint8),
        (b for b in b"Hi"),
        torch.tensor([72, 105]),
    ):
        assert (await beam.prefill(same)).logZ == pytest.approx(ok.logZ)
    with pytest.raises(TypeError, match="prefill expects bytes"):
        await beam.prefill(np.array([72.0, 105.0]))
    with pytest.raises(TypeError, match="BeamParams"):
        await ByteBeamState.initial(mock, {"K": 2})
    with pytest.raises(ValueError, match="not in vocabulary"):
        await ByteBeamState.initial(mock, BeamParams(K=2, eos_byte_strings=[b"\xff\xfe!!nope"]))
    with pytest.raises(ValueError, match="not yet materialized"):
        _ = LazyTrieState.initial(mock, beam.states[0].trie).mass


def test_lazy_byte_probs_and_chart():
    ps = np.full(258, -np.inf)
    ps[65], ps[256], ps[257] = np.log(0.5), np.log(0.25), np.log(0.25)
    q = LazyByteProbs(ps)
    assert q[65] == ps[65] and q[None] == ps[256] and q[257] == ps[257]
    with pytest.raises(ValueError):
        LazyByteProbs(ps[:10])
    from genlm.bytes.util import LazyByteProbs as RefLazyByteProbs

    ref_q = RefLazyByteProbs(ps)
    for b in (-1, -2, -3, -258):  # counted from the end, as genlm-bytes does: -1 is EOS
        assert q[b] == ref_q[b] == ps[b]
    with pytest.raises(ValueError, match="Invalid index"):
        q[-259]
    chart = q.materialize()
    assert isinstance(chart, Chart) and chart.argmax() == 65 and chart[1000] == -np.inf
    assert q.pretty()[b"A"] == ps[65] and q.pretty()["EOS"] == ps[257]
    probs = chart.map_values(np.exp).trim()
    assert probs.sum() == pytest.approx(1.0) and probs.top(1) == {65: 0.5}
    assert (probs + probs)[65] == 1.0 and probs.normalize()[None] == pytest.approx(0.25)


def test_imports_without_display_packages():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('IPython', 'pandas', 'arsenal'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import genlm_fast.bytes as b\n"
        "from genlm_fast.bytes import ByteBeamState, BeamParams, LazyTrieState, TokenHealer\n"
        "from genlm_fast.bytes import StatefulTokenizedLM, StatefulByteLM, Chart, EOS\n"
        "from genlm_fast.bytes.util import format_table\n"
        "print(format_table([[1, 2]], headings=['a', 'b']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "<table>" in out.stdout


# ---------------------------------------------------------------------------- SmolLM2


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
