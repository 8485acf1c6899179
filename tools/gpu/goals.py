"""The project's GPU goals (Llama-3 vocabulary), the shapes they are measured at, and their
verdicts on the benchmark's rows."""

from __future__ import annotations

# kernels' share of peak HBM bandwidth for batch_log_mass at B=64, and the speedup over the
# reference's batch_weight_sum device time at B=32 (SPEEDUP_B: the headline's batch size)
GOAL_PEAK_OP, GOAL_PEAK_B, GOAL_PEAK_FRAC = "log_mass", 64, 0.70
SPEEDUP_B, GOAL_SPEEDUP = 32, 10.0


def goals(rows) -> list[dict]:
    """The two GPU goals for every backend: kernels at >= 70% of peak HBM bandwidth
    for batch_log_mass at B=64, and >= 10x the reference's batch_weight_sum device time at
    B=32 ("-": not measured, or no peak known)."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend and "failed" not in r]
        peak_rows = [r for r in mine if r["op"] == GOAL_PEAK_OP and r["B"] == GOAL_PEAK_B]
        frac = peak_rows[0]["peak_frac"] if peak_rows else None
        out.append(
            {
                "goal": f"batch_{GOAL_PEAK_OP} B={GOAL_PEAK_B}: kernels >= "
                f"{100 * GOAL_PEAK_FRAC:.0f}% of peak HBM bandwidth",
                "backend": backend,
                "measured": "-" if frac is None else f"{100 * frac:.0f}%",
                "met": "-" if frac is None else ("yes" if frac >= GOAL_PEAK_FRAC else "NO"),
            }
        )
        sum_rows = [r for r in mine if r["op"] == "sum" and r["B"] == SPEEDUP_B]
        sp = sum_rows[0]["speedup"] if sum_rows else None
        out.append(
            {
                "goal": f"batch_weight_sum B={SPEEDUP_B}: >= {GOAL_SPEEDUP:g}x the "
                "reference's device time",
                "backend": backend,
                "measured": "-" if sp is None else f"{sp:.1f}x",
                "met": "-" if sp is None else ("yes" if sp >= GOAL_SPEEDUP else "NO"),
            }
        )
    return out
