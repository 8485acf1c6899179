"""The memory floors the GPU benchmark reads its kernels' bandwidth against: what torch's
own streaming kernels, and Triton kernels moving the same bytes in the CUDA tile kernel's
pattern (`tools.gpu.tile_floors`), get at the goals' shapes."""

from __future__ import annotations

from tools.gpu.goals import GOAL_PEAK_B, GOAL_PEAK_OP, SPEEDUP_B
from tools.gpu.measure import bench_ms


def _bench_input(context, op: str, B: int):
    """The benchmark's [B, V] input for ``op`` (logits for log_mass, else probabilities)."""
    from bench.tries import make_inputs

    logits, probs = make_inputs(len(context["vocab"]), B)
    return (logits if op == "log_mass" else probs).to(context["device"]).contiguous()


def memory_floors(context) -> list[dict]:
    """What the memory system alone gives at the goals' shapes (log_mass at GOAL_PEAK_B, sum
    at SPEEDUP_B), with torch's own kernels and the same timer: the [B, N] float32 output
    written once (``fill_``), the [B, V'] input read once (``amax`` over each row), read and
    written once (``copy_``: what staging the rows costs at the least), and gathered into
    [B, N] (``index_select`` of each node's last leaf's column: the fused pass with no
    reduction and no normalization at all). They say what fraction of peak a kernel that only
    moves the goal's traffic gets on this device, to read the trie kernels' fraction against
    (torch's kernels are good streaming kernels, not proven optimal ones). The tile pattern's
    floors (``_tile_pattern_cases``) say how much of the gap is the pattern's own."""
    import torch

    layout, device = context["layout"], context["device"]
    how, peak = context["how"], context["peak"]
    ml = layout.modes["without_eos"]
    leaf_end = torch.as_tensor(ml.leaf_end, dtype=torch.int64)
    has_leaf = leaf_end > torch.as_tensor(ml.leaf_start, dtype=torch.int64)
    last_column = torch.as_tensor(ml.leaf_token, dtype=torch.int64)[(leaf_end - 1).clamp(min=0)]
    node_column = torch.where(has_leaf, last_column, 0).to(device)
    N, L = layout.num_nodes, len(ml.leaf_token)
    tile_node_lo = torch.as_tensor(ml.tile_node_lo).to(device)
    out = []
    for op, B in ((GOAL_PEAK_OP, GOAL_PEAK_B), ("sum", SPEEDUP_B)):
        x = _bench_input(context, op, B)
        result = torch.empty(B, N, dtype=torch.float32, device=device)
        copy = torch.empty_like(x)
        in_bytes, out_bytes = x.numel() * x.element_size(), result.numel() * 4
        cases = [
            # (each timed in this round of the loop: its tensors bound now)
            ("write [B, N] once (fill_)", out_bytes, lambda result=result: result.fill_(1.0)),
            ("read [B, V'] once (amax per row)", in_bytes, lambda x=x: torch.amax(x, dim=1)),
            ("read and write [B, V'] (copy_)", 2 * in_bytes, lambda x=x, copy=copy: copy.copy_(x)),
            (
                "gather [B, V'] into [B, N] (index_select)",
                in_bytes + out_bytes,
                lambda x=x, result=result: torch.index_select(x, 1, node_column, out=result),
            ),
        ]
        try:  # a Triton problem here must not cost the session torch's floors
            cases += _tile_pattern_cases(result, tile_node_lo, ml.tile, L, out_bytes)
        except Exception as e:  # noqa: BLE001
            print(f"no tile-pattern floors: {type(e).__name__}: {e}", flush=True)
        for name, moved, fn in cases:
            ms = bench_ms(fn, device, how)
            gbs = moved / (ms * 1e-3) / 1e9
            out.append(
                {
                    "op": op,
                    "B": B,
                    "floor": name,
                    "MB": moved / 1e6,
                    "ms": ms,
                    "GBs": gbs,
                    "peak_frac": gbs / peak if peak else None,
                }
            )
            print(f"floor {op:8s} B={B:<4d} {name:45s} {ms:9.4f} ms {gbs:8.1f} GB/s", flush=True)
    return out


def _tile_pattern_cases(result, tile_node_lo, tile: int, L: int, out_bytes: int) -> list:
    """The floors in the CUDA tile kernel's own pattern (tools/gpu/tile_floors.py), each checked
    once against plain torch first."""
    import torch

    from tools.gpu import tile_floors

    B, N = result.shape
    staged = torch.rand(B * L, generator=torch.Generator().manual_seed(0)).to(result.device)
    cases = []
    for name, moved, kwargs in (
        ("write [B, N] as the tile blocks do (32 rows x a tile's ids)", out_bytes, {}),
        ("write [B, N] as blocks of 4 tiles would", out_bytes, {"tiles": 4}),
        (
            "read the staged [B, L], write [B, N], as the tile blocks do",
            staged.numel() * 4 + out_bytes,
            {"staged": staged},
        ),
    ):
        result.fill_(float("nan"))
        tile_floors.tile_pattern(result, tile_node_lo, tile, L, **kwargs)
        want = tile_floors.expected(B, N, tile_node_lo, tile, L, kwargs.get("staged"))
        torch.testing.assert_close(result.cpu(), want, rtol=1e-4, atol=0.0, msg=name)
        cases.append(
            (
                name,
                moved,
                lambda kw=kwargs: tile_floors.tile_pattern(result, tile_node_lo, tile, L, **kw),
            )
        )
    return cases
