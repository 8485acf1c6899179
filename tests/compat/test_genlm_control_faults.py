"""Faults in genlm-control programs on genlm_fast: the error reaches the caller, nothing
hangs, the model stays usable.

The scenarios run in their own interpreter under ``genlm_fast.dropin``
(``_genlm_faults_job.py``: a potential that raises, a cancelled token-level and byte-level
run, a model closed under both). "Usable" is checked against the program's own clean run:
after each fault the getting-started regex program, seeded alike, must give exactly the
particles, weights and scores it gave before any fault, with no query left waiting.
About 30 s on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import genlm.control  # noqa: F401  (installed by scripts/setup.sh: never skipped)
import pytest

from bench.workers import child_env
from tests.compat import _genlm_faults_job as job

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "faults.json"
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", job.__file__, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def test_ran_on_genlm_fast(faults):
    assert faults["backend"].startswith("genlm_fast.backend")
    assert faults["clean"]["particles"]


def _check(record, errors):
    assert record["error"] in errors, record
    assert record["seconds"] < job.WAIT / 2, record  # answered, not timed out
    assert record["pending_after"] == 0, record
    assert record["same_as_clean"], record


def test_a_raising_potential_reaches_the_caller(faults):
    record = faults["raising_potential"]
    _check(record, {"RuntimeError"})
    assert "the condition broke" in record["message"]


@pytest.mark.parametrize("program", ["readme_regex", "bytellm_awrs"])
def test_a_cancelled_run(faults, program):
    _check(faults[f"cancelled_{program}"], {"CancelledError"})


@pytest.mark.parametrize("program", ["readme_regex", "bytellm_awrs"])
def test_a_model_closed_under_a_running_sampler(faults, program):
    record = faults[f"closed_{program}"]
    _check(record, {"ModelClosedError", "QueriesResetError"})
    assert record["closed_pending_after"] == 0, record  # nothing left in the closed one
    assert "clean" in record["message"] or "closed" in record["message"], record
