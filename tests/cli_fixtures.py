"""Fixtures shared by the demo's tests (test_demo.py) and the command line's (test_cli.py):
the environment ``main(["demo"])`` sets, the real SmolLM2's directory."""

import pytest


@pytest.fixture(autouse=True)
def cli_environment(monkeypatch):
    """``main(["demo"])`` sets these when unset; set here, they are restored after each test."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def model_dir():
    from genlm_fast.models import smollm2_path

    return smollm2_path(quiet=True)
