"""Contention benchmark: genlm_fast and the references idle, beside a busy loop, and beside
another process's 2-thread torch matmuls.

    flock /tmp/genlm_cpu.lock python -m bench.contention [--quick] [--out FILE]
    python -m bench.contention --workloads trie-sum-B1,lm-step --seconds 2

Workloads (`bench.contention_workloads`, each: genlm_fast, and the reference on the same
inputs): ``trie-sum-B1``, ``trie-sum-B32``, ``lm-step``, ``beam``, ``control``.

Each implementation runs in a worker process of its own (the drop-in's import hook must not
meet the real packages), hosting all its workloads; the driver alternates the two workers in
blocks of about ``--block`` seconds (at least one call each), 0.25 s apart, until each has
run ``--seconds`` and ``--min-calls`` calls, for every (condition, workload). Conditions:
``idle``; ``idle-1t`` (idle, each worker's torch threads, and so the kernels' teams, set to
1: what losing a CPU alone costs, for comparison); ``busy-loop`` (a process running
``while True: pass``); ``torch-2t`` (a process multiplying 512 x 512 float32 matrices on 2
torch threads, with torch's default OpenMP settings); ``lm-program`` (another genlm_fast
program: SmolLM2 decoding 8 rows a step with a 2 ms pause between steps, so that the CPUs it
leaves free come and go within a second). Each competitor starts 1 s before the
condition's first block (``lm-program``: 1 s after its first step). The figure is the mean
time per call (what a program sees: a call that waited for a CPU counts in full; medians are
saved too), and the slowdown factor is a condition's mean over the idle one. The goals:
genlm_fast's factor under each competitor no worse than the reference's, and at most 2.5
beside the busy loop.

Run it alone on the machine (the shared lock): the competitors are its own. The table, the
machine (CPU, usable CPUs, load), the environment's OpenMP settings and the commit go to
``--out`` (default ``bench/results/contention-<date>.md``) and a JSON beside it (the table's
figures, and each series' 10th and 90th percentiles and maximum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.contention_workloads import SIDES, WORKLOADS  # noqa: E402 (after the checkout's path)
from bench.report import command_line, write_report  # noqa: E402
from bench.workers import Worker, child_env  # noqa: E402

CONDITIONS = ("idle", "idle-1t", "busy-loop", "torch-2t", "lm-program")
BUSY_LOOP_GOAL = 2.5
# pause before each block: the other side's work is over (its threads asleep, genlm_fast's
# contention reading past it), so that "idle" is an idle machine for both
SETTLE_S = 0.25

_TORCH_COMPETITOR = """
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
while True:
    a @ a
"""
# another genlm_fast program on the machine: SmolLM2 decoding 8 rows a step, with a short
# pause for host work between steps, so that it takes the CPUs in bursts (its forwards
# follow the contention they see, as ours do); prints "ready" once its model is loaded
_LM_COMPETITOR = """
import asyncio, random, time
from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.models import smollm2_path
lm = AsyncTransformer.from_name(smollm2_path())
prompt = lm.tokenizer.encode("Another experiment on the same machine:")
rng = random.Random(0)
async def main():
    contexts, steps = [], 0
    while True:
        if not contexts or len(contexts[0]) >= len(prompt) + 48:
            contexts = [list(prompt) for _ in range(8)]
        contexts = [c + [rng.randrange(1000, 20000)] for c in contexts]
        await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        steps += 1
        if steps == 1:
            print("ready", flush=True)
        time.sleep(0.002)
