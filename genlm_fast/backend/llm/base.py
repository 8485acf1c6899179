"""The `AsyncLM` interface of genlm.backend.

The auto-batching machinery every backend shares is `BatchedAsyncLM` (``batched.py``, with
its queue in ``batcher.py``), the argument checks are in ``checks.py``, and the mock LM is
``mock.py``; this module also offers their names, where genlm.backend's ``llm.base`` has them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

import numpy as np
import torch

from genlm_fast.backend.llm.checks import (
    ModelClosedError,
    QueriesResetError,
    UnknownLoraError,
    check_sampling,
    check_temperature,
    context_list,
)
from genlm_fast.backend.tokenization import decode_vocab

__all__ = [  # noqa: F822 - BatchedAsyncLM and MockAsyncLM come from __getattr__
    "AsyncLM",
    "BatchedAsyncLM",
    "MockAsyncLM",
    "ModelClosedError",
    "QueriesResetError",
    "UnknownLoraError",
]


class AsyncLM(ABC):
    """Asynchronous next-token distributions from a language model.

    Args:
        tokenizer: The Hugging Face tokenizer of the model; its vocabulary is decoded
            into ``byte_vocab`` (bytes of each token) and ``str_vocab``.
    """

    #: Moves whenever calls without ``lora_name`` may start giving other answers (the
    #: default adapter was set, cleared, reloaded or removed; clear_cache()). Whoever keeps
    #: results across calls, such as the byte-level beam, keys them on it.
    state_epoch = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_vocab, self.str_vocab = decode_vocab(self.tokenizer)
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------

    def _check_open(self):
        if getattr(self, "_closed", False):
            raise ModelClosedError(
                f"this {type(self).__name__} was cleaned up (cleanup() or context exit); "
                "create a new model to run more queries"
            )

    def cleanup(self):
        """Release the model and its caches. Any later call raises `ModelClosedError`."""
        self._closed = True

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.cleanup()
        return False

    async def __aenter__(self):
        self._check_open()
        return self

    async def __aexit__(self, exc_type, exc, tb):
        self.cleanup()
        return False

    def clear_cache(self):
        """Forget cached results. Nothing to forget here."""

    # ---- next-token distributions ----------------------------------------------

    @abstractmethod
    async def next_token_logprobs(self, token_ids, lora_name=None):
        """Log probabilities of the token following ``token_ids`` (awaitable).

        Args:
            token_ids (list[int]): The context, at least one token.
            lora_name (str, optional): LoRA adapter to use; None for the default.

        Returns:
            (torch.Tensor): float32 log probabilities, one per vocabulary entry.
        """

    @abstractmethod
    def next_token_logprobs_sync(self, token_ids, lora_name=None):
        """Blocking form of `next_token_logprobs`."""

    async def batch_next_token_logprobs(self, token_ids_list, lora_name=None):
        """`next_token_logprobs` of several contexts, stacked into ``[B, V]``."""
        contexts = context_list(token_ids_list, "batch_next_token_logprobs", allow_empty=False)
        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name=lora_name) for ids in contexts)
        )
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(self, token_ids_list, lora_name=None):
        """Blocking form of `batch_next_token_logprobs`."""
        contexts = context_list(token_ids_list, "batch_next_token_logprobs_sync", allow_empty=False)
        return torch.stack(
            [self.next_token_logprobs_sync(ids, lora_name=lora_name) for ids in contexts]
        )

    async def next_token_logits(self, token_ids, lora_name=None):
        """Unnormalized next-token scores on the model's device (the fused-path hook).

        Any row that differs from the log probabilities by a constant is a valid answer;
        consumers such as a trie's ``batch_log_mass`` normalize it themselves.
        """
        return await self.next_token_logprobs(token_ids, lora_name=lora_name)

    async def batch_next_token_logits(self, token_ids_list, lora_name=None):
        """`next_token_logits` of several contexts, stacked into ``[B, V]``."""
        contexts = context_list(token_ids_list, "batch_next_token_logits", allow_empty=False)
        rows = await asyncio.gather(
            *(self.next_token_logits(ids, lora_name=lora_name) for ids in contexts)
        )
        return torch.stack(rows)

    # ---- LoRA ---------------------------------------------------------------------

    def add_new_lora(self, lora_path, lora_name="lora_1"):
        """Load a LoRA adapter under ``lora_name``."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def remove_lora(self, lora_name):
        """Unload a LoRA adapter."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def set_lora(self, lora_path=None, lora_name="lora_1"):
        """Make a loaded adapter the default for calls that pass no ``lora_name``."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def clear_lora(self):
        """Go back to the base model as the default."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    # ---- sampling ----------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids,
        max_tokens,
        eos_token_ids,
        temperature=1.0,
        seed=None,
        lora_name=None,
    ):
        """Ancestral sampling of up to ``max_tokens`` tokens after the prompt.

        Stops before the first token in ``eos_token_ids`` (which is not returned).
        With a ``seed``, the draws are reproducible (here: from a CPU generator seeded
        with it; vLLM: its sampler's seed).

        Returns:
            (list[int]): The sampled token ids.
        """
        self._check_open()
        args = self._sampling_args(max_tokens, eos_token_ids, temperature, seed)
        return await self._sample(prompt_token_ids, *args, lora_name)

    async def batch_sample(
        self,
        prompt_token_ids_list,
        max_tokens,
        eos_token_ids,
        temperature=1.0,
        seed=None,
        lora_name=None,
    ):
        """`sample` for each prompt (each with the same ``seed``)."""
        # read once: eos_token_ids may be a one-pass iterable
        args = self._sampling_args(max_tokens, eos_token_ids, temperature, seed)
        prompts = context_list(prompt_token_ids_list, "batch_sample")
        return await self._batch_sample(prompts, *args, lora_name)

    def _sampling_args(self, max_tokens, eos_token_ids, temperature, seed):
        """``(max_tokens, eos, temperature, seed)`` checked: an int, the EOS ids as a set,
        a float (`_check_temperature`), an int or None."""
        temperature = self._check_temperature(temperature)
        max_tokens, eos, seed = check_sampling(max_tokens, eos_token_ids, seed)
        return max_tokens, eos, temperature, seed

    def _check_temperature(self, temperature):
        """The temperature as the sampler takes it: here a positive finite float."""
        return check_temperature(temperature)

    async def _sample(self, prompt_token_ids, max_tokens, eos, temperature, seed, lora_name):
        """`sample` on checked arguments: one `next_token_logprobs` call per token."""
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        if isinstance(prompt_token_ids, (torch.Tensor, np.ndarray)):
            context = prompt_token_ids.tolist()  # ints, as next_token_logprobs accepts it
        else:
            context = list(prompt_token_ids)
        out = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context + out, lora_name=lora_name)
            probs = torch.softmax(logprobs / temperature, dim=-1)
            if generator is not None:
                probs = probs.cpu()
            tok = int(torch.multinomial(probs, num_samples=1, generator=generator).item())
            if tok in eos:
                break
            out.append(tok)
        return out

    async def _batch_sample(self, prompts, max_tokens, eos, temperature, seed, lora_name):
        """`batch_sample` on checked arguments: each prompt's `sample`, concurrently."""
        samples = (self.sample(p, max_tokens, eos, temperature, seed, lora_name) for p in prompts)
        return list(await asyncio.gather(*samples))


def __getattr__(name):
    # genlm.backend.llm.base holds the mock too; both build on AsyncLM, so they are
    # looked up on first use rather than imported here (a cycle)
    if name == "BatchedAsyncLM":
        from genlm_fast.backend.llm.batched import BatchedAsyncLM

        return BatchedAsyncLM
    if name == "MockAsyncLM":
        from genlm_fast.backend.llm.mock import MockAsyncLM

        return MockAsyncLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
