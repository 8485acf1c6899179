"""Token-level LM state (a context of token ids) and the byte-level LM interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from genlm_fast.bytes.util import EOS_INDEX, as_index, escape, sample_dict


class StatefulTokenizedLM:
    """An immutable token context over an ``AsyncLM``.

    ``state << token`` returns a new state with one more token; ``await state.logp_next()``
    asks the model for the next-token log-probabilities. (The byte-level beam does not call
    ``logp_next``: it asks the model for the logits of many states at once.)

    Args:
        model (AsyncLM): the token-level model (genlm_fast or genlm.backend).
        context (list[int]): the token ids so far.
        n_calls (int): how many times the model was asked about this lineage.
        max_context_length (int, optional): keep at most this many most recent tokens.
    """

    def __init__(self, model, context, n_calls=0, max_context_length=None):
        if max_context_length is not None and int(max_context_length) < 1:
            raise ValueError(f"max_context_length must be at least 1, got {max_context_length}")
        self.model = model
        self.context = context
        self._n_calls = n_calls
        self.max_context_length = max_context_length

    @classmethod
    def initial(cls, model, initial_context=None, max_context_length=None):
        """The state holding ``initial_context`` (default: the tokenizer's BOS token)."""
        if initial_context is None:
            bos = getattr(model.tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError(
                    "the tokenizer has no BOS token; pass initial_context=[...] explicitly"
                )
            initial_context = [bos]
        return cls(model, list(initial_context), max_context_length=max_context_length)

    def __lshift__(self, token):
        """A new state with ``token`` appended (the oldest tokens dropped past the maximum)."""
        token = as_index(token, "token must be an int token id")
        context = list(self.context) + [token]
        if self.max_context_length is not None and len(context) > self.max_context_length:
            context = context[-self.max_context_length :]
        return StatefulTokenizedLM(
            self.model, context, n_calls=self._n_calls, max_context_length=self.max_context_length
        )

    async def logp_next(self):
        """Next-token log-probabilities of the model after this context."""
        self._n_calls += 1
        return await self.model.next_token_logprobs(self.context)

    def __repr__(self):
        vocab = self.model.byte_vocab
        parts = []
        for t in self.context:
            item = vocab[t]
            parts.append(escape(bytes(getattr(item, "byte_string", item))))
        return "|".join(parts)


class StatefulByteLM(ABC):
    """A byte-level LM state: ``await (state << byte)``, ``await state.logp_next()``."""

    @abstractmethod
    async def __lshift__(self, b: int):
        """The state after one more byte."""

    def prune(self):
        """A smaller equivalent state (subclasses decide what to drop)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prune()")

    @abstractmethod
    async def logp_next(self):
        """``LazyByteProbs`` of the next byte."""

    async def prefill(self, bs):
        """The state after the bytes ``bs``."""
        state = self
        for b in bs:
            state = await (state << b)
        return state

    async def greedy(self, context, steps):
        """``context`` followed by ``steps`` bytes, each the most likely next byte.

        Generation stops early when the most likely continuation is EOS (not included).
        """
        return await self._generate(context, steps, lambda q: q.argmax())

    async def sample(self, context, steps, draw=sample_dict):
        """``context`` followed by up to ``steps`` sampled bytes (stops at EOS).

        Args:
            draw: picks a key from a Chart of probabilities (default: inverse-CDF sampling
                with NumPy's global generator).
        """
        return await self._generate(context, steps, lambda q: draw(q.map_values(np.exp)))

    async def _generate(self, context, steps, choose):
        steps = as_index(steps, "steps must be a non-negative int")
        if steps < 0:
            raise ValueError(f"steps must be non-negative, got {steps}")
        out = list(context)
        state = await self.prefill(out)
        for _ in range(steps):
            q = (await state.logp_next()).materialize()
            b = choose(q)
            if b is None or b == EOS_INDEX:
                break
            state = await (state.prune() << b)
            out.append(b)
        return bytes(out)

    async def cleanup(self):
        """Release resources held by the state (nothing by default)."""
