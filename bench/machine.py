"""What a results file records about the machine and the code it ran: the commit, the CPU,
the versions of the libraries compared. Shared by the benchmarks under bench/ and tools/gpu/.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def git(*args) -> str:
    """stdout of `git *args` in the repository ("" when git fails or is missing)."""
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "none (no commit yet)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" (+ uncommitted changes)" if dirty else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """One line for a results file's header: date, commit, CPU, CPUs, torch and its threads,
    load average."""
    return (
        f"{datetime.date.today()}, commit {git_commit()}, {cpu_model()}, {os.cpu_count()} "
        f"CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    from genlm_fast.ops import dispatch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git commit": git_commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "OMP_NUM_THREADS / OMP_WAIT_POLICY": " / ".join(
            os.environ.get(k, "unset") for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": dist_version("numba"),
        "genlm-backend": dist_version("genlm-backend"),
        "genlm-bytes": dist_version("genlm-bytes"),
        "genlm_fast cpu backends": ", ".join(dispatch.available_backends("cpu")),
        "load average (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
