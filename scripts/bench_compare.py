"""Median regression check of pytest-benchmark runs against a saved baseline.

    python scripts/bench_compare.py BASELINE.json RUN.json [RUN.json ...] [--threshold 10]
                                    [--failing PATH]

A benchmark regresses when its median is more than ``threshold`` percent above the
baseline's in every run given (``scripts/bench_regress.sh`` re-runs only the benchmarks over
the threshold, so a real regression has to show up each time, while this 2-core VM's
run-to-run spread, up to ~30% on a few medians of an unchanged tree, rarely strikes the same
benchmark twice). Prints one row per benchmark; writes the node ids still over the
threshold to ``--failing`` (one per line); exits 1 if any benchmark regressed, 2 when a run
shares no benchmark with the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys


def medians(path: str) -> dict[str, float]:
    with open(path) as f:
        data = json.load(f)
    return {b["fullname"]: b["stats"]["median"] for b in data["benchmarks"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("baseline")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--threshold", type=float, default=10.0, help="percent (default 10)")
    parser.add_argument("--failing", help="write the regressed node ids here")
    args = parser.parse_args(argv)
    base = medians(args.baseline)
    best: dict[str, float] = {}  # lowest median of each benchmark over the runs
    for run in args.runs:
        for name, value in medians(run).items():
            best[name] = min(value, best.get(name, value))
    shared = sorted(set(base) & set(best))
    if not shared:
        print("no benchmark of these runs is in the baseline", file=sys.stderr)
        return 2
    limit = 1.0 + args.threshold / 100.0
    failing = [name for name in shared if best[name] > limit * base[name]]
    width = max(len(name) for name in shared)
    print(f"{'benchmark':{width}s}  baseline median  best median  change")
    for name in shared:
        change = best[name] / base[name] - 1.0
        flag = "  REGRESSED" if name in failing else ""
        print(
            f"{name:{width}s}  {base[name] * 1e3:12.3f} ms  {best[name] * 1e3:8.3f} ms  "
            f"{change:+7.1%}{flag}"
        )
    missing = sorted(set(base) - set(best))
    if missing:
        print(
            f"({len(missing)} baseline benchmarks not run: {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})"
        )
    if args.failing:
        with open(args.failing, "w") as f:
            f.write("".join(name + "\n" for name in failing))
    print(
        f"{len(failing)} of {len(shared)} medians over +{args.threshold:g}% "
        f"(best of {len(args.runs)} run(s) each)"
    )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
