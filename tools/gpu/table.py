"""The GPU benchmark's markdown report: the machine, the timed rows, the headline speedups,
where the kernel time goes, the goals, and (when measured) the memory floors and the
Triton sweep."""

from __future__ import annotations

from tools.gpu.goals import SPEEDUP_B, goals


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def table(rows, info, command: str, sweep_rows=(), floor_rows=()) -> str:
    lines = ["# genlm_fast GPU trie kernels", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += [
        "",
        f"Command: `{command}`",
        "",
        (
            "api ms: the public call (`TokenByteTrie.batch_log_mass` / `batch_weight_sum` / "
            "`batch_weight_max`, validation included, result on the device); kernel ms: the "
            "backend's kernels alone. Traffic: input read once (B x V' x 4 B), output written "
            "once (B x N x 4 B), index arrays read once; GB/s = traffic / kernel ms (api GB/s: "
            "/ api ms). ref ms: the "
            "reference's device work (sum: `sparse.mm(ws[:, positions], M)`; max: its "
            "`scatter_reduce` amax; log_mass: log_softmax, exp, sparse.mm, log); speedup = "
            "ref ms / kernel ms. Every result was checked against the float64 oracle first "
            "(max rel err = worst relative error of a node mass >= 1e-30)."
        ),
        "",
        (
            "| backend | op | B | api ms | kernel ms | MB read | MB written | MB index | GB/s "
            "| % of peak | api GB/s | api % of peak | ref ms | speedup | max rel err |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"| {r['backend']} | {r['op']} | {r['B']} | FAILED verification: "
                f"{r['failed']} |" + " |" * 11
            )
            continue
        frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
        api_frac = "-" if r.get("api_peak_frac") is None else f"{100 * r['api_peak_frac']:.0f}%"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        lines.append(
            f"| {r['backend']} | {r['op']} | {r['B']} | {r['api_ms']:.4f} | "
            f"{_f(r['kernel_ms'], '.4f')} | {r['read_MB']:.2f} | {r['write_MB']:.2f} | "
            f"{r['index_MB']:.2f} | {r['GBs']:.0f} | {frac} | {_f(r.get('api_GBs'), '.0f')} | "
            f"{api_frac} | {_f(r['ref_ms'], '.4f')} | {speedup} | {r['max_rel_err']:.1e} |"
        )
    lines += [
        "",
        f"Speedup at B={SPEEDUP_B} vs the reference's batch_weight_sum:",
        "",
        (
            "| backend | kernels vs ref device time | full call vs full call (both return "
            "numpy on the host: genlm's and genlm_fast's `ParallelTokenCharacterTrie`) |"
        ),
        "|---|---:|---:|",
    ]
    for r in rows:
        if r["op"] == "sum" and r["B"] == SPEEDUP_B and "failed" not in r:
            lines.append(
                f"| {r['backend']} | {_f(r['speedup'], '.1f')}x ({_f(r['ref_ms'], '.3f')} ms vs "
                f"{_f(r['kernel_ms'], '.3f')} ms) | {_f(r['speedup_api'], '.1f')}x "
                f"({_f(r['ref_api_ms'], '.3f')} ms vs {_f(r.get('host_api_ms'), '.3f')} ms) |"
            )
    broken_down = [r for r in rows if r.get("breakdown")]
    if broken_down:
        lines += [
            "",
            f"Where the kernel time goes at B={broken_down[0]['B']} (torch.profiler, "
            "20 calls back to back; ms per call):",
            "",
            "| backend | op | kernel | ms |",
            "|---|---|---|---:|",
        ]
        for r in broken_down:
            for name, ms in r["breakdown"][:6]:
                lines.append(f"| {r['backend']} | {r['op']} | `{name}` | {ms:.4f} |")
    lines += [
        "",
        "Goals (Llama-3 vocabulary):",
        "",
        "| goal | backend | measured | met |",
        "|---|---|---:|---|",
    ]
    for r in goals(rows):
        lines.append(f"| {r['goal']} | {r['backend']} | {r['measured']} | {r['met']} |")
    if floor_rows:
        lines += [
            "",
            "Memory floors at the goals' shapes (torch's own kernels, then Triton "
            "kernels moving the same bytes in the CUDA tile kernel's pattern with no "
            "reduction, tools/gpu/tile_floors.py; same timer; `memory_floors`): what the "
            "memory system gives a kernel of that traffic:",
            "",
            "| op | B | floor | MB moved | ms | GB/s | % of peak |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in floor_rows:
            frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
            lines.append(
                f"| {r['op']} | {r['B']} | {r['floor']} | {r['MB']:.2f} | "
                f"{r['ms']:.4f} | {r['GBs']:.0f} | {frac} |"
            )
    if sweep_rows:
        lines += [
            "",
            "Triton tile-kernel configurations (`--sweep`; constants of "
            "`genlm_fast.ops.triton_backend`; kernels alone, each checked against the "
            "oracle first; fastest per op in bold):",
            "",
            "| op | B | tile kernel | configuration | kernel ms | GB/s | % of peak | max rel err |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        timed = [r for r in sweep_rows if "kernel_ms" in r]
        best = {
            op: min(r["kernel_ms"] for r in timed if r["op"] == op)
            for op in {r["op"] for r in timed}
        }
        for r in sweep_rows:
            config = r["config"] + (" (default)" if r["default"] else "")
            if "failed" in r:
                lines.append(
                    f"| {r['op']} | {r['B']} | {r['kernel']} | {config} | FAILED: "
                    f"{r['failed']} | | | |"
                )
                continue
            ms = f"{r['kernel_ms']:.4f}"
            ms = f"**{ms}**" if r["kernel_ms"] == best[r["op"]] else ms
            frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
            lines.append(
                f"| {r['op']} | {r['B']} | {r['kernel']} | {config} | {ms} | "
                f"{r['GBs']:.0f} | {frac} | {r['max_rel_err']:.1e} |"
            )
    return "\n".join(lines) + "\n"
