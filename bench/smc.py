"""The SMC-shaped LM workload of ``bench/test_bench_lm.py`` and ``tools/gpu/lm.py``.

16 particles share a 15-token prompt. Each round, every particle asks
``next_token_logprobs`` for its context concurrently (auto-batched), then grows by one token;
8 rounds. `draw_plan` draws the tokens once, up front (seeded), so that every backend answers
exactly the same queries; `run_cold` replays them on cold caches; `max_error` compares the
answers with `float64_logprobs`.
"""

from __future__ import annotations

import asyncio

import torch

N_PARTICLES = 16
N_ROUNDS = 8
PROMPT = "In a quiet village at the edge of the forest, an old clockmaker"
FLOOR = -20.0  # max_error looks at the tokens with log p above this


def draw_plan(lm):
    """Contexts of every round, drawn once from ``lm``'s distributions (seeded)."""
    prompt = lm.tokenizer.encode(PROMPT)
    gen = torch.Generator().manual_seed(1234)
    particles = [list(prompt) for _ in range(N_PARTICLES)]
    rounds = []
    for _ in range(N_ROUNDS):
        rounds.append([list(p) for p in particles])
        logps = lm.batch_next_token_logprobs_sync(particles)
        for p, row in zip(particles, logps):
            p.append(int(torch.multinomial(row.float().cpu().exp(), 1, generator=gen)))
    lm.clear_cache()
    return rounds


def float64_logprobs(model, plan):
    """Each round's next-token log-probabilities by ``model`` (float64), on the CPU."""
    out = []
    with torch.no_grad():
        for ctxs in plan:  # all contexts of a round have the same length: no padding
            logits = model(torch.tensor(ctxs, device=model.device)).logits[:, -1]
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


async def _replay(lm, plan):
    answers = []
    for ctxs in plan:
        answers.append(await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs)))
    return answers


_loop = None


def run_cold(lm, plan, cache_prompt=False):
    """One timed run: caches emptied, then every round, on one event loop for all runs
    (as a program has one). Not `asyncio.run` per run: on Python 3.11 its exit, restoring
    the SIGINT handler, formats the handler it installed, which holds the main task and so
    the returned rows, into an error message it discards: 10-20 ms a run here, in either
    library's runs."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    lm.clear_cache()
    if cache_prompt:  # the prompt shared by every particle: the first context of round 1
        lm.cache_kv(plan[0][0])
    return _loop.run_until_complete(_replay(lm, plan))


def max_error(answers, reference):
    """The largest |answer - reference| over the tokens with reference log p > FLOOR."""
    worst = 0.0
    for rows, ref in zip(answers, reference):
        got = torch.stack([r.cpu().double() for r in rows])
        keep = ref > FLOOR
        worst = max(worst, (got - ref)[keep].abs().max().item())
    return worst
