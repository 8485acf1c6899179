"""genlm-control 0.4.1's own example programs (`bench.programs`) on genlm and on genlm_fast.

Each program of its getting-started guide, README and ``ByteLLM`` docstring runs once on the
real genlm-backend / genlm-bytes and once on genlm_fast through ``genlm_fast.dropin``, each
implementation in a worker process of its own that loads SmolLM2 once
(`bench.genlm_programs.Workers`, the benchmark's workers). Both runs are seeded alike.

Checked, for every program: every particle satisfies the program's constraint (checked
with ``regex`` / ``json`` + ``jsonschema``, not with genlm-control's potentials), on both;
the deterministic parts agree: the log probabilities the programs' potentials give to a
fixed context (``prefix``, token level within 2e-3 nats, byte level within 5e-3, as in
test_genlm_control.py), and, where both runs drew the same particles, their SMC log
weights (summed over up to 25 steps: within 2e-2 token level, 5e-2 byte level). Both runs
seed every random source alike, so they draw the same particles unless a draw falls within
the implementations' rounding of a decision boundary: all programs but at most one must.

The two implementations' workers load and run each program at the same time (outcomes
only; the benchmark times them one by one). The faults (a potential that raises, a
cancelled run, a model closed under a sampler) are in test_genlm_control_faults.py.
"""

from __future__ import annotations

import math

import genlm.control  # noqa: F401  (installed by scripts/setup.sh: never skipped)
import numpy as np
import pytest

from bench import programs as P
from bench.genlm_programs import Workers

# the fixture loads the model twice and runs every program on both sides
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SEED = 0
BYTE_LEVEL = {"bytellm_prefix", "bytellm_awrs"}


def _tolerance(program):
    byte = program in BYTE_LEVEL
    return {"score": 5e-3 if byte else 2e-3, "weight": 5e-2 if byte else 2e-2}


@pytest.fixture(scope="module")
def runs():
    """``{program: {impl: reply}}``, one seeded run of each program on each side."""
    with Workers() as workers:
        assert workers.info["genlm"]["lm"].startswith("genlm.backend.")
        assert workers.info["genlm_fast"]["lm"].startswith("genlm_fast.backend.")
        replies = {}
        for program in P.PROGRAMS:
            for impl in workers.procs:
                workers.submit(impl, program, SEED)
            replies[program] = {impl: workers.receive(impl, program) for impl in workers.procs}
        return replies


def _same_particles(runs, program):
    a, b = runs[program]["genlm_fast"], runs[program]["genlm"]
    return [t for t, _ in a["outcome"]["particles"]] == [t for t, _ in b["outcome"]["particles"]]


@pytest.mark.parametrize("program", list(P.PROGRAMS))
def test_program_holds_its_constraint_on_both(runs, program):
    for impl, reply in runs[program].items():
        assert reply["violations"] == [], (impl, reply["violations"])
        particles = reply["outcome"]["particles"]
        if program != "bytellm_prefix":
            assert particles, impl
            assert any(math.isfinite(w) for _, w in particles), f"{impl}: every particle died"


@pytest.mark.parametrize("program", list(P.PROGRAMS))
def test_program_agrees_with_genlm(runs, program):
    mine, theirs = runs[program]["genlm_fast"], runs[program]["genlm"]
    tol = _tolerance(program)
    assert mine["outcome"]["scores"].keys() == theirs["outcome"]["scores"].keys()
    assert mine["outcome"]["scores"], "a program with nothing deterministic to compare"
    for key, want in theirs["outcome"]["scores"].items():
        have = mine["outcome"]["scores"][key]
        assert math.isfinite(want), key
        assert have == pytest.approx(want, abs=tol["score"]), key
    a, b = mine["outcome"]["particles"], theirs["outcome"]["particles"]
    if _same_particles(runs, program):  # how often: test_programs_drew_the_same_particles
        wa, wb = np.array([w for _, w in a]), np.array([w for _, w in b])
        np.testing.assert_array_equal(np.isfinite(wa), np.isfinite(wb))
        finite = np.isfinite(wb)
        np.testing.assert_allclose(wa[finite], wb[finite], rtol=0, atol=tol["weight"])


def test_programs_drew_the_same_particles(runs):
    """The SMC weights above are compared only where both sides drew the same particles:
    that must be (nearly) every program, or the comparison could pass having compared none."""
    differ = [program for program in P.PROGRAMS if not _same_particles(runs, program)]
    assert len(differ) <= 1, f"different particles drawn in {differ}"
