"""The basics of the LM backends, driven by MockAsyncLM: genlm's mock and genlm-control
over it give the same rows and draws, every context form, logits and the output cache,
callers owning their rows, the blocking batch form.

The mock runs through exactly the batcher and caches AsyncTransformer uses; every row
is checked against an independent computation of the mock's distribution
(tests/backend/llm_mock_support.py)."""

import numpy as np
import pytest
import torch

from tests.backend.llm_mock_support import decode_once as decode_once  # autouse
from tests.backend.llm_mock_support import expected, make
from tests.backend.llm_mock_support import tokenizer as tokenizer  # a fixture
from tests.backend.llm_mock_support import vocab_size as vocab_size  # a fixture
from tests.backend.ownership import check_callers_own_their_rows

# the vocabulary is decoded once per tokenizer: the tests build many fresh models


def test_matches_genlm_mock(tokenizer, vocab_size):
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    assert len(ours.byte_vocab) == len(theirs.byte_vocab)
    assert ours.str_vocab == theirs.str_vocab
    assert [bytes(t) for t in ours.byte_vocab] == [bytes(t) for t in theirs.byte_vocab]
    for ctx in ([], [1], [5, 6, 7], [50000, 3, 17, 256]):  # genlm's mock answers [] too
        a = ours.next_token_logprobs_sync(ctx)
        assert a.dtype == torch.float32 and a.shape == (vocab_size,)
        torch.testing.assert_close(a, theirs.next_token_logprobs_sync(ctx), rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_genlm_control_over_the_mock(tokenizer):
    """genlm-control's PromptedLLM starts from an empty prompt: over our mock it gives
    what it gives over genlm's."""
    import genlm.backend.llm as genlm_llm
    from genlm.control import PromptedLLM

    ours, theirs = PromptedLLM(make(tokenizer)), PromptedLLM(genlm_llm.MockAsyncLM(tokenizer))
    context = [ours.vocab[100], ours.vocab[200]]
    assert await ours.prefix(context) == pytest.approx(await theirs.prefix(context), abs=1e-5)
    a, b = await ours.logw_next([]), await theirs.logw_next([])
    np.testing.assert_allclose(a.weights, b.weights, rtol=0, atol=1e-5)


@pytest.mark.asyncio
async def test_sample_matches_genlm(tokenizer):
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    prompts = [[10, 20, 30], [7], [400, 401]]
    a = await ours.batch_sample(prompts, max_tokens=6, eos_token_ids=[50256], seed=3)
    b = await theirs.batch_sample(prompts, max_tokens=6, eos_token_ids=[50256], seed=3)
    assert a == b
    want = await theirs.sample([10, 20, 30], 6, [50256], temperature=0.5, seed=9)
    # genlm takes any number torch can divide by, a zero-dimensional tensor included
    for t in (0.5, np.float64(0.5), torch.tensor(0.5), np.array(0.5)):
        assert await ours.sample([10, 20, 30], 6, [50256], temperature=t, seed=9) == want
    # an EOS draw stops sampling and is not returned
    first = a[0][0]
    assert await ours.sample([10, 20, 30], 6, [first], seed=3) == []


@pytest.mark.asyncio
async def test_sample_accepts_every_context_form(tokenizer):
    """next_token_logprobs accepts a context as a torch tensor or numpy array; so do sample
    and batch_sample (a tensor is one context, not a list of 0-d tensors). The draws
    are genlm's on the same context as a list."""
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.MockAsyncLM(tokenizer)
    ours = make(tokenizer)
    prompt = [10, 20, 30]
    want = await theirs.sample(prompt, 5, [50256], seed=4)
    forms = [
        torch.tensor(prompt),
        torch.tensor(prompt, dtype=torch.int32),
        np.array(prompt),
        tuple(prompt),
    ]
    for form in forms:
        assert await ours.sample(form, 5, [50256], seed=4) == want
    assert await ours.batch_sample(forms, 5, [50256], seed=4) == [want] * len(forms)


@pytest.mark.asyncio
async def test_logits_hook(tokenizer, vocab_size):
    lm = make(tokenizer)
    ctxs = [[1, 2], [3], [1, 2]]
    logits = await lm.batch_next_token_logits(ctxs)
    assert logits.shape == (3, vocab_size) and logits.device == lm.device
    for ctx, row in zip(ctxs, logits):
        torch.testing.assert_close(torch.log_softmax(row, -1), expected(ctx, vocab_size))
    # a cached context answers with its log-probabilities (same up to a constant)
    await lm.next_token_logprobs([9, 9])
    row = await lm.next_token_logits([9, 9])
    torch.testing.assert_close(torch.log_softmax(row, -1), expected([9, 9], vocab_size))
    assert lm.stats["rows"] == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("cache_size", [0, 16])
async def test_logits_calls_fill_the_output_cache(tokenizer, vocab_size, cache_size):
    """A context first asked for its logits is not run again when asked again, through
    either method (unless the cache is off), and gets the same row either way."""
    lm = make(tokenizer, cache_size=cache_size)
    for ctx in ([4, 5], [6]):
        first = await lm.next_token_logits(ctx)
        again = await lm.next_token_logits(ctx)
        logprobs = await lm.next_token_logprobs(ctx)
        # computed or found in the cache, a context's row is the same bit for bit
        assert torch.equal(first, again)
        if cache_size:
            assert torch.equal(first.cpu(), logprobs)
        torch.testing.assert_close(torch.log_softmax(first, -1), expected(ctx, vocab_size))
        torch.testing.assert_close(torch.log_softmax(again, -1), expected(ctx, vocab_size))
        torch.testing.assert_close(logprobs, expected(ctx, vocab_size))
    sync = lm.batch_next_token_logprobs_sync([[4, 5], [6]])
    torch.testing.assert_close(sync[1], expected([6], vocab_size))
    assert lm.stats["rows"] == (2 if cache_size else 8)


@pytest.mark.asyncio
async def test_callers_own_their_rows(tokenizer, vocab_size):
    lm = make(tokenizer)
    await check_callers_own_their_rows(lm, [5, 6, 7])
    assert torch.equal(await lm.next_token_logprobs([5, 6, 7]), expected([5, 6, 7], vocab_size))


def test_sync_batch(tokenizer, vocab_size):
    lm = make(tokenizer, batch_size=4)
    ctxs = [[i, i + 1] for i in range(10)] + [[0, 1]]
    out = lm.batch_next_token_logprobs_sync(ctxs)
    assert out.shape == (11, vocab_size)
    for ctx, row in zip(ctxs, out):
        torch.testing.assert_close(row, expected(ctx, vocab_size))
    assert lm.stats["rows"] == 10 and lm.stats["batches"] == 3
    out2 = lm.batch_next_token_logprobs_sync(ctxs)  # all from the output cache
    assert lm.stats["rows"] == 10
    torch.testing.assert_close(out, out2)
