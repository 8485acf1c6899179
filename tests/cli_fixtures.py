"""Fixtures shared by the demo's tests (test_demo.py) and the command line's (test_cli.py):
one torch thread, the environment ``main(["demo"])`` sets, the real SmolLM2's directory."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One torch thread: the demo's ops are small and latency-bound, and OpenMP's hand-offs
    cost more than they do when other processes share the CPUs (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def cli_environment(monkeypatch):
    """``main(["demo"])`` sets these when unset; set here, they are restored after each test."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def model_dir():
    from genlm_fast.models import smollm2_path

    return smollm2_path(quiet=True)
