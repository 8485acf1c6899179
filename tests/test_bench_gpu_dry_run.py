"""``python -m bench.gpu --dry-run-cpu``: the GPU benchmark's whole code path, on CPU.

GPU sessions are rare and short; the script must not fail there for a reason a CPU run
could have shown. The dry run goes through vocabulary loading, trie and reference
construction, the verification of every backend against the float64 oracle (the script
exits 1 on a mismatch), timing and the markdown table, on the reference, cpu and Triton
interpreter backends with a small slice of the Llama-3 vocabulary, at B=1 and at the
batch size of the headline speedup.
"""

from __future__ import annotations

import pytest

from bench import gpu

pytestmark = pytest.mark.slow


def test_dry_run_verifies_times_and_writes_the_table(tmp_path):
    out = tmp_path / "gpu.md"
    status = gpu.main(["--dry-run-cpu", "--limit", "300",
                       "--batch-sizes", "1", str(gpu.SPEEDUP_B),
                       "--out", str(out)])
    assert status == 0
    text = out.read_text()
    for backend in ("reference", "cpu", "triton"):
        for op in gpu.OPS:
            for B in (1, gpu.SPEEDUP_B):
                assert f"| {backend} | {op} | {B} |" in text, (backend, op, B)
    assert "FAILED" not in text
    assert f"Speedup at B={gpu.SPEEDUP_B}" in text
    for backend in ("reference", "cpu", "triton"):  # the headline rows
        assert f"\n| {backend} | " in text.split(f"Speedup at B={gpu.SPEEDUP_B}")[1]
