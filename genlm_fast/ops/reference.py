"""Plain-torch reference backend: the semantics every other backend is tested against.

Each node's leaf range ``[leaf_start, leaf_end)`` is expanded into an explicit list of leaf
positions (the same ``sum over depth`` entries as genlm's ancestor matrix), the leaf values
are gathered in float64 and ``torch.segment_reduce`` reduces every node's segment directly.
No prefix sums, no float32: slow and memory-hungry, but obviously right.
"""

from __future__ import annotations

import torch

from genlm_fast.ops.dispatch import result_dtype

CHECKS_ROWS = False  # the dispatcher checks every row before this backend runs


def _segments(arrays):
    """Expanded leaf positions and per-node lengths, built once per (mode, device)."""
    seg = arrays.get("_reference")
    if seg is None:
        start = arrays["leaf_start"].long()
        end = arrays["leaf_end"].long()
        lengths = end - start
        total = int(lengths.sum())
        owner = torch.repeat_interleave(torch.arange(len(start), device=start.device), lengths)
        offset = torch.arange(total, device=start.device) - torch.repeat_interleave(
            torch.cumsum(lengths, 0) - lengths, lengths
        )
        positions = start[owner] + offset
        seg = arrays["_reference"] = (positions, lengths)
    return seg


def trie_reduce(
    values: torch.Tensor,
    arrays: dict,
    reduction: str,
    *,
    num_nodes: int,
    num_scratch: int = 0,
    tile: int = 0,
    float64_result: bool = False,
):
    """The backend contract of ``genlm_fast.ops.dispatch`` (tiles and scratch unused)."""
    positions, lengths = _segments(arrays)
    B = values.shape[0]
    x = values.to(torch.float64)
    if reduction == "log_mass":
        x = torch.log_softmax(x, dim=-1)
    leaf_values = x[:, arrays["leaf_token"].long()]
    data = leaf_values[:, positions]
    lens = lengths.expand(B, -1).contiguous()
    if reduction == "sum":
        out = torch.segment_reduce(data, "sum", lengths=lens, axis=1, unsafe=True, initial=0.0)
    elif reduction == "max":
        out = torch.segment_reduce(
            data, "max", lengths=lens, axis=1, unsafe=True, initial=float("-inf")
        )
        out = torch.where(lengths == 0, torch.zeros_like(out), out)
    else:  # log-sum-exp of log-probabilities, stabilised by each segment's max
        peak = torch.segment_reduce(
            data, "max", lengths=lens, axis=1, unsafe=True, initial=float("-inf")
        )
        owner = torch.repeat_interleave(torch.arange(num_nodes, device=x.device), lengths)
        safe_peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
        scaled = torch.exp(data - safe_peak[:, owner])
        total = torch.segment_reduce(scaled, "sum", lengths=lens, axis=1, unsafe=True, initial=0.0)
        out = torch.where(torch.isinf(peak), peak, safe_peak + torch.log(total))
    return out.to(result_dtype(reduction, values.dtype, float64_result)), None
