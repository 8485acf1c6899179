"""`MockAsyncLM`: a deterministic stand-in LM over a real tokenizer's vocabulary."""

from __future__ import annotations

import numpy as np
import torch

from genlm_fast.backend.llm.batched import BatchedAsyncLM
from genlm_fast.backend.llm.checks import check_token_ids

__all__ = ["MockAsyncLM"]


class MockAsyncLM(BatchedAsyncLM):
    """A deterministic stand-in language model over a real tokenizer's vocabulary.

    The distribution after a context depends only on the context (the same one
    genlm.backend's mock produces): the scores are uniform draws from a NumPy
    ``RandomState`` seeded with ``sum((i + 1) * token_i)``. Requests go through the
    same auto-batcher as the real backends.

    Args:
        tokenizer: Hugging Face tokenizer.
        batch_size (int): See `BatchedAsyncLM`. Defaults to 20.
        timeout (float): See `BatchedAsyncLM`. Defaults to 0.0 (next loop iteration).
        cache_size (int): See `BatchedAsyncLM`. Defaults to 1024.
        flush_when_idle (bool): See `BatchedAsyncLM`. Defaults to True.
    """

    def __init__(
        self, tokenizer, batch_size=20, timeout=0.0, cache_size=1024, flush_when_idle=True
    ):
        super().__init__(
            tokenizer,
            batch_size=batch_size,
            timeout=timeout,
            cache_size=cache_size,
            flush_when_idle=flush_when_idle,
        )

    @classmethod
    def from_name(cls, model_name, **kwargs):
        """Build the mock over the tokenizer of ``model_name`` (``"smollm2"`` works offline)."""
        from transformers import AutoTokenizer

        from genlm_fast.models import resolve_model_name

        return cls(AutoTokenizer.from_pretrained(resolve_model_name(model_name)), **kwargs)

    @staticmethod
    def context_seed(token_ids):
        """The RandomState seed of a context (reduced mod 2**32 when it is larger)."""
        return sum((i + 1) * t for i, t in enumerate(token_ids)) % (2**32)

    def _check_context(self, token_ids):
        """As the real backends, but the empty context is one too (genlm's mock answers
        it: genlm-control's PromptedLLM starts from an empty prompt)."""
        return check_token_ids(token_ids, self._vocab_limit(), allow_empty=True)

    def _scores(self, token_ids):
        rng = np.random.RandomState(self.context_seed(token_ids))
        return torch.from_numpy(rng.rand(len(self.byte_vocab)).astype(np.float32))

    def _forward(self, lora_name, rows):
        return torch.stack([self._scores(ids) for ids in rows])
