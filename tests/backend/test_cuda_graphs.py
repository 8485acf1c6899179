"""Decoding steps from fixed-shape buckets (`genlm_fast.backend.llm.graphs`).

On a CPU the buckets run eagerly (``capture=False``): the tests check what the recorded
forward computes (pasts copied into a wider buffer, the new token at the bucket's last
position, the additive mask) against the eager forward of the same rows and against a
float64 forward of the whole context. On a GPU the same tests run through the public
``cuda_graphs=True``, recording and replaying CUDA graphs.

The model is a small Llama (SmolLM2's tokenizer, random weights): in float64 on the CPU,
where the fused decoder leaves it to transformers' forward, in float32 on a GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.backend.llm.checks import NonFiniteLogitsError
from genlm_fast.backend.llm.graphs import (
    CaptureFailed,
    DecodeGraphs,
    GraphsEngine,
    graphs_unsupported,
)
from tests.backend.small_models import ON_GPU, small_model, smc_rounds, tokenizer

__all__ = ["tokenizer"]  # (a fixture)
TOL = 1e-4 if ON_GPU else 1e-10  # bucket vs eager: the rounding of a wider product


def with_buckets(model, tokenizer, length_step=None, max_buckets=None):
    """An AsyncTransformer whose one-token steps run from buckets: recorded as CUDA graphs
    on a GPU, eagerly on a CPU."""
    if ON_GPU:
        lm = AsyncTransformer(model, tokenizer)  # on by default
        assert lm._forwards.graphs is not None and "CUDA graphs" in lm.forward_path
    else:
        lm = AsyncTransformer(model, tokenizer)
        eager = lm._forwards.eager
        buckets = DecodeGraphs(model, eager.keeps_logits, capture=False)
        lm._forwards.graphs = GraphsEngine(buckets, eager)
    if length_step:
        lm._forwards.graphs.buckets.LENGTH_STEP = length_step
    if max_buckets:
        lm._forwards.graphs.buckets.MAX_BUCKETS = max_buckets
    return lm


def count_bucket_runs(lm, monkeypatch):
    """How many batches ran from a bucket (a list, appended to per run)."""
    runs = []
    real = lm._forwards.graphs.buckets.run

    def spy(plans, pad_id):
        done = real(plans, pad_id)
        if done is not None:
            runs.append(len(plans))
        return done

    monkeypatch.setattr(lm._forwards.graphs.buckets, "run", spy)
    return runs


@pytest.mark.parametrize(
    "family, n_particles", [("llama", 1), ("llama", 3), ("llama", 16), ("qwen2", 3), ("gpt2", 3)]
)
def test_bucketed_steps_match_the_eager_forward(tokenizer, monkeypatch, family, n_particles):
    model = small_model(len(tokenizer), family)
    texts = ["The capital of France is", "Once upon a time", "def f(x):\n    return"]
    prompts = [tokenizer.encode(texts[i % 3]) for i in range(n_particles)]
    eager = AsyncTransformer(model, tokenizer, cuda_graphs=False)
    bucketed = with_buckets(model, tokenizer, length_step=8, max_buckets=2)
    runs = count_bucket_runs(bucketed, monkeypatch)
    try:
        want = asyncio.run(smc_rounds(eager, prompts, 12, seed=n_particles))
        got = asyncio.run(smc_rounds(bucketed, prompts, 12, seed=n_particles))
    finally:
        eager.cleanup()
    # 11 rounds after the prompts' own: contexts of up to ~25 tokens cross buckets of 8
    # positions, and 2 buckets at most are kept
    assert len(runs) >= 11, runs
    for round_want, round_got in zip(want, got):
        for (ids_w, row_w), (ids_g, row_g) in zip(round_want, round_got):
            assert ids_w == ids_g
            torch.testing.assert_close(row_g, row_w, atol=TOL, rtol=0)
    # and against a float64 forward of the whole last contexts
    model64 = small_model(len(tokenizer), family).to("cpu", torch.float64)
    for ids, row in got[-1]:
        with torch.no_grad():
            ref = torch.log_softmax(model64(torch.tensor([ids])).logits[0, -1], dim=-1)
        assert (row - ref).abs().max().item() < 1e-3
    bucketed.cleanup()


def test_mixed_batches_run_the_one_token_rows_from_buckets_only(tokenizer, monkeypatch):
    """A batch with a prefill among its steps runs eagerly (it is not a bucket's shape), and
    the next batch of steps from a bucket again."""
    model = small_model(len(tokenizer), seed=1)
    lm = with_buckets(model, tokenizer)
    eager = AsyncTransformer(model, tokenizer, cuda_graphs=False)
    runs = count_bucket_runs(lm, monkeypatch)
    a, b = tokenizer.encode("Hello there"), tokenizer.encode("A longer prompt than the other")

    async def go(m):
        first = await asyncio.gather(m.next_token_logprobs(a), m.next_token_logprobs(b))
        mixed = await asyncio.gather(
            m.next_token_logprobs(a + [5]), m.next_token_logprobs(b + [6, 7, 8])
        )
        steps = await asyncio.gather(
            m.next_token_logprobs(a + [5, 9]), m.next_token_logprobs(b + [6, 7, 8, 9])
        )
        return first + mixed + steps

    try:
        want, got = asyncio.run(go(eager)), asyncio.run(go(lm))
        assert runs == [2]  # the last batch only
        for w, g in zip(want, got):
            torch.testing.assert_close(g.double().cpu(), w.double().cpu(), atol=TOL, rtol=0)
    finally:
        lm.cleanup()
        eager.cleanup()


def test_a_bad_step_raises_and_the_bucket_recovers(tokenizer, monkeypatch):
    """A stored past poisoned with NaN makes a bucket's step raise for its contexts; once
    the stored states are cleared, the next steps from the same bucket (whose buffers held
    the NaN) answer as a forward over the whole context does."""
    model = small_model(len(tokenizer), seed=2)
    lm = with_buckets(model, tokenizer)
    from_bucket = count_bucket_runs(lm, monkeypatch)
    contexts = [tokenizer.encode(t) for t in ("Some prompt", "Another one", "A third")]
    try:
        lm.batch_next_token_logprobs_sync(contexts)
        _, runs = lm._kv_trie(None).match(contexts[1] + [3], len(contexts[1]))
        runs[0][0].data.fill_(float("nan"))
        with pytest.raises(NonFiniteLogitsError):
            lm.batch_next_token_logprobs_sync([c + [3] for c in contexts])
        assert from_bucket == [3]  # the bad step ran from the bucket
        lm.clear_kv_cache()
        lm.batch_next_token_logprobs_sync([c + [3] for c in contexts])  # prefills, eager
        assert from_bucket == [3]
        steps = [c + [3, 4] for c in contexts]
        got = lm.batch_next_token_logprobs_sync(steps)  # steps, from the same bucket
        assert from_bucket == [3, 3]
        for ids, row in zip(steps, got):
            want = lm.next_token_logprobs_uncached(ids).double()
            torch.testing.assert_close(row.double().cpu(), want, atol=max(TOL, 1e-5), rtol=0)
    finally:
        lm.cleanup()


def test_cuda_graphs_option(tokenizer):
    """None (the default) turns them on where they apply; True insists: an error on a CPU
    model, a warning for a model they do not apply to; anything else is a TypeError."""
    model = small_model(len(tokenizer))
    with pytest.raises(TypeError, match="cuda_graphs must be None, True or False"):
        AsyncTransformer(model, tokenizer, cuda_graphs="yes")
    sliding = small_model(len(tokenizer), "qwen2", sliding_window=16, use_sliding_window=True)
    assert "sliding window" in graphs_unsupported(sliding)
    assert graphs_unsupported(model) is None
    assert graphs_unsupported(small_model(len(tokenizer), "qwen2")) is None
    if not ON_GPU:
        with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
            AsyncTransformer(model, tokenizer, cuda_graphs=True)
        lm = AsyncTransformer(model, tokenizer)
        assert lm._forwards.graphs is None and "CUDA graphs" not in lm.forward_path
        lm.cleanup()
        return
    lm = AsyncTransformer(sliding, tokenizer)
    assert lm._forwards.graphs is None  # quietly: it was not asked for
    lm.cleanup()
    with pytest.warns(RuntimeWarning, match="keeps the eager forward"):
        lm = AsyncTransformer(sliding, tokenizer, cuda_graphs=True)
    assert lm._forwards.graphs is None
    lm.cleanup()


def test_a_forward_that_cannot_be_recorded_runs_eagerly(tokenizer, monkeypatch):
    """A model whose forward waits on the host (here its head reads a value back) cannot be
    recorded: one warning, then every step runs eagerly, with the eager answers."""
    model = small_model(len(tokenizer), seed=3)
    eager = AsyncTransformer(model, tokenizer, cuda_graphs=False)
    lm = with_buckets(model, tokenizer)
    if ON_GPU:
        head = model.lm_head.forward

        def syncing_head(x):
            x.sum().item()  # not allowed while a graph is being recorded
            return head(x)

        monkeypatch.setattr(model.lm_head, "forward", syncing_head)
    else:
        lm._forwards.graphs.buckets.capture = True

        def fails(bucket):
            raise CaptureFailed("RuntimeError: operation not permitted when stream is capturing")

        monkeypatch.setattr(lm._forwards.graphs.buckets, "_record", fails)
    ids = tokenizer.encode("A prompt")
    try:
        want = [eager.next_token_logprobs_sync(ids + t) for t in ([], [4], [4, 5])]
        got = [lm.next_token_logprobs_sync(ids)]
        with pytest.warns(RuntimeWarning, match="could not be recorded as a CUDA graph"):
            got.append(lm.next_token_logprobs_sync(ids + [4]))
        assert lm._forwards.graphs is None and "CUDA graphs" not in lm.forward_path
        got.append(lm.next_token_logprobs_sync(ids + [4, 5]))
        for w, g in zip(want, got):
            torch.testing.assert_close(g.double().cpu(), w.double().cpu(), atol=TOL, rtol=0)
    finally:
        lm.cleanup()
        eager.cleanup()


def test_buckets_are_powers_of_two_by_whole_steps():
    graphs = DecodeGraphs(model=None, keeps_logits=True, capture=False)
    step = graphs.LENGTH_STEP
    assert graphs.bucket_shape(1, 1) == (1, step)
    assert graphs.bucket_shape(3, step - 1) == (4, step)
    assert graphs.bucket_shape(16, step) == (16, 2 * step)
    assert graphs.bucket_shape(17, 5 * step + 3) == (32, 6 * step)


def test_buckets_hold_to_their_byte_budget(tokenizer, monkeypatch):
    """The buckets' key/value buffers stay within MAX_BYTES together (the least recently used
    go first), and a batch whose bucket alone is larger runs eagerly, with the eager
    answers."""
    model = small_model(len(tokenizer), seed=4)
    lm = with_buckets(model, tokenizer, length_step=8)
    eager = AsyncTransformer(model, tokenizer, cuda_graphs=False)
    runs = count_bucket_runs(lm, monkeypatch)
    position = lm.kv_bytes_per_token  # one row, one position
    # room for a bucket of 2 rows x 8 positions, not for one of 1 x 8 beside it
    lm._forwards.graphs.buckets.MAX_BYTES = (2 * 8 + 1) * position
    a, b = tokenizer.encode("One prompt"), tokenizer.encode("A second prompt")
    assert max(len(a), len(b)) < 6
    longer = [a + [7] * 12, b + [7] * 12]  # pasts of 13-17 positions: 2 x 24 is too large
    batches = [[a + [5], b + [5]], [a + [5, 6]], [x + [1] for x in longer]]
    try:
        got, want = [], []
        for m, answers in ((lm, got), (eager, want)):
            m.batch_next_token_logprobs_sync([a, b])
            answers += m.batch_next_token_logprobs_sync(batches[0])
            answers += m.batch_next_token_logprobs_sync(batches[1])
            if m is lm:
                assert runs == [2, 1]
                buckets = lm._forwards.graphs.buckets
                assert [key[:2] for key in buckets._buckets] == [(1, 8)]  # rows, length
                assert buckets.nbytes() == 8 * position <= buckets.MAX_BYTES
            m.batch_next_token_logprobs_sync(longer)  # prefills
            answers += m.batch_next_token_logprobs_sync(batches[2])
        assert runs == [2, 1]  # the last batch ran eagerly
        assert lm._forwards.graphs.buckets.nbytes() <= lm._forwards.graphs.buckets.MAX_BYTES
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double().cpu(), w.double().cpu(), atol=TOL, rtol=0)
    finally:
        lm.cleanup()
        eager.cleanup()
