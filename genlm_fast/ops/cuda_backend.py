"""CUDA backend: the kernels of ``csrc/trie_reduce_cuda.cu`` (algorithm in its header).

``trie_reduce`` follows the backend contract of ``genlm_fast.ops.dispatch``: the same tiles
as the Triton backend, whose local ranges it reads as each tile's sources (the layout's
tile_run_ptr .. scratch_slot), from the layout's arrays on the GPU.
"""

from __future__ import annotations

import torch

from genlm_fast.ops import extension

# the kernels' row pass reads every value anyway (log_mass: for the lse; sum and max: to
# stage them for the gather, or for this alone) and leaves each row's check in the last
# scratch column, NaN exactly for the bad rows: the dispatcher reads that instead of its own
# pass over the values
CHECKS_ROWS = True


def trie_reduce(
    values: torch.Tensor,
    arrays: dict,
    reduction: str,
    *,
    num_nodes: int,
    num_scratch: int,
    tile: int,
    float64_result: bool = False,
):
    if not extension.has("cuda"):
        raise RuntimeError(
            f"The 'cuda' trie kernels are not available: {extension.why_missing('cuda')}"
        )
    if float64_result:  # the kernels give float64 for float64 values
        values = values.double()
    # the kernels gather columns by leaf_token unchecked: never read past a narrow row's end
    num_columns = arrays["num_columns"]
    if values.shape[1] < num_columns:
        raise ValueError(
            f"rows have {values.shape[1]} entries but the vocabulary needs at least {num_columns}"
        )
    column_leaf = arrays.get("_column_leaf")
    if column_leaf is None:  # once per (layout, mode, device)
        # leaf_token's inverse, for staging the rows in leaf order: each column's leaf
        # position (-1: a column no token reads)
        token = arrays["leaf_token"]
        column_leaf = torch.full((num_columns,), -1, dtype=torch.int32, device=token.device)
        column_leaf[token.long()] = torch.arange(
            token.numel(), dtype=torch.int32, device=token.device
        )
        arrays["_column_leaf"] = column_leaf
    # per-row workspace: tile totals and pieces, then two columns: log_mass's row max, and
    # the row check (NaN exactly for a bad row; else log_mass log(sum exp(x - max)), sum and
    # max 0)
    scratch = torch.empty(
        values.shape[0], num_scratch + 2, dtype=torch.float64, device=values.device
    )
    out = extension.load_module().trie_reduce_cuda(
        values,
        arrays["leaf_token"],
        column_leaf,
        arrays["tile_node_lo"],
        arrays["tile_run_ptr"],
        arrays["run_bounds"],
        arrays["node_src"],
        arrays["tile_scratch_ptr"],
        arrays["scratch_src"],
        arrays["scratch_slot"],
        arrays["span_node"],
        arrays["span_left"],
        arrays["span_right"],
        arrays["span_tile_lo"],
        arrays["span_tile_hi"],
        arrays["span_narrow"],
        arrays["span_warp"],
        scratch,
        reduction,
        num_nodes,
        num_scratch,
        tile,
    )
    return out, scratch[:, -1]