asyncio.run(main())
"""
COMPETITORS = {
    "idle": None,
    "idle-1t": None,
    "busy-loop": ["-c", "while True: pass"],
    "torch-2t": ["-c", _TORCH_COMPETITOR],
    "lm-program": ["-c", _LM_COMPETITOR],
}
# competitors that say "ready" on their first line of output when their work has begun
ANNOUNCING = ("lm-program",)

# exit status of a run that finished with a goal not met: its finding, told apart from a
# failure to run (an uncaught exception exits with 1)
GOALS_NOT_MET = 3

# --------------------------------------------------------------------------- driver


def _child_env():
    """The environment of the workers and competitors (`bench.workers.child_env`)."""
    return child_env(TOKENIZERS_PARALLELISM="false")


class Competitor:
    def __init__(self, condition):
        args = COMPETITORS[condition]
        self.condition = condition
        self.announces = condition in ANNOUNCING
        self.proc = (
            None
            if args is None
            else subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.announces else subprocess.DEVNULL,
                text=True,
            )
        )

    def __enter__(self):
        if self.proc is not None:
            if self.announces and self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError(
                    f"the {self.condition} competitor exited (status {self.proc.wait()})"
                )
            time.sleep(1.0)
        return self

    def cpu_seconds(self):
        """CPU time the competitor has used so far (user + system, of the process and the
        children it waited for), from /proc: evidence that it ran, whatever else did."""
        if self.proc is None:
            return 0.0
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            time.sleep(0.5)  # its CPU time leaves the others' readings of the next condition


def run(
    workloads=WORKLOADS,
    conditions=CONDITIONS,
    seconds=2.0,
    block=0.4,
    min_calls=2,
    fast_threads=None,
    log=print,
):
    """``{condition: {workload: {side: [seconds per call]}}}``, the workers' thread
    readings, and ``{condition: {"cpu_seconds", "wall_seconds"}}``: the competitor's own CPU
    time over the condition (0 where there is none). ``fast_threads``: genlm_fast's torch
    threads (and so its kernels' teams) in every condition, instead of its own choice."""
    results = {c: {w: {s: [] for s in SIDES} for w in workloads} for c in conditions}
    readings = {c: {} for c in conditions}
    competitors = {}  # condition -> the competitor's CPU seconds over the condition's
    with tempfile.TemporaryDirectory() as logs:
        workers = {}
        try:
            for side in SIDES:
                worker_log = open(Path(logs) / f"worker-{side}.log", "w+")  # noqa: SIM115
                workers[side] = Worker("bench.contention_workloads", side, _child_env(), worker_log)
            for side in SIDES:
                log(f"setting up {side}: {', '.join(workloads)} ...")
                workers[side].ask({"cmd": "setup", "workloads": list(workloads)})
            for condition in conditions:
                with Competitor(condition) as competitor:
                    begun = time.perf_counter()
                    for name in workloads:
                        done = results[condition][name]
                        while any(
                            len(done[s]) < min_calls or sum(done[s]) < seconds for s in SIDES
                        ):
                            for side in SIDES:
                                threads = fast_threads if side == "genlm_fast" else None
                                time.sleep(SETTLE_S)
                                answer = workers[side].ask(
                                    {
                                        "cmd": "block",
                                        "workload": name,
                                        "seconds": block,
                                        "min_calls": 1,
                                        "threads": 1 if condition == "idle-1t" else threads,
                                    }
                                )
                                done[side] += answer["times"]
                                if side == "genlm_fast":
                                    readings[condition][name] = answer["info"]
                        log(
                            f"{condition:>9} {name:>13}: "
                            + ", ".join(
                                f"{s} {1e3 * statistics.mean(done[s]):.2f} ms ({len(done[s])})"
                                for s in SIDES
                            )
                        )
                    competitors[condition] = {
                        "cpu_seconds": competitor.cpu_seconds(),
                        "wall_seconds": time.perf_counter() - begun,
                    }
        finally:
            for w in workers.values():
                w.close()
                w.log.close()
    return results, readings, competitors


def summary(results):
    """Rows of (workload, side, {condition: (mean ms, median ms, calls, factor)})."""
    rows = []
    conditions = list(results)
    for name in next(iter(results.values())):
        for side in SIDES:
            cells = {}
            idle = None
            for c in conditions:
                ts = results[c][name][side]
                mean = 1e3 * statistics.mean(ts)
                idle = mean if c == "idle" else idle
                cells[c] = {
                    "mean_ms": mean,
                    "median_ms": 1e3 * statistics.median(ts),
                    "calls": len(ts),
                    "factor": None if idle is None else mean / idle,
                }
            rows.append({"workload": name, "side": side, "cells": cells})
    return rows


def _quantile_ms(ts, q):
    """The ``q`` quantile of sorted times ``ts``, in ms."""
    return round(1e3 * ts[min(len(ts) - 1, int(q * len(ts)))], 3)


def spread(results):
    """{condition: {workload: {side: {p10, p90, max ms}}}}: how the calls' times spread."""
    out = {}
    for c, per in results.items():
        for name, sides in per.items():
            for side, ts in sides.items():
                ts = sorted(ts)
                out.setdefault(c, {}).setdefault(name, {})[side] = {
                    "p10_ms": _quantile_ms(ts, 0.1),
                    "p90_ms": _quantile_ms(ts, 0.9),
                    "max_ms": round(1e3 * ts[-1], 3),
                }
    return out


def goals(rows):
    """(text, met) per (workload, competitor)."""
    out = []
    by = {(r["workload"], r["side"]): r["cells"] for r in rows}
    for name in dict.fromkeys(r["workload"] for r in rows):
        fast, ref = by[name, "genlm_fast"], by[name, "reference"]
        for c in fast:
            if c.startswith("idle") or fast[c]["factor"] is None:
                continue
            f, g = fast[c]["factor"], ref[c]["factor"]
            met = f <= g
            text = f"{name}, {c}: genlm_fast {f:.2f}x vs reference {g:.2f}x"
            if c == "busy-loop":
                met = met and f <= BUSY_LOOP_GOAL
                text += f" (and <= {BUSY_LOOP_GOAL}x)"
            if "idle-1t" in fast:  # what the lost CPU alone explains
                one = fast[c]["mean_ms"] / fast["idle-1t"]["mean_ms"]
                text += f"; genlm_fast beside it: {one:.2f}x its idle time on one thread"
            out.append((text, met))
    return out


def table(rows, info, readings, command):
    conditions = list(rows[0]["cells"])
    lines = ["# genlm_fast under contention", "", f"`{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "Mean ms per call (median in brackets), and the slowdown factor over idle:",
        "",
        "| workload | implementation | " + " | ".join(conditions) + " |",
        "|---|---|" + "---|" * len(conditions),
    ]
    for r in rows:
        cells = []
        for c in conditions:
            cell = r["cells"][c]
            text = f"{cell['mean_ms']:.2f} ({cell['median_ms']:.2f})"
            if c != "idle":
                text += f", **{cell['factor']:.2f}x**"
            cells.append(text)
        label = "genlm_fast" if r["side"] == "genlm_fast" else _reference_name(r["workload"])
        lines.append(f"| {r['workload']} | {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speedup of genlm_fast over the reference (mean times):",
        "",
        "| workload | " + " | ".join(conditions) + " |",
        "|---|" + "---|" * len(conditions),
    ]
    by = {(r["workload"], r["side"]): r["cells"] for r in rows}
    for name in dict.fromkeys(r["workload"] for r in rows):
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{by[name, 'reference'][c]['mean_ms'] / by[name, 'genlm_fast'][c]['mean_ms']:.1f}x"
                for c in conditions
            )
            + " |"
        )
    lines += [
        "",
        (
            "Goals (slowdown no worse than the reference's; at most "
            f"{BUSY_LOOP_GOAL}x beside the busy loop):"
        ),
        "",
    ]
    lines += [f"- {'met' if met else 'NOT met'}: {text}" for text, met in goals(rows)]
    lines += [
        "",
        (
            "genlm_fast's thread readings at the end of each condition (CPUs other "
            "work kept busy, and the team size it allowed):"
        ),
        "",
    ]
    for c, per in readings.items():
        if per:
            last = list(per.values())[-1]
            lines.append(
                f"- {c}: others_busy {last.get('others_busy', 0):.2f}, free_cpus "
                f"{last.get('free_cpus')}, usable_cpus {last.get('usable_cpus')}, "
                f"torch threads {last.get('torch_threads')}"
            )
    return "\n".join(lines) + "\n"


