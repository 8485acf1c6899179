"""genlm-control 0.4.1 on genlm_fast, with the real SmolLM2 model.

genlm-control's token-level potential (``PromptedLLM``) and byte-level potential (``ByteLLM``,
genlm-bytes' beam) run under ``genlm_fast.dropin`` and, as the independent reference, on the
real genlm-backend / genlm-bytes packages: each in its own interpreter
(``_genlm_control_job.py``), so the import hook never meets the real packages. The drop-in
run's SMC samples (AWRS sampler, constrained by a regular expression) are then scored by the
reference run as well.

Tolerances (absolute, in nats), set about 10x above what the two implementations differ by
on this model (token level 6e-5, byte level 2e-4: the byte-level beam sums several tokens'
log-probabilities, each computed by a different forward pass):
  - next-token log-weights: 1e-3 (token level), 2e-3 (byte level), on every finite entry;
    the same entries are -inf on both sides, and the greedy choice is the same;
  - log-probabilities of whole sequences (``prefix``/``complete``, and the SMC log weights
    when both runs drew the same particles): 2e-3 (token), 5e-3 (byte).
The whole module costs two model loads and about 1.5 minutes on a 2-core CPU (the drop-in
run about 30 s, the reference run about 55 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# genlm-control (and regex, its dependency for partial matches) and the real genlm-backend
# and genlm-bytes, the references: all installed by scripts/setup.sh, never skipped
import genlm.backend  # noqa: F401
import genlm.bytes  # noqa: F401
import genlm.control  # noqa: F401
import numpy as np
import pytest
import regex

from bench.workers import child_env
from tests.compat import _genlm_control_job as job

# the fixture runs two jobs, each loading the model (up to 900 s each)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = {"token": {"logw": 1e-3, "sequence": 2e-3}, "byte": {"logw": 2e-3, "sequence": 5e-3}}
REGEX = {"token": job.TOKEN_REGEX, "byte": job.BYTE_REGEX}


def _run_job(out_dir, *args):
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", job.__file__, str(out_dir), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_dir / "result.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"dropin": result, "real": result}`` plus their output folders."""
    dropin_dir = tmp_path_factory.mktemp("genlm_control_dropin")
    real_dir = tmp_path_factory.mktemp("genlm_control_real")
    dropin = _run_job(dropin_dir, "--dropin")
    real = _run_job(real_dir, "--score", str(dropin_dir / "result.json"))
    return {"dropin": dropin, "real": real, "dirs": {"dropin": dropin_dir, "real": real_dir}}


def _text(hex_context):
    return b"".join(bytes.fromhex(h) for h in hex_context if h != "EOS")


def test_each_run_used_the_intended_implementation(runs):
    assert runs["dropin"]["backend_module"].startswith("genlm_fast.backend")
    assert runs["dropin"]["bytes_module"].startswith("genlm_fast.bytes")
    assert runs["real"]["backend_module"].startswith("genlm.backend")
    assert runs["real"]["bytes_module"].startswith("genlm.bytes")


@pytest.mark.parametrize("level", ["token", "byte"])
def test_next_token_weights_match_the_real_packages(runs, level):
    dropin, real = runs["dropin"][level], runs["real"][level]
    assert [g["token"] for g in dropin["greedy"]] == [g["token"] for g in real["greedy"]]
    tags = [f"{level}_{i}" for i in range(len(real["greedy"]))]
    if level == "token":
        tags.append("token_batch")  # batch_logw_next of two contexts
    for tag in tags:
        have = np.load(runs["dirs"]["dropin"] / f"{tag}.npy")
        want = np.load(runs["dirs"]["real"] / f"{tag}.npy")
        assert have.shape == want.shape, tag
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(have), finite, err_msg=tag)
        np.testing.assert_array_equal(have[~finite], want[~finite], err_msg=tag)  # -inf: both
        np.testing.assert_allclose(
            have[finite], want[finite], rtol=0, atol=TOLERANCE[level]["logw"], err_msg=tag
        )
    for key in ("greedy_prefix", "greedy_complete"):
        assert dropin[key] == pytest.approx(real[key], abs=TOLERANCE[level]["sequence"]), key


@pytest.mark.parametrize("level", ["token", "byte"])
def test_smc_samples_are_valid_and_scored_alike(runs, level):
    dropin, real = runs["dropin"][level], runs["real"][level]
    pattern = REGEX[level]
    for result in (dropin, real):  # the reference's own samples validate the setup
        contexts, log_weights = result["smc"]["contexts"], result["smc"]["log_weights"]
        assert len(contexts) == len(log_weights) > 0
        assert any(np.isfinite(log_weights)), "every particle died"
        for context, log_weight in zip(contexts, log_weights):
            text = _text(context).decode("utf-8", errors="strict")
            # every particle spells a prefix of a match; a finished live one, a whole match
            assert regex.fullmatch(pattern, text, partial=True), text
            if context and context[-1] == "EOS" and np.isfinite(log_weight):
                assert regex.fullmatch(pattern, text), text
    # the drop-in's samples, scored by genlm_fast and by the real packages
    np.testing.assert_allclose(
        dropin["smc_scores"], real["other_smc_scores"], rtol=0, atol=TOLERANCE[level]["sequence"]
    )
    # both runs seed their RNGs alike, so they draw the same particles unless a draw falls
    # within ~1e-4 of a decision boundary (test_smc_runs_drew_the_same_particles requires
    # that they did); then their SMC log weights must agree too
    if dropin["smc"]["contexts"] == real["smc"]["contexts"]:
        np.testing.assert_allclose(
            dropin["smc"]["log_weights"],
            real["smc"]["log_weights"],
            rtol=0,
            atol=TOLERANCE[level]["sequence"],
        )


def test_smc_runs_drew_the_same_particles(runs):
    """The SMC log weights above are compared only where both runs drew the same particles;
    with two levels, each seeded alike, both must have, or that comparison may never run."""
    differ = [
        level
        for level in ("token", "byte")
        if runs["dropin"][level]["smc"]["contexts"] != runs["real"][level]["smc"]["contexts"]
    ]
    assert differ == [], f"different particles drawn at the {differ} level"
