"""Many concurrent requests to one AsyncTransformer on the real SmolLM2-135M-Instruct.

500 requests at once (``next_token_logprobs`` and ``sample``, with shared prefixes and
duplicates), a quarter of the good ones cancelled at random moments, and malformed ones
among them. Every request that is not cancelled gets the answer it gets alone (a lone
request on a model sharing the weights, with no cache: a full forward of its context alone;
bit for bit on the fused decoder, which is row- and batch-invariant; within float32
rounding, 1e-4, on transformers' forward, whose padded batches round otherwise), every
cancelled one its CancelledError (or its answer, if that came first), every malformed one
the error naming its problem; and nothing is left queued or running afterwards. Half the
cancelled requests are cancelled before they first run (those must raise CancelledError,
whatever the machine's speed), half at random moments (queued, mid-sample, or done).
"""

import asyncio
import random

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer, UnknownLoraError
from genlm_fast.models import smollm2_path

# 500 requests and their lone answers through the real model: longer than most tests
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

N_LOGPROBS = 300
N_SAMPLES = 150
N_BAD = 50
CANCEL_SHARE = 0.25
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n <",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def lm():
    model = AsyncTransformer.from_name(smollm2_path())
    yield model
    model.cleanup()


def _requests(lm, rng):
    """[(kind, args, expected error or None)]: the good requests and the malformed ones."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    vocab = lm.model.config.vocab_size
    eos = [lm.tokenizer.eos_token_id]

    def context():
        base = rng.choice(prompts)
        return base[: rng.randint(1, len(base))] + [
            rng.randrange(1000, 40000) for _ in range(rng.randint(0, 12))
        ]

    good = []
    for _ in range(N_LOGPROBS):
        ctx = context() if not good or rng.random() > 0.1 else list(rng.choice(good)[1][0])
        good.append(("logprobs", (ctx,), None))
    for _ in range(N_SAMPLES):
        good.append(
            (
                "sample",
                (context(), rng.randint(1, 4), eos, rng.choice([1.0, 0.7]), rng.randrange(2**32)),
                None,
            )
        )
    ctx = prompts[0]
    bad_kinds = [
        ("logprobs", ([],), (ValueError, "must not be empty")),
        ("logprobs", (ctx + [vocab],), (ValueError, "outside the model's vocabulary")),
        ("logprobs", ([-1] + ctx,), (ValueError, "outside the model's vocabulary")),
        ("logprobs", ("some text",), (TypeError, "tokenize text first")),
        ("logprobs", (ctx + [1.5],), (TypeError, "sequence of ints")),
        ("lora", (ctx,), (UnknownLoraError, "unknown LoRA adapter")),
        ("sample", (ctx, "3", eos, 1.0, 0), (TypeError, "max_tokens must be an int")),
        ("sample", (ctx, 2, eos, 0.0, 0), (ValueError, "temperature must be a positive")),
        ("sample", (ctx, 2, eos, 1.0, -(2**70)), (ValueError, "seed must lie")),
        ("sample", ([vocab + 5], 2, eos, 1.0, 0), (ValueError, "outside the model's vocabulary")),
    ]
    bad = [bad_kinds[i % len(bad_kinds)] for i in range(N_BAD)]
    return good, bad


async def _ask(lm, kind, args):
    if kind == "logprobs":
        return await lm.next_token_logprobs(*args)
    if kind == "lora":
        return await lm.next_token_logprobs(*args, lora_name="no-such-adapter")
    prompt, max_tokens, eos, temperature, seed = args
    return await lm.sample(prompt, max_tokens, eos, temperature=temperature, seed=seed)


async def _alone(lm, requests):
    """Each good request's answer alone: a model on the same weights without caches, one
    request at a time."""
    lone = AsyncTransformer(lm.model, lm.tokenizer, cache_size=0, kv_cache_tokens=0)
    answers = [await _ask(lone, kind, args) for kind, args, _ in requests]
    lone.cleanup()
    return answers


@pytest.mark.asyncio
async def test_many_concurrent_requests_with_cancellations_and_bad_ones(lm):
    rng = random.Random(44)
    good, bad = _requests(lm, rng)
    requests = good + bad
    order = list(range(len(requests)))
    rng.shuffle(order)
    assert len(requests) == 500
    lm.clear_cache()
    loop = asyncio.get_running_loop()
    tasks = {}
    for i in order:
        kind, args, _ = requests[i]
        tasks[i] = asyncio.create_task(_ask(lm, kind, args))
    victims = rng.sample(range(len(good)), int(CANCEL_SHARE * len(good)))
    early = set(victims[::2])
    for i in victims:
        if i in early:  # before the task first runs: it must end cancelled
            tasks[i].cancel()
        else:  # at random moments: while queued, mid-sample, or after its answer
            loop.call_later(rng.uniform(0.0, 1.0), tasks[i].cancel)
    victims = set(victims)
    results = dict(zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True)))

    # nothing left behind: no queued row, no wakeup, no task
    assert lm._pending == {} and lm._queued == 0
    assert lm._timer is None and lm._idle_probe is None
    assert asyncio.all_tasks() == {asyncio.current_task()}

    answers = await _alone(lm, good)
    # the fused decoder answers bit for bit whatever the batch; transformers' forward within
    # float32 rounding
    atol = 0.0 if lm.forward_path == "fused" else 1e-4
    cancelled = 0
    for i, (kind, _args, _) in enumerate(good):
        got = results[i]
        if isinstance(got, asyncio.CancelledError):
            assert i in victims, f"request {i} ({kind}) was cancelled, nobody cancelled it"
            cancelled += 1
            continue
        assert not isinstance(got, BaseException), f"request {i} ({kind}) failed: {got!r}"
        if kind == "logprobs":
            torch.testing.assert_close(got, answers[i], rtol=0, atol=atol)
        else:
            assert got == answers[i], f"sample {i}: {got} alone {answers[i]}"
    for i in early:
        assert isinstance(results[i], asyncio.CancelledError), f"request {i}: {results[i]!r}"
    assert cancelled >= len(early)
    for j, (kind, args, (error, words)) in enumerate(bad):
        got = results[len(good) + j]
        assert isinstance(got, error) and words in str(got), (kind, args, got)

    # and the model still answers, as it would alone
    ctx = good[0][1][0]
    lm.clear_cache()
    torch.testing.assert_close(await lm.next_token_logprobs(ctx), answers[0], rtol=0, atol=atol)