def _reference_name(workload):
    if workload.startswith("trie"):
        return "genlm-backend numba"
    if workload == "beam":
        return "genlm-bytes"
    if workload == "control":
        return "genlm-control on genlm-backend"
    return "genlm-backend"


def machine_info():
    from bench import machine
    from genlm_fast.backend.llm.threads import threads_info

    info = machine.machine_info()
    t = threads_info()
    if t is not None:
        info["usable CPUs (affinity / cgroup quota)"] = (
            f"{t['usable_cpus']} ({t['affinity_cpus']} / {t['quota_cpus'] or 'none'})"
        )
    for k in ("numba", "genlm_fast cpu backends"):
        info.pop(k, None)
    info["genlm-control"] = machine.dist_version("genlm-control")
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.contention", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--conditions",
        default=",".join(CONDITIONS),
        help=f"comma-separated, of {', '.join(CONDITIONS)} (default: all; "
        "idle is needed for the factors)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="time per implementation, workload and condition (default 2)",
    )
    parser.add_argument(
        "--block",
        type=float,
        default=0.5,
        help="seconds per block before the other implementation runs",
    )
    parser.add_argument("--min-calls", type=int, default=2, help="calls at least (default 2)")
    parser.add_argument(
        "--fast-threads",
        type=int,
        default=None,
        help="genlm_fast's torch threads in every condition (default: its own choice); "
        "--fast-threads 1 asks what a single-threaded genlm_fast would keep",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--seconds 1 --min-calls 1 (about half the time; the slow "
        "references' factors then rest on one call)",
    )
    parser.add_argument(
        "--out", default=None, help="markdown output (default bench/results/contention-<date>.md)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.min_calls = 1.0, 1
    workloads = [w for w in args.workloads.split(",") if w]
    conditions = [c for c in args.conditions.split(",") if c]
    for c in conditions:
        if c not in COMPETITORS:
            parser.error(f"unknown condition {c!r}")
    if "idle" not in conditions:
        parser.error("the conditions must include idle (the factors are over it)")
    conditions = ["idle"] + [c for c in conditions if c != "idle"]
    if args.fast_threads is not None and args.fast_threads < 1:
        parser.error("--fast-threads must be at least 1")
    started = time.perf_counter()
    info = machine_info()
    if args.fast_threads is not None:
        info["genlm_fast's torch threads"] = f"{args.fast_threads} in every condition"
    results, readings, competitors = run(
        workloads, conditions, args.seconds, args.block, args.min_calls, args.fast_threads
    )
    info["load average at end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info["run time"] = f"{time.perf_counter() - started:.0f} s"
    rows = summary(results)
    text = table(rows, info, readings, command_line("bench.contention", argv))
    print()
    out = write_report(text, args.out, "contention")
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "info": info,
                "rows": rows,
                "readings": readings,
                "competitors": competitors,
                "spread": spread(results),
            },
            indent=1,
        )
    )
    print(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0 if all(met for _, met in goals(rows)) else GOALS_NOT_MET


if __name__ == "__main__":
    sys.exit(main())
