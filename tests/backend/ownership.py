"""A check shared by the LM backend tests: every caller owns the tensor it gets."""

import asyncio

import torch


def _same(x, y):
    return torch.allclose(x.cpu().float(), y.cpu().float(), atol=1e-4, rtol=0)


async def check_callers_own_their_rows(lm, ctx):
    """Editing a returned row in place (``logps[mask] = -inf``) changes neither the output
    cache nor another caller's row of the same context, on every path a row comes out of:
    a batch shared by identical requests, a cache hit, the synchronous calls, logits."""
    lm.clear_cache()
    first, second = await asyncio.gather(lm.next_token_logprobs(ctx), lm.next_token_logprobs(ctx))
    want = first.clone()
    first.fill_(0.0)
    assert _same(second, want), "a caller's edit reached another caller of the same batch"
    second[:5] = float("-inf")
    hit = await lm.next_token_logprobs(ctx)
    assert _same(hit, want), "a caller's edit reached the output cache"
    hit.zero_()
    synced = lm.next_token_logprobs_sync(ctx)
    assert _same(synced, want), "an edit of a cache hit reached the cache"
    synced.zero_()
    logits = await lm.next_token_logits(ctx)  # a hit: the cached row moved to the device
    assert _same(torch.log_softmax(logits.float(), -1), want)
    logits.zero_()
    assert _same(await lm.next_token_logprobs(ctx), want)

    lm.clear_cache()
    fresh = lm.next_token_logprobs_sync(ctx)  # a miss, evaluated synchronously
    fresh.zero_()
    assert _same(await lm.next_token_logprobs(ctx), want)

    lm.clear_cache()
    x, y = await asyncio.gather(lm.next_token_logits(ctx), lm.next_token_logits(ctx))
    x.zero_()
    assert _same(torch.log_softmax(y.float(), -1), want)
