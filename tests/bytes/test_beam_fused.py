"""The byte-level beam's fused path (genlm_fast.bytes), on the peaked mock LM: one LM batch,
one kernel launch and one gather per step, no full row ever copied to the host, rows kept in
a pool and shared across beams; beams over LM states that only offer ``logp_next`` and a
default adapter switched during a step agree with genlm-bytes 0.2.0.
"""

from __future__ import annotations

import warnings

import genlm.bytes as ref_bytes
import numpy as np
import pytest

from genlm_fast.bytes import (
    BeamParams,
    ByteBeamState,
    LazyTrieState,
    TrieMode,
    fused_stats,
)
from genlm_fast.bytes.byte_lm import mass_rows
from tests.bytes.beam_support import (
    GPT2_EOS,
    LogpOnlyState,
    PeakedMock,
    RefPeakedMock,
    RefTries,
    compare,
    trajectory,
)


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
