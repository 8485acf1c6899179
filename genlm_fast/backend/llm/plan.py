"""What the engines of `AsyncTransformer` pass between them (`engines`): a forward's
`Row`s in, its `Output` back, and the `Engine` interface every way of running one offers."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from genlm_fast.backend.cache import KVRun

__all__ = ["Engine", "Output", "Row", "row_ids"]


class Row(NamedTuple):
    """One context of a forward."""

    ids: tuple  # the context's token ids, all of them
    depth: int  # how many of its first positions have stored states (its past)
    runs: list[KVRun]  # those states, in position order (empty when ``depth`` is 0)

    @property
    def new(self) -> int:
        """How many positions the forward runs for this row."""
        return len(self.ids) - self.depth


class Output(NamedTuple):
    """What an engine's forward returns."""

    logits: torch.Tensor  # [rows, vocab]: each row's last position
    # each row's new states [layers, 2, kv_heads, new, head_dim], to store; None when not
    # asked for, or when the model returned a cache that cannot be reused
    states: list[torch.Tensor] | None


def row_ids(rows):
    """The token ids of each of ``rows``."""
    return [row.ids for row in rows]


class Engine(Protocol):
    """One way of running a forward over `Row`s (`engines.Forwards` picks one per forward).

    ``name`` names it in `AsyncTransformer.forward_path`; ``why_not`` says why it cannot
    take the rows (one `Row` for the fused decoder, which takes rows one by one, else the
    forward's list), or None; ``run`` runs them, returning each row's new states when
    ``keep``."""

    name: str

    def why_not(self, rows, lora) -> str | None: ...

    def run(self, rows: list[Row], keep: bool) -> Output: ...
