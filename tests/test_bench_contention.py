"""bench/contention.py end to end at a small size: both workers (genlm_fast and genlm-backend's
numba trie) beside the competing LM program, with genlm_fast held to one thread. What it
checks comes from outside the benchmark's own figures: the workers' torch settings, and the
competitor's own CPU time as /proc saw it (not the machine's load, which anything raises)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="the competitors share the machine's CPUs: it needs two",
)
def test_trie_beside_the_lm_program_with_genlm_fast_on_one_thread(tmp_path):
    out = tmp_path / "contention.md"
    args = ["--workloads", "trie-sum-B1", "--conditions", "idle,lm-program"]
    args += ["--seconds", "0.2", "--block", "0.1", "--min-calls", "1", "--fast-threads", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.contention", *args, "--out", str(out)],
        cwd=REPO,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    # a goal not met is the run's finding (GOALS_NOT_MET), not a failure to run; any other
    # status (an uncaught exception exits with 1) fails
    from bench.contention import GOALS_NOT_MET

    assert proc.returncode in (0, GOALS_NOT_MET), proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["info"]["genlm_fast's torch threads"] == "1 in every condition"
    for condition in ("idle", "lm-program"):
        reading = data["readings"][condition]["trie-sum-B1"]
        assert reading["torch_threads"] == 1, reading  # --fast-threads held it
    # the competitor ran: its own CPU time (from /proc, whatever else loads the machine);
    # none where there is none
    competitors = data["competitors"]
    assert competitors["idle"]["cpu_seconds"] == 0.0
    assert competitors["lm-program"]["cpu_seconds"] > 0.05, competitors
    for row in data["rows"]:
        for condition, cell in row["cells"].items():
            assert cell["calls"] >= 1 and cell["mean_ms"] > 0, (row["side"], condition)
    assert "lm-program" in out.read_text()
