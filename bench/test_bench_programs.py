"""genlm-control's example programs (`bench.programs`): genlm_fast vs genlm, on SmolLM2.

    python -m pytest bench/test_bench_programs.py --benchmark-only -s
    python -m pytest bench --benchmark-only --bench-regress        # genlm_fast's side only

One benchmark per program (group ``genlm-program-<name>``), timing genlm_fast's run of it.
Each implementation runs in its own worker process (`bench.genlm_programs.Workers`: the
model is loaded once there, untimed); a program's timed rounds alternate with genlm's own
rounds (pytest-benchmark's untimed ``setup`` runs genlm's), so a burst of load on the
machine falls on both alike. Every run starts from emptied LM caches, every random source
seeded (`bench.programs.run_program`), and each side gets one untimed warm-up run first.
genlm's best round and the ratio go into the benchmark's ``extra_info``; the module prints
the side-by-side table (best rounds) when it finishes. Checked: every particle satisfies its
program's constraint on both sides. Under ``--bench-regress`` only genlm_fast runs.

For the report with the time profile (and a plot) use ``python -m bench.genlm_programs``.

Environment:
    GENLM_FAST_BENCH_ROUNDS   timed rounds per program (default 3).
"""

from __future__ import annotations

import os

import pytest

from bench import genlm_programs as G
from bench import programs as P

ROUNDS = int(os.environ.get("GENLM_FAST_BENCH_ROUNDS", "3"))
SEED = 0

_results = {}


@pytest.fixture(scope="module")
def workers(request):
    regress = request.config.getoption("--bench-regress")
    with G.Workers(("genlm_fast",) if regress else G.IMPLS) as pool:
        yield pool
    if _results and "genlm" in pool.procs:
        print("\n" + G.report([dict(program=name, **row) for name, row in _results.items()]))


@pytest.mark.parametrize("program", list(P.PROGRAMS))
def test_program(benchmark, workers, program):
    benchmark.group = f"genlm-program-{program}"
    theirs = "genlm" in workers.procs
    replies = {"genlm": [], "genlm_fast": []}
    warm = {impl: workers.run(impl, program, SEED) for impl in workers.procs}  # untimed

    def genlm_round():
        if theirs:
            replies["genlm"].append(workers.run("genlm", program, SEED))

    def fast_round():
        replies["genlm_fast"].append(workers.run("genlm_fast", program, SEED))

    benchmark.pedantic(fast_round, setup=genlm_round, rounds=ROUNDS, iterations=1)
    for impl, runs in replies.items():
        for reply in runs:
            assert reply["violations"] == [], (impl, reply["violations"])
    row = {
        "genlm_fast": G.best(replies["genlm_fast"]),
        "genlm_fast_violations": [],
        "genlm_violations": [],
    }
    for impl, reply in warm.items():
        row[f"{impl}_first"] = reply["seconds"]
        row[f"{impl}_calls"] = f"{reply['lm_calls']} / {reply['lm_rows']}"
    benchmark.extra_info["genlm_fast_best_s"] = row["genlm_fast"]
    if theirs:
        row["genlm"] = G.best(replies["genlm"])
        row["speedup"] = row["genlm"] / row["genlm_fast"]
        row["same_particles"] = all(
            [p[0] for p in a["outcome"]["particles"]] == [p[0] for p in b["outcome"]["particles"]]
            for a, b in zip(replies["genlm"], replies["genlm_fast"])
        )
        benchmark.extra_info.update(genlm_best_s=row["genlm"], speedup=row["speedup"])
    _results[program] = row
