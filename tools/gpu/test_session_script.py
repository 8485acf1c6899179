"""tools/gpu/session.sh's test runner, on CPU: GPU sessions are rare and short, so the way
it survives a test that kills the interpreter (the CUDA-built extension segfaulted once)
must be shown to work here. A crash costs only the tests not yet run, every crash is
reported, and the run still fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CRASHING_TESTS = """
import ctypes
import pytest

@pytest.mark.parametrize("i", range(3))
def test_a_before(i):
    pass

def test_b_crashes():
    ctypes.string_at(0)  # SIGSEGV

def test_c_between():
    pass

def test_d_crashes_too():
    ctypes.string_at(0)

def test_e_last():
    pass

def test_f_fails():
    assert 1 + 1 == 3, "a failure's report is kept"
"""


def stand_in(tmp_path, name: str, body: str) -> Path:
    """A folder holding an executable ``name`` that runs the shell line ``body`` in place of
    the real tool: put it first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash script, Linux signals")
def test_a_crash_costs_only_the_tests_not_yet_run(tmp_path):
    (tmp_path / "tools").symlink_to(REPO / "tools")  # the runner's cwd is the repo's root
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_demo.py").write_text(CRASHING_TESTS)
    out = tmp_path / "out"
    out.mkdir()
    script = (REPO / "tools" / "gpu" / "session.sh").read_text()
    run_tests = script[script.index("native_stack() {") : script.index("\nrun_bench() {")]
    # a gdb that does nothing: the real one would rerun each crash (slow, not what is tested)
    bin_dir = stand_in(tmp_path, "gdb", "exit 0")
    env = {
        **os.environ,
        "OUT": str(out),
        "PY": sys.executable,
        "TEST_PATHS": "tests",
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        ["bash", "-c", run_tests + "\nrun_tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log  # two crashed, one failed
    assert "test_demo.py::test_b_crashes killed pytest" in log
    assert "test_demo.py::test_d_crashes_too killed pytest" in log
    done = (out / "tests-done.txt").read_text().split()
    # each test ran exactly once, in three attempts, the crashing ones excepted
    assert sorted(done) == sorted(
        f"tests/test_demo.py::{t}"
        for t in (
            "test_a_before[0]",
            "test_a_before[1]",
            "test_a_before[2]",
            "test_c_between",
            "test_e_last",
            "test_f_fails",
        )
    )
    assert (out / "tests-ops-3.xml").exists()
    # failures are kept as they happen (a run stopped by its timeout prints no summary)
    failures = (out / "tests-done.txt.failures").read_text()
    assert "=== tests/test_demo.py::test_f_fails (call)" in failures
    assert "a failure's report is kept" in failures
    assert failures.count("===") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash script, Linux signals")
def test_without_gdb_the_crash_report_has_the_native_stack(tmp_path):
    """The GPU machine may have no gdb: tools/gpu/segv_stack.c (built with cc, preloaded)
    puts the C stack of the crashing test into crash.txt, after the Python one."""
    script = (REPO / "tools" / "gpu" / "session.sh").read_text()
    native_stack = script[script.index("native_stack() {") : script.index("\nrun_tests() {")]
    (tmp_path / "tools").symlink_to(REPO / "tools")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_demo.py").write_text(CRASHING_TESTS)
    env = {**os.environ, "PY": sys.executable, "GDB": "no-such-gdb"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        ["bash", "-c", native_stack + "\nnative_stack tests/test_demo.py::test_b_crashes"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = proc.stdout
    assert "Fatal Python error: Segmentation fault" in report, proc.stdout + proc.stderr
    assert 'test_demo.py", line 10 in test_b_crashes' in report  # the Python stack
    stack = report[report.index("== native stack") :]
    assert "_ctypes" in stack and "libpython" in stack, stack  # the C frames down to ctypes


def test_outputs_come_back_as_at_most_8_files(tmp_path):
    """The runner brings back 8 files: the session leaves the table, the test log,
    env.txt and crash.txt as they are and packs the rest (a dozen files after `all`) into
    logs.tar.gz, their contents intact."""
    import tarfile

    script = (REPO / "tools" / "gpu" / "session.sh").read_text()
    bundle = script[script.index("bundle_outputs() {") : script.index("\ntrap bundle_outputs")]
    out = tmp_path / "out"
    out.mkdir()
    kept = ["gpu-2026-11-26.md", "tests-ops.log", "env.txt", "crash.txt"]
    packed = [
        "install.log",
        "bench-gpu.log",
        "sm90-compile.txt",
        "ncu-log_mass-B64.txt",
        "ncu-sum-B32.txt",
        "tests-done.txt",
        "tests-done.txt.failures",
        "tests-ops-1.xml",
        "tests-ops-2.xml",
    ]
    for name in kept + packed:
        (out / name).write_text(f"contents of {name}\n")
    proc = subprocess.run(
        ["bash", "-c", bundle + "\nbundle_outputs"],
        cwd=tmp_path,
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["logs.tar.gz"])
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(packed)
        assert tar.extractfile("ncu-sum-B32.txt").read() == b"contents of ncu-sum-B32.txt\n"


def test_profile_skips_two_calls_of_each_shape_and_keeps_the_caches_for_the_traffic(tmp_path):
    """run_profile's ncu selections, with an ncu that only prints its arguments: the third
    call of each shape is the one profiled (the first two are warm-up), which takes skipping
    two calls' worth of the selected kernels: 3 a call (row pass, tile, span) for the
    sections, and with the lse merge (log_mass) 4 for the DRAM traffic, which runs with the
    caches left as the kernels before left them; the stall reasons of log_mass's tile and
    span kernels (2 a call)."""
    script = (REPO / "tools" / "gpu" / "session.sh").read_text()
    run_profile = script[script.index("run_profile() {") : script.index("\nrun_bench() {")]
    bin_dir = stand_in(tmp_path, "ncu", 'echo "$@"')
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "PY": "python3",
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(
        ["bash", "-c", run_profile + "\nrun_profile"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def args(name):
        return (out / name).read_text().split()

    for name, skip, count, kernels in (
        ("ncu-log_mass-B64.txt", 6, 3, "row_pass|tile_kernel|span_kernel"),
        ("ncu-sum-B32.txt", 6, 3, "row_pass|tile_kernel|span_kernel"),
        ("ncu-pipeline-log_mass-B64.txt", 8, 4, "row_pass|row_lse_merge|tile_kernel|span_kernel"),
        ("ncu-pipeline-sum-B32.txt", 6, 3, "row_pass|row_lse_merge|tile_kernel|span_kernel"),
    ):
        a = args(name)
        assert a[a.index("--launch-skip") + 1] == str(skip), (name, a)
        assert a[a.index("--launch-count") + 1] == str(count), (name, a)
        assert a[a.index("--kernel-name") + 1] == f"regex:{kernels}", (name, a)
        assert ("--cache-control" in a) == ("pipeline" in name), (name, a)
        op, batch = name.split("-")[-2], name.split("-B")[-1].split(".")[0]
        assert a[-4:] == ["--op", op, "--batch", batch], (name, a)
    assert "dram__bytes_write.sum" in " ".join(args("ncu-pipeline-sum-B32.txt"))
    # the stall reasons: the tile and span kernels of log_mass B=64's third call
    a = args("ncu-stalls-log_mass-B64.txt")
    assert a[a.index("--launch-skip") + 1] == "4" and a[a.index("--launch-count") + 1] == "2"
    assert a[a.index("--kernel-name") + 1] == "regex:tile_kernel|span_kernel"
    assert "issue_stalled" in a[a.index("--metrics") + 1] and "--cache-control" not in a
    assert a[-4:] == ["--op", "log_mass", "--batch", "64"]
