"""scripts/bench_compare.py: the median regression rule of scripts/bench_regress.sh."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "bench_compare", os.path.join(REPO, "scripts", "bench_compare.py")
)
bench_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_compare)


def write(tmp_path, name, medians):
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "benchmarks": [
                    {"fullname": k, "stats": {"median": v, "min": v * 0.9}}
                    for k, v in medians.items()
                ]
            }
        )
    )
    return str(path)


@pytest.fixture
def baseline(tmp_path):
    return write(tmp_path, "base.json", {"a": 1.0, "b": 2.0, "c": 0.5})


def run(baseline, runs, tmp_path, threshold=10):
    failing = tmp_path / "failing"
    rc = bench_compare.main(
        [baseline, *runs, "--threshold", str(threshold), "--failing", str(failing)]
    )
    return rc, failing.read_text().split() if failing.exists() else None


def test_within_threshold_passes(baseline, tmp_path):
    r1 = write(tmp_path, "r1.json", {"a": 1.09, "b": 1.5, "c": 0.5})
    assert run(baseline, [r1], tmp_path) == (0, [])


def test_regression_is_reported_with_its_node_id(baseline, tmp_path):
    r1 = write(tmp_path, "r1.json", {"a": 1.11, "b": 2.0, "c": 0.8})
    assert run(baseline, [r1], tmp_path) == (1, ["a", "c"])


def test_a_regression_must_show_in_every_run(baseline, tmp_path):
    r1 = write(tmp_path, "r1.json", {"a": 1.5, "b": 2.0, "c": 0.8})
    r2 = write(tmp_path, "r2.json", {"a": 1.05, "c": 0.7})  # a recovers, c does not
    assert run(baseline, [r1, r2], tmp_path) == (1, ["c"])
    r3 = write(tmp_path, "r3.json", {"c": 0.54})
    assert run(baseline, [r1, r2, r3], tmp_path) == (0, [])


def test_threshold_is_configurable(baseline, tmp_path):
    r1 = write(tmp_path, "r1.json", {"a": 1.15, "b": 2.0, "c": 0.5})
    assert run(baseline, [r1], tmp_path, threshold=20) == (0, [])
    assert run(baseline, [r1], tmp_path, threshold=10) == (1, ["a"])


def test_no_shared_benchmark_is_an_error(baseline, tmp_path):
    r1 = write(tmp_path, "r1.json", {"zzz": 1.0})
    assert run(baseline, [r1], tmp_path)[0] == 2
