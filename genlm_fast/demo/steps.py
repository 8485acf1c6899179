"""The demo's four computations: the next-byte distribution, the prefix probability of a
string (continuations are the beam's own ``greedy`` and ``sample``) and auto-batched
sequential importance sampling."""

from __future__ import annotations

import asyncio
import math

import numpy as np

__all__ = [
    "Particle",
    "importance_sampling",
    "next_byte_distribution",
    "prefix_logprob",
    "sis_prompt_ids",
    "token_mask",
    "top_symbols",
]


async def next_byte_distribution(beam):
    """The 258 next-symbol log-probabilities of a beam, as a float64 array."""
    return np.asarray((await beam.logp_next()).ps, dtype=np.float64)


def top_symbols(logps, n):
    """The ``n`` most likely outcomes, as ``(symbol, probability)``."""
    order = np.argsort(-logps, kind="stable")[:n]
    return [(int(s), float(np.exp(logps[s]))) for s in order if logps[s] > -np.inf]


async def prefix_logprob(beam, data):
    """``log P(next bytes start with data)`` from ``beam``: per-byte log-probs and the beam after.

    The beam is pruned to its width before each byte, as in generation.
    """
    per_byte = []
    for b in data:
        logps = await next_byte_distribution(beam)
        per_byte.append(float(logps[b]))
        if per_byte[-1] == -math.inf:
            break  # probability zero: nothing more to read
        beam = await (beam.prune() << b)
    return per_byte, beam


def token_mask(llm, max_token_length, max_tokens):
    """A function ``context -> additive mask`` over next tokens.

    Tokens longer than ``max_token_length`` bytes are forbidden; once ``max_tokens`` tokens
    were generated, only end-of-sequence is allowed. End-of-sequence is always allowed.
    """
    import torch

    eos_id = llm.tokenizer.eos_token_id
    allowed = torch.tensor([len(tok) <= max_token_length for tok in llm.byte_vocab])
    allowed[eos_id] = True
    free = torch.where(allowed, 0.0, -math.inf)
    only_eos = torch.full((len(llm.byte_vocab),), -math.inf)
    only_eos[eos_id] = 0.0
    cache = {}

    def mask(context, width, device):
        # rows may be wider than the vocabulary (padded embeddings): those ids get -inf
        key = (len(context) >= max_tokens, width, str(device))
        if key not in cache:
            m = only_eos if key[0] else free
            if width > m.numel():
                m = torch.cat([m, torch.full((width - m.numel(),), -math.inf)])
            cache[key] = m[:width].to(device)
        return cache[key]

    return mask


class Particle:
    """A partial generation that grows one token per step and carries an importance weight."""

    def __init__(self, llm, mask, prompt_ids, generator):
        self.llm = llm
        self.mask = mask
        self.prompt_ids = list(prompt_ids)
        self.generator = generator
        self.context = []
        self.log_weight = 0.0
        self.active = True

    async def step(self):
        import torch

        logps = await self.llm.next_token_logprobs(self.prompt_ids + self.context)
        masked = logps + self.mask(self.context, logps.shape[-1], logps.device)
        log_z = torch.logsumexp(masked, dim=-1)
        self.log_weight += float(log_z)  # the weight corrects for sampling from the mask
        probs = (masked - log_z).exp().double().cpu()
        token = int(torch.multinomial(probs, 1, generator=self.generator))
        if token == self.llm.tokenizer.eos_token_id:
            self.active = False
        else:
            self.context.append(token)


async def importance_sampling(llm, prompt_ids, n_particles, mask, seed):
    """Run ``n_particles`` to completion; at each round all active particles step concurrently."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    particles = [Particle(llm, mask, prompt_ids, generator) for _ in range(n_particles)]
    while any(p.active for p in particles):
        await asyncio.gather(*(p.step() for p in particles if p.active))
    return particles


def sis_prompt_ids(llm, prompt):
    """The prompt's token ids, after BOS when the tokenizer has one (as the beam starts)."""
    ids = list(llm.tokenizer.encode(prompt, add_special_tokens=False))
    bos = getattr(llm.tokenizer, "bos_token_id", None)
    if bos is not None:
        ids = [bos] + ids
    elif not ids:
        ids = [llm.tokenizer.eos_token_id]
    return ids
