"""genlm.bytes' ``TokenByteTrie`` / ``AsyncTokenByteTrie`` on the fused kernels."""

from __future__ import annotations

import warnings
from enum import Enum

import numpy as np
import torch

from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie.async_impl import AsyncTrieFrontEnd
from genlm_fast.trie_core import (
    CompiledTrie,
    as_vocabulary,
    is_leaf_key,
    one_row,
    token_fields,
    trie_device,
)

EOS = 257  # the edge key of the EOS node under the root


class TrieMode(Enum):
    """How EOS tokens count: as ordinary tokens, or only towards the EOS node (and root)."""

    WITHOUT_EOS = "without_eos"
    WITH_EOS = "with_eos"


class TrieOp(Enum):
    SUM = "sum"
    MAX = "max"


def as_mode(mode) -> TrieMode:
    """``None`` -> WITHOUT_EOS; accepts the enum, its string value, or genlm.bytes' own
    TrieMode (genlm modules imported before genlm_fast.dropin)."""
    if mode is None:
        return TrieMode.WITHOUT_EOS
    if isinstance(mode, TrieMode):
        return mode
    if isinstance(mode, Enum):
        mode = mode.value
    try:
        return TrieMode(mode)
    except ValueError:
        raise ValueError(
            f"unknown trie mode {mode!r}; expected one of "
            f"{[m.value for m in TrieMode]} or a TrieMode"
        ) from None


def _renamed(new_value, old_value, new, old):
    if old_value is not None:
        if new_value is not None:
            raise TypeError(f"pass either {new}= or its older name {old}=, not both")
        return old_value
    return new_value


