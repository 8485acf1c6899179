"""CPU backend: the C++/OpenMP kernel of ``csrc/trie_reduce_cpu.cpp`` (algorithm in its header).

``trie_reduce`` follows the backend contract of ``genlm_fast.ops.dispatch``; it needs no
tiles. The kernel sweeps each row once over the nodes in post-order with a stack of
running values per depth, so besides the layout's ``parent``, ``leaf_token`` and
``leaf_end`` it takes a few arrays derived here once per (layout, mode) and cached in the
layout's per-device dict under ``"_cpu"``. It checks every row as it reads it (NaN; for
``log_mass`` also +inf or no finite logit), so the dispatcher skips its own row check.
"""

from __future__ import annotations

import torch

from genlm_fast.ops import extension

# the kernel checks each row as it reads it and raises the dispatcher's error itself
CHECKS_ROWS = True


def _node_depths(parent: torch.Tensor) -> torch.Tensor:
    """Edges from the root of every node (int64), by pointer jumping: ``jump[n]`` is an
    ancestor of n (itself for a root) at distance ``dist[n]``; doubling the jump
    ceil(log2(depth)) times reaches the roots."""
    is_root = parent < 0
    jump = torch.where(is_root, torch.arange(parent.numel()), parent)
    dist = (~is_root).long()
    while not bool(is_root[jump].all()):
        dist = dist + dist[jump]
        jump = jump[jump]
    return dist


def _single_child_runs(parent, leaf_counts, depth, max_depth) -> dict:
    """The runs the row sweep steps over (csrc/trie_reduce_cpu.h): maximal chains of
    consecutive node ids in which every node above the first has exactly one child and no
    leaf. In post-order a node's last child is the node just before it, so such a node n
    continues the run of n - 1 and has its value. Each run also gets the stack slots it reads:
    its children's (the identity slot, max_depth + 1, when its first node has none) and its
    earlier siblings' (the identity slot when its top node is a first child: a node's first
    child is its smallest child id)."""
    num_nodes = parent.numel()
    has_parent = parent >= 0
    children = torch.bincount(parent[has_parent], minlength=num_nodes)
    link = (children == 1) & (leaf_counts == 0)  # n holds the value of n - 1
    start = torch.nonzero(~link).flatten()  # node 0 has no child, so it starts a run
    end = torch.cat([start[1:], start.new_tensor([num_nodes])])
    top = end - 1
    node = torch.arange(num_nodes)
    first_child = torch.full((num_nodes,), num_nodes, dtype=torch.long).scatter_reduce(
        0, parent[has_parent], node[has_parent], "amin"
    )
    is_first = ~has_parent[top] | (first_child[parent[top].clamp(min=0)] == top)
    identity_slot = max_depth + 1
    leaf_start = torch.cumsum(leaf_counts, 0) - leaf_counts

    def as_i32(t):
        return t.to(torch.int32).contiguous()

    return {
        "run_end": as_i32(end),
        "run_depth": as_i32(depth[top]),
        "run_child_slot": as_i32(torch.where(children[start] > 0, depth[start] + 1, identity_slot)),
        "run_join_slot": as_i32(torch.where(is_first, identity_slot, depth[top])),
        "run_leaf": as_i32(torch.cat([leaf_start[start], leaf_counts.sum().reshape(1)])),
        "run_of": as_i32(torch.cumsum((~link).long(), 0) - 1),
    }


def cpu_arrays(arrays: dict) -> dict:
    """The kernel's derived arrays for one (layout, mode), built once: the node of every
    leaf position (``leaf_end`` is cumulative per node in leaf order), the empty nodes, the
    runs of single-child links and the maximum depth."""
    cached = arrays.get("_cpu")
    if cached is None:
        leaf_end = arrays["leaf_end"].long()
        counts = torch.diff(leaf_end, prepend=leaf_end.new_zeros(1))
        num_nodes = leaf_end.numel()
        node_of_leaf = torch.repeat_interleave(torch.arange(num_nodes, dtype=torch.int32), counts)
        empty = torch.nonzero(arrays["leaf_start"] == arrays["leaf_end"]).flatten()
        parent = arrays["parent"].long()
        depth = _node_depths(parent)
        max_depth = int(depth.max()) if depth.numel() else 0
        cached = {
            "max_depth": max_depth,
            "node_of_leaf": node_of_leaf.contiguous(),
            "empty": empty.to(torch.int32).contiguous(),
            "checked": False,
            **_single_child_runs(parent, counts, depth, max_depth),
        }
        arrays["_cpu"] = cached
    return cached


def run_kernel(
    module,
    values: torch.Tensor,
    arrays: dict,
    reduction: str,
    *,
    check: bool | None = None,
    num_threads: int = 0,
    float64_result: bool = False,
) -> torch.Tensor:
    """``module.trie_reduce_cpu`` on a layout's arrays (``module``: the loaded extension, or
    a test's own build of it). ``check=None`` checks every index on the layout's first call
    only (the arrays are immutable afterwards). A row the kernel rejects raises the
    dispatcher's error."""
    cpu = cpu_arrays(arrays)
    check = not cpu["checked"] if check is None else check
    # the kernel gathers columns by leaf_token, bounds-checked only when check is true:
    # a row too narrow must not be read past its end, whoever calls this
    if values.dim() == 2 and values.shape[1] < arrays["num_columns"]:
        raise ValueError(
            f"rows have {values.shape[1]} entries but the vocabulary needs at "
            f"least {arrays['num_columns']}"
        )
    out, bad_row = module.trie_reduce_cpu(
        values,
        arrays["parent"],
        cpu["node_of_leaf"],
        arrays["leaf_token"],
        cpu["empty"],
        cpu["run_end"],
        cpu["run_depth"],
        cpu["run_child_slot"],
        cpu["run_join_slot"],
        cpu["run_leaf"],
        cpu["run_of"],
        cpu["max_depth"],
        reduction,
        check,
        num_threads,
        float64_result,
    )
    cpu["checked"] = cpu["checked"] or check
    if bad_row >= 0:
        from genlm_fast.ops.dispatch import raise_bad_row

        raise_bad_row(values, bad_row, reduction)
    return out


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
    if not extension.has("cpu"):
        raise RuntimeError(
            f"The 'cpu' trie kernels are not available: {extension.why_missing('cpu')}"
        )
    # float32 values with a float64 result: the kernel reads them as they are (it
    # accumulates in double either way)
    return run_kernel(
        extension.load_module(), values, arrays, reduction, float64_result=float64_result
    ), None
