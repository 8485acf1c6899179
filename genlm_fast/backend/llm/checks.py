"""Argument checks shared by the LM backends, and the errors they raise.

Each check turns what a caller may pass (lists, tuples, numpy arrays, integer tensors,
0-d tensors, one-pass iterables) into plain Python values, or raises an error that names
the argument and what was wrong with it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np
import torch

__all__ = [
    "ModelClosedError",
    "NonFiniteLogitsError",
    "QueriesResetError",
    "UnknownLoraError",
    "check_byte_budget",
    "check_finite_logits",
    "check_sampling",
    "check_temperature",
    "check_token_ids",
    "context_list",
    "learned_position_limit",
    "unknown_lora",
]


def context_list(token_ids_list, method: str, allow_empty: bool = True) -> list:
    """A batch call's contexts as a list (each one checked later, by ``check_token_ids``);
    ``allow_empty=False`` for the calls that stack one row per context (no rows, no width)."""
    if token_ids_list is not None and not isinstance(token_ids_list, (str, bytes, bytearray)):
        try:
            contexts = list(token_ids_list)
        except TypeError:  # not iterable
            pass
        else:
            if not contexts and not allow_empty:
                raise ValueError(f"{method} needs at least one context, got an empty list")
            return contexts
    raise TypeError(
        f"{method} expects a list of token_ids contexts, got {type(token_ids_list).__name__}"
    )


def check_temperature(temperature) -> float:
    """A sampling temperature: a positive finite number (0 would divide by zero, a negative
    one would invert the distribution). A zero-dimensional tensor or array counts as its
    number."""
    if isinstance(temperature, (torch.Tensor, np.ndarray)) and temperature.ndim == 0:
        temperature = temperature.item()
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 < float(temperature) < float("inf")
    ):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return float(temperature)


def check_sampling(max_tokens, eos_token_ids, seed):
    """`sample`'s other arguments, checked: (max_tokens as an int, the EOS ids as a set,
    seed as an int or None), or a clear error naming the argument."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise TypeError(f"max_tokens must be an int, got {max_tokens!r}")
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(
        eos_token_ids, (Iterable, torch.Tensor, np.ndarray)
    ):
        raise TypeError(
            "eos_token_ids must be a collection of token ids (possibly empty), "
            f"got {eos_token_ids!r}"
        )
    eos = set()
    for t in (
        eos_token_ids.tolist()
        if isinstance(eos_token_ids, (torch.Tensor, np.ndarray))
        else eos_token_ids
    ):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"eos_token_ids must hold ints, found {t!r}")
        eos.add(int(t))
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if not -(2**63) <= int(seed) < 2**64:
            raise ValueError(f"seed must lie in [-2**63, 2**64), got {seed}")
        seed = int(seed)
    return int(max_tokens), eos, seed


class ModelClosedError(RuntimeError):
    """The model was used after `AsyncLM.cleanup` released it."""


class QueriesResetError(RuntimeError):
    """A waiting query was dropped, by `reset_async_queries` or by `cleanup`."""


class NonFiniteLogitsError(FloatingPointError):
    """The model's logits for a context hold a NaN or +inf (or are all -inf): its weights or
    activations are not finite, and no log-probabilities can be computed from them."""


def check_finite_logits(logits, contexts):
    """Raise `NonFiniteLogitsError` naming the first context whose row of ``logits`` [B, V]
    holds a NaN or +inf, or only -inf (a -inf logit alone is a token of probability 0)."""
    # the sum is finite when every logit is (a NaN or inf makes it NaN or inf); it costs a
    # twentieth of isfinite().all() on [16, 49152], and a finite-but-overflowing sum only
    # sends the check to the exact test below
    if bool(torch.isfinite(logits.sum())):
        return
    bad = torch.isnan(logits).any(1) | torch.isposinf(logits).any(1) | torch.isneginf(logits).all(1)
    rows = bad.nonzero().flatten().tolist()
    if not rows:
        return
    ctx = contexts[rows[0]]
    raise NonFiniteLogitsError(
        f"the model's logits are not finite (NaN or inf) for {len(rows)} of {len(contexts)} "
        f"contexts, the first of {len(ctx)} tokens ending in {list(ctx[-5:])}: its weights or "
        "activations overflowed or hold NaN; no log-probabilities were returned for this batch"
    )


class UnknownLoraError(ValueError):
    """A LoRA adapter name that was never loaded (or was removed)."""


def unknown_lora(name):
    return UnknownLoraError(
        f"unknown LoRA adapter {name!r}: load it first with add_new_lora(path, {name!r})"
    )


def _is_integer_dtype(dtype) -> bool:
    """An integer dtype of torch or numpy (bool is not one)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return np.issubdtype(dtype, np.integer)


def check_token_ids(token_ids, vocab_size=None, allow_empty=False):
    """Validate a context and return it as a tuple of Python ints.

    Accepts any 1-D sequence of integers (list, tuple, numpy array, integer tensor), whose
    items may also be numpy integers or 0-d integer tensors (``ctx + [logps.argmax()]``).

    Raises:
        TypeError: ``token_ids`` is not a sequence of integers.
        ValueError: it is empty (unless ``allow_empty``), or holds an id outside
            ``[0, vocab_size)``.
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}; "
            "tokenize text first (tokenizer.encode)"
        )
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        if token_ids.ndim != 1:
            raise TypeError(
                f"token_ids must be one-dimensional, got shape {tuple(token_ids.shape)}"
            )
        if not _is_integer_dtype(token_ids.dtype):
            raise TypeError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        ids = tuple(int(t) for t in token_ids.tolist())
    else:
        try:
            items = list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            ) from None
        for t in items:
            if type(t) is int:
                continue
            if isinstance(t, (torch.Tensor, np.ndarray)):
                if t.ndim == 0 and _is_integer_dtype(t.dtype):
                    continue
            elif not isinstance(t, bool) and isinstance(t, numbers.Integral):
                continue
            raise TypeError(
                f"token_ids must be a sequence of ints; found {t!r} ({type(t).__name__})"
            )
        ids = tuple(int(t) for t in items)
    if not ids and not allow_empty:
        raise ValueError("Token ids must not be empty")
    if vocab_size is not None and ids:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def check_byte_budget(value):
    """``kv_cache_bytes`` checked: None, or a whole number of bytes >= 0."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 <= float(value) < float("inf")
        or float(value) != int(value)
    ):
        raise ValueError(
            f"kv_cache_bytes must be None or a whole number of bytes >= 0, got {value!r}"
        )
    return int(value)


def learned_position_limit(model):
    """How many positions a model with a learned position embedding (GPT-2's ``wpe``, OPT's
    ``embed_positions``) has, or None for a model without one (rotary, ALiBi)."""
    config = getattr(model, "config", None)
    names = ("wpe", "embed_positions", "position_embeddings")
    if not any(
        name.rsplit(".", 1)[-1] in names and isinstance(module, torch.nn.Embedding)
        for name, module in model.named_modules()
    ):
        return None
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None