class TokenByteTrie(CompiledTrie):
    """A byte trie over a ``Token`` vocabulary with an EOS node under the root (key 257).

    Args:
        decode: ``Token`` objects (``decode_vocab``; genlm's ``Token`` too); plain bytes are
            accepted (deprecated).
        device: "cpu", "cuda" or None (cuda when available): where the trie's arrays and
            its weight_sum / weight_max results live (log_mass results stay on the logits'
            device).
        atomic_byte_strings (alias ``atomic_tokens``): byte strings kept as one edge.
        eot_sentinel (alias ``eot_token``): first element of leaf edge keys in ``children``
            (any hashable object; the trie keeps the caller's own, never a copy).
        eos_byte_strings (alias ``eos_tokens``): tokens whose mass goes to the EOS node
            in ``TrieMode.WITH_EOS``.
        max_batch_size: accepted for compatibility (the kernels need no chunking).
        kernel_backend: "auto", "reference", "cpu", "cuda" or "triton".
    """

    def __init__(
        self,
        decode,
        device=None,
        atomic_byte_strings=None,
        eot_sentinel=None,
        eos_byte_strings=None,
        max_batch_size=64,
        *,
        atomic_tokens=None,
        eot_token=None,
        eos_tokens=None,
        kernel_backend="auto",
        cache=True,
        cache_dir=None,
    ):
        atomic_byte_strings = _renamed(
            atomic_byte_strings, atomic_tokens, "atomic_byte_strings", "atomic_tokens"
        )
        eot_sentinel = _renamed(eot_sentinel, eot_token, "eot_sentinel", "eot_token")
        eos_byte_strings = _renamed(eos_byte_strings, eos_tokens, "eos_byte_strings", "eos_tokens")
        decode = as_vocabulary(decode)
        if decode is None or len(decode) == 0:
            raise ValueError("decode cannot be empty: a trie needs at least one token")
        if isinstance(decode[0], bytes) and token_fields(decode[0]) is None:
            warnings.warn(
                "Passing plain bytes to TokenByteTrie is deprecated; use Token "
                "objects from decode_vocab() instead.",
                DeprecationWarning,
                stacklevel=2,
            )
            decode = [Token(i, b) for i, b in enumerate(decode)]
        fields = [token_fields(token) for token in decode]  # (bytes, token_id), genlm's Token too
        for i, token in enumerate(decode):
            if fields[i] is None:
                raise TypeError(
                    f"decode must contain Token objects (see decode_vocab()); item "
                    f"{i} is a {type(token).__name__}"
                )
        try:
            hash(eot_sentinel)
        except TypeError:
            raise TypeError(
                f"eot_sentinel keys the leaf edges, so it must be hashable; got a "
                f"{type(eot_sentinel).__name__}"
            ) from None
        self.device = trie_device(device)
        self.decode = decode
        self.max_batch_size = max_batch_size
        self.kernel_backend = kernel_backend
        self._byte_decode = [bs for bs, _ in fields]
        self.eot_sentinel = eot_sentinel
        self.eos_byte_strings = set(eos_byte_strings or [])
        atomic = set(atomic_byte_strings or [])
        vocab_bytes = set(self._byte_decode)
        for bs in atomic:
            if bs not in vocab_bytes:
                raise ValueError(f"Atomic byte string {bs!r} not in vocabulary")
        for bs in self.eos_byte_strings:
            if bs not in vocab_bytes:
                raise ValueError(f"EOS byte string {bs!r} not in vocabulary")
        token_ids = [tid for _, tid in fields]
        self.eos_token_ids = [tid for bs, tid in fields if bs in self.eos_byte_strings]

        first_of = {}
        for i, tid in enumerate(token_ids):
            if tid < 0:
                raise ValueError(
                    f"decode item {i} ({decode[i]!r}) has a negative token_id "
                    f"{tid}: token ids index the weight rows"
                )
            if tid in first_of:
                raise ValueError(
                    f"decode items {first_of[tid]} and {i} are two Tokens with "
                    f"the same token_id {tid}"
                )
            first_of[tid] = i
        words = [[bs] if bs in atomic else bs for bs in self._byte_decode]
        # the layout keys leaf edges (None, token_id), whatever the sentinel: it is neither
        # pickled into the disk cache nor read back from it (``children`` puts it in)
        leaf_keys = [(None, tid) for tid in token_ids]
        eos_positions = [i for i, bs in enumerate(self._byte_decode) if bs in self.eos_byte_strings]
        self._compile(
            words,
            leaf_keys,
            np.asarray(token_ids),
            eos_key=EOS,
            eos_positions=eos_positions,
            cache_key=(
                "byte",
                self._byte_decode,
                token_ids,
                sorted(atomic),
                sorted(self.eos_byte_strings),
            ),
            cache=cache,
            cache_dir=cache_dir,
        )
        self.eos_node = self._layout.eos_node
        leaf_node = self._layout.leaf_node
        self.word2leaf = {
            (bs, tid): int(leaf) for bs, tid, leaf in zip(self._byte_decode, token_ids, leaf_node)
        }
        self.lookup = {(bs, tid): tid for bs, tid in zip(self._byte_decode, token_ids)}
        self.token_id_to_leaf = np.stack(
            [np.asarray(token_ids, dtype=np.int32), leaf_node.astype(np.int32)], axis=1
        )
        self.leaf2token_id = dict(zip(leaf_node.tolist(), token_ids))
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)

    def _public_key(self, key):
        return (self.eot_sentinel, key[1]) if is_leaf_key(key) else key

    def _edge_letters(self, key) -> list:
        if isinstance(key, bytes):  # an atomic byte string: its bytes
            return list(key)
        return [key]

    def _mode_name(self, mode) -> str:
        return as_mode(mode).value

    # ---------------------------------------------------------------- weights

    def weight_sum(self, ws, mode=None):
        """Per-node sum of token weights ``[V]`` -> ``[N]`` (a tensor on the trie's device)."""
        return self.batch_weight_sum(one_row(ws), mode=mode)[0]

    def batch_weight_sum(self, ws, mode=None):
        """``[B, V]`` (or a list of ``[V]``) -> ``[B, N]`` tensor on the trie's device."""
        return self._reduce(
            ws, "sum", self._mode_name(mode), device=self.device, dtype=torch.float32
        )

    def weight_max(self, ws):
        """Per-node max of token weights ``[V]`` -> ``[N]``."""
        return self.batch_weight_max(one_row(ws))[0]

    def batch_weight_max(self, ws):
        return self._reduce(ws, "max", "without_eos", device=self.device, dtype=torch.float32)


class AsyncTokenByteTrie(AsyncTrieFrontEnd):
    """Auto-batching wrapper around ``TokenByteTrie``: concurrent requests are grouped by
    (operation, mode) and each group is answered by one kernel launch."""

    @classmethod
    def from_vocab(cls, vocab, **kwargs):
        return cls(TokenByteTrie(decode=vocab, **kwargs))

    def _run_batch(self, op, mode, rows):
        if op == "sum":
            return self.trie.batch_weight_sum(rows, mode=mode)
        if op == "max":
            return self.trie.batch_weight_max(rows)
        return self.trie.batch_log_mass(torch.stack(rows), mode=mode)

    def _queue_request(self, ws, mode, op):
        """genlm's low-level entry: queue ``ws`` for ``op`` in ``mode``; returns the future."""
        return self._submit(op, as_mode(mode), ws)

    async def weight_sum(self, ws, mode=None):
        return await self._submit("sum", as_mode(mode), ws)

    async def weight_max(self, ws):
        return await self._submit("max", TrieMode.WITHOUT_EOS, ws)

    async def log_mass(self, logits, mode=None):
        """Batched fused log-masses of one logit row (stays on the logits' device)."""
        return await self._submit("log_mass", as_mode(mode), logits)
