"""The fused materialization of byte-beam states (`materialize_states`).

A state's log-masses (one per trie node) are a function of the LM's next-token distribution
after its context; computing them is "materializing" the state. Every state that needs it in
a step is materialized together: distinct contexts go to the LM in ONE
``batch_next_token_logits`` call, and its rows go to the trie's ``batch_log_mass`` in ONE
kernel launch per trie mode (one mode in a beam). The masses land in the trie's pool, and
the nodes the states read next are fetched in one `gather` (see ``mass_rows``).

Lookahead: a beam step that reads a known byte (``beam << b``) knows which tokens the
hypotheses of the next step could commit. When it calls the LM anyway and the batch stays
small, those contexts ride along; their logits wait (on the device, no kernel run) in the
trie's ``logits_memo`` (see ``trie_info``), so a prefill needs an LM call only every other
byte.
"""

from __future__ import annotations

import asyncio
import weakref

import numpy as np
import torch

from genlm_fast.bytes.byte_lm.mass_rows import as_row, gather
from genlm_fast.bytes.byte_lm.trie_info import model_key

__all__ = ["batchable", "materialize_states"]

# Largest LM batch (rows needed now + rows computed ahead) that may carry lookahead rows.
# Past it, the extra rows (often two new tokens each, which pads every row of the batch to
# two positions) cost more than the LM call they can save: on a CPU a forward pass is
# cheap in its first rows only; on a GPU rows are almost free.
LOOKAHEAD_MAX_BATCH = {"cpu": 16, "cuda": 128}


def _weakly_referable(obj):
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _lookahead_limit(model):
    device = getattr(model, "device", None)
    kind = getattr(device, "type", str(device) if device is not None else "cpu")
    return LOOKAHEAD_MAX_BATCH.get(kind, LOOKAHEAD_MAX_BATCH["cpu"])


async def _next_token_logits(model, contexts):
    """``[B, V']`` scores of each context: logits (up to a constant) when the model offers
    them, else log-probabilities."""
    fn = getattr(model, "batch_next_token_logits", None)
    if fn is None:
        fn = getattr(model, "batch_next_token_logprobs", None)
    if fn is not None:
        out = await fn(contexts)
    else:
        out = torch.stack(await asyncio.gather(*(model.next_token_logprobs(c) for c in contexts)))
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(np.asarray(out))
    if out.dim() == 1:
        out = out.unsqueeze(0)
    if out.dim() != 2 or out.shape[0] != len(contexts):
        raise RuntimeError(
            f"the language model returned scores of shape {tuple(out.shape)} "
            f"for {len(contexts)} contexts"
        )
    return out


