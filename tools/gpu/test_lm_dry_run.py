"""``python -m tools.gpu.lm --dry-run-cpu``: the GPU LM benchmark's code path, on CPU.

Device time is rare; the script must not fail there for a reason a CPU run could have
shown. The dry run builds SmolLM2's architecture (2 layers) with random weights, runs the
SMC workload on both backends against a float64 forward, and times the decoding forward
(no CUDA graph on CPU).
"""

from __future__ import annotations

import re

import pytest

from tools.gpu import lm


@pytest.mark.slow
def test_dry_run_checks_both_backends_and_writes_the_table(tmp_path):
    out = tmp_path / "lm.md"
    assert lm.main(["--dry-run-cpu", "--out", str(out)]) == 0
    text = out.read_text()
    rows = re.findall(
        r"^\| (genlm_fast|genlm-backend) \| (plain|cache_kv) \|.* \| (\S+) \|$", text, re.M
    )
    assert {(side, config) for side, config, _ in rows} == {
        (side, config)
        for side in ("genlm_fast", "genlm-backend")
        for config in ("plain", "cache_kv")
    }
    # every side answered the same queries as a float64 forward of the same weights
    assert all(float(err) < lm.TOL for _, _, err in rows)
    forwards = re.findall(r"^\| (float32|bfloat16) \| (\d+) \| ([\d.]+) \| not on CPU", text, re.M)
    assert [(dtype, int(rows)) for dtype, rows, _ in forwards] == [
        ("float32", 1),
        ("float32", 4),
        ("bfloat16", 1),
        ("bfloat16", 4),
    ]
    assert all(float(ms) > 0 for _, _, ms in forwards)
