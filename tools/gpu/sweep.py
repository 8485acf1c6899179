"""``--sweep``: the Triton tile kernels' time in each launch configuration of
``TRITON_SWEEP``, to choose the defaults from."""

from __future__ import annotations

import contextlib

from tools.gpu.goals import GOAL_PEAK_B, SPEEDUP_B
from tools.gpu.measure import bench_ms, index_bytes, io_bytes, kernel_call

# --sweep: Triton tile-kernel configurations to time, per tile kernel (module constants of
# genlm_fast.ops.triton_backend, set for one measurement each). The defaults there are the
# fastest of a sweep (bench/results/README.md names the run); these are their neighbours.
# ROWS >= 16 for tl.dot.
TRITON_SWEEP = {
    "dot": [
        {"DOT_ROWS": rows, "DOT_WARPS": warps}
        for rows, warps in ((16, 2), (16, 4), (16, 8), (32, 4))
    ]
    + [
        {"DOT_ROWS": 16, "DOT_WARPS": 4, "DOT_UB": 32, "DOT_RB": 32},
        {"DOT_ROWS": 16, "DOT_WARPS": 4, "DOT_UB": 128, "DOT_RB": 128},
    ],
    "max": [
        {"MAX_ROWS": rows, "MAX_WARPS": warps, "MAX_RB": rb}
        for rows, warps, rb in ((4, 4, 32), (8, 2, 32), (8, 4, 32), (8, 4, 64), (16, 4, 32))
    ],
}


@contextlib.contextmanager
def triton_config(**constants):
    """The Triton backend's launch constants (``DOT_ROWS=32``, ...) set for the block."""
    from genlm_fast.ops import triton_backend as tb

    saved = {name: getattr(tb, name) for name in constants}  # AttributeError for a typo
    try:
        for name, value in constants.items():
            setattr(tb, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(tb, name, value)


def triton_sweep(args, context) -> list[dict]:
    """Kernel time of every TRITON_SWEEP configuration of the tile kernel each op runs, at
    the goals' batch sizes (sum: SPEEDUP_B; log_mass, max: GOAL_PEAK_B), where in
    --batch-sizes (else the largest). Each is checked against the oracle before it is timed."""
    from bench.tries import check_result, make_inputs
    from genlm_fast.ops import triton_backend as tb

    if "triton" not in context["backends"]:
        print("--sweep: the triton backend is not available; nothing to sweep", flush=True)
        return []
    layout, ref, device = context["layout"], context["ref"], context["device"]
    how, peak = context["how"], context["peak"]
    out = []
    for op in args.ops:
        B = {"sum": SPEEDUP_B}.get(op, GOAL_PEAK_B)
        B = B if B in args.batch_sizes else max(args.batch_sizes)
        logits, probs = make_inputs(len(context["vocab"]), B)
        logits, probs = logits.to(device), probs.to(device)  # where the reference's arrays are
        want = ref.oracle(op, logits, probs)
        x = (logits if op == "log_mass" else probs).contiguous()
        kind = tb.tile_kernel(op, x.dtype)
        moved = sum(io_bytes(x, op, layout.num_nodes)) + index_bytes(
            layout, "triton", device=device
        )
        for config in TRITON_SWEEP.get(kind, []):
            label = ", ".join(f"{k}={v}" for k, v in config.items())
            default = all(getattr(tb, k) == v for k, v in config.items())
            row = {"op": op, "B": B, "kernel": kind, "config": label, "default": default}
            with triton_config(**config):
                kfn = kernel_call("triton", x, layout, op)
                try:  # a configuration that fails to compile or to verify is reported
                    row["max_rel_err"] = check_result(
                        kfn(),
                        want,
                        op,
                        byte_trie=ref.char_trie_columns,
                        label=f"triton {op} B={B} {label}",
                    )
                    row["kernel_ms"] = bench_ms(kfn, device, how)
                except Exception as e:  # noqa: BLE001
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            if "kernel_ms" in row:
                row["GBs"] = moved / (row["kernel_ms"] * 1e-3) / 1e9
                row["peak_frac"] = row["GBs"] / peak if peak else None
                print(
                    f"sweep triton {op:8s} B={B:<4d} {label:45s} {row['kernel_ms']:9.4f} ms "
                    f"{row['GBs']:8.1f} GB/s" + (" (default)" if default else ""),
                    flush=True,
                )
            else:
                print(
                    f"sweep triton {op:8s} B={B:<4d} {label:45s} FAILED: {row['failed']}",
                    flush=True,
                )
            out.append(row)
    return out