async def _materialize_group(states, trie, info, lookahead=()):
    """Materialize states sharing one model and trie: one LM call, one kernel per mode.

    Contexts whose logits were computed ahead (``info.logits_memo``) skip the LM. When the
    LM is called anyway, the ``lookahead`` contexts join its batch and their logits are
    kept for later (no kernel runs on them now).
    """
    model = states[0].lm_state.model
    key_model = model_key(model)
    modes_of = {}  # context -> modes needed, in first-seen order
    todo = []
    for s in states:
        ctx = tuple(s.lm_state.context)
        row = info.memo.get((key_model, s.mode, ctx))
        if row is not None and row.model is model:
            s._mass = row
            info.stats["memo_hits"] += 1
            continue
        modes = modes_of.setdefault(ctx, [])
        if s.mode not in modes:
            modes.append(s.mode)
        todo.append((s, ctx))
    if not todo:
        return
    contexts = list(modes_of)
    rows_of = {}  # context -> logits row
    for ctx in contexts:
        row = info.take_logits(model, ctx)
        if row is not None:
            rows_of[ctx] = row
            info.stats["lookahead_hits"] += 1
    missing = [c for c in contexts if c not in rows_of]
    fresh = None  # the LM's output, when it holds the rows in ``contexts`` order
    remember = True  # whether rows computed now may be reused later (memo, lookahead)
    if missing:
        extra = []
        seen = set(contexts)
        for ctx in lookahead:
            if ctx not in seen and (key_model, ctx) not in info.logits_memo:
                seen.add(ctx)
                extra.append(ctx)
        if extra and (
            len(missing) + len(extra) > _lookahead_limit(model) or not _weakly_referable(model)
        ):
            extra = []  # all or nothing: a partial lookahead rarely saves the next call
        logits = await _next_token_logits(model, [list(c) for c in missing + extra])
        # The default adapter may have changed while the batch was in flight (set_lora /
        # clear_lora / clear_cache from another task): then which one computed these rows
        # is not known, and they must not be remembered under either key.
        remember = model_key(model) == key_model
        info.stats["lm_batches"] += 1
        info.stats["lm_rows"] += len(missing) + len(extra)
        for i, ctx in enumerate(missing):
            rows_of[ctx] = logits[i]
        if len(missing) == len(contexts):
            fresh = logits
        if extra and remember:
            ahead = logits[len(missing) :].clone()  # own storage: the batch can go
            for ctx, row in zip(extra, ahead):
                info.keep_logits(model, ctx, row, key_model)
            info.stats["lookahead_rows"] += len(extra)
    by_mode = {}
    for i, ctx in enumerate(contexts):
        for mode in modes_of[ctx]:
            by_mode.setdefault(mode, []).append(i)
    rows = {}
    for mode, idx in by_mode.items():
        if fresh is not None and len(idx) == len(contexts):
            block = fresh[: len(contexts)]  # no copy
        else:
            block = torch.stack([rows_of[contexts[i]] for i in idx])
        masses = trie.batch_log_mass(block, mode)
        info.stats["kernel_launches"] += 1
        pool = info.pool(masses.device)
        for i, row in zip(idx, pool.store(masses, model)):
            rows[(contexts[i], mode)] = row
            if remember:
                info.memo[(key_model, mode, contexts[i])] = row
    for s, ctx in todo:
        if s._mass is None:
            s._mass = rows[(ctx, s.mode)]
            s.lm_state._n_calls += 1


def batchable(lm_state):
    """Whether ``lm_state`` exposes its model and context (as ``StatefulTokenizedLM`` does)."""
    return hasattr(lm_state, "model") and hasattr(lm_state, "context")


async def _materialize_alone(state):
    """Materialize a state whose LM state offers only ``logp_next()`` (e.g. a test double):
    its log-probabilities go through the fused kernel on their own."""
    logp = await state.lm_state.logp_next()
    logp = logp if isinstance(logp, torch.Tensor) else torch.as_tensor(np.asarray(logp))
    masses = state.trie.trie.batch_log_mass(logp.reshape(1, -1), state.mode)
    state._mass = as_row(masses[0])


async def materialize_states(states, extra=(), after=None, lookahead=()):
    """Materialize ``states`` together and read the nodes each of them needs next.

    The states without masses are grouped by (model, trie); each group costs one LM batch
    (none when every context is already known) and one ``batch_log_mass`` launch. Then every
    state's current node and its children, plus the ``extra`` requests and those returned
    by ``after()`` (called once the states have their masses), are read in one gather.

    Args:
        states (list[LazyTrieState]): states to materialize (already materialized ones
            only get their nodes read).
        extra (iterable): ``(row, nodes)`` read requests for other states.
        after (callable, optional): returns more requests once the masses exist.
        lookahead (iterable): ``(model, context)`` pairs likely to be materialized next;
            if a group calls its LM anyway, they ride along in its batch and their logits
            are kept (a later materialization of those contexts then needs no LM call).
    """
    pending = [s for s in states if s._mass is None]
    for s in [s for s in pending if not batchable(s.lm_state)]:
        await _materialize_alone(s)
    pending = [s for s in pending if s._mass is None]
    if pending:
        groups = {}
        for s in pending:
            inner = s.trie.trie
            groups.setdefault((id(s.lm_state.model), id(inner)), (inner, []))[1].append(s)
        ahead = {}
        for model, ctx in lookahead:
            ahead.setdefault(id(model), []).append(tuple(ctx))
        for (model_id, _), (inner, group) in groups.items():
            await _materialize_group(group, inner, group[0]._info, ahead.get(model_id, ()))
    requests = list(extra)
    requests.extend(s._view_request() for s in states if s._mass is not None)
    if after is not None:
        requests.extend(after())
    gather(requests)
    return states
