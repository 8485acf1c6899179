"""The outcome comparison of scripts/test_genlm_suites.sh (scripts/genlm_suite_outcomes.py):
on made-up outcome files, every way a drop-in run can fall short fails it."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import genlm_suite_outcomes as G  # noqa: E402

SUITE = "toy-suite"
FILES = {"tests/test_a.py": 3, "tests/test_b.py": 2}


@pytest.fixture(autouse=True)
def minimum(monkeypatch):
    monkeypatch.setitem(G.MINIMUM_PASSED, SUITE, {"": 4, **{f: n - 1 for f, n in FILES.items()}})


def _real_modules():
    return {
        name: {"name": name, "file": f"/site-packages/{name.replace('.', '/')}/__init__.py"}
        for name in G.ALIASED
    }


def _dropin_modules():
    return {
        name: {
            "name": name.replace("genlm.", "genlm_fast.", 1),
            "file": os.path.join(G.GENLM_FAST_DIR, name.split(".")[1], "__init__.py"),
        }
        for name in G.ALIASED
    }


def _outcomes(change=None):
    out = {f"{f}::test_{i}": "passed" for f, n in FILES.items() for i in range(n)}
    out.update(change or {})
    return out


def _write(path, outcomes, modules):
    path.write_text(json.dumps({"outcomes": outcomes, "messages": {}, "modules": modules}))
    return str(path)


def _compare(tmp_path, real=None, dropin=None, real_modules=None, dropin_modules=None):
    if real_modules is None:
        real_modules = _real_modules()
    if dropin_modules is None:
        dropin_modules = _dropin_modules()
    real_path = _write(tmp_path / "real.json", real or _outcomes(), real_modules)
    dropin_path = _write(tmp_path / "dropin.json", dropin or _outcomes(), dropin_modules)
    return G.compare(SUITE, real_path, dropin_path, str(tmp_path / "regressed.txt"))


def test_alike_runs_pass(tmp_path, capsys):
    assert _compare(tmp_path) == 0, capsys.readouterr().out


def test_a_test_skipped_only_on_the_dropin_side_fails(tmp_path, capsys):
    node = "tests/test_a.py::test_0"
    assert _compare(tmp_path, dropin=_outcomes({node: "skipped"})) == 1
    assert f"FAILED ONLY ON genlm_fast: {node}  (skipped)" in capsys.readouterr().out
    assert (tmp_path / "regressed.txt").read_text() == node + "\n"


def test_a_test_failing_on_both_sides_is_not_required(tmp_path):
    both = _outcomes({"tests/test_b.py::test_x": "failed"})
    assert _compare(tmp_path, real=both, dropin=both) == 0


@pytest.mark.parametrize("side", ["real", "dropin"])
def test_a_missing_outcomes_file_fails(tmp_path, capsys, side):
    real = _write(tmp_path / "real.json", _outcomes(), _real_modules())
    dropin = _write(tmp_path / "dropin.json", _outcomes(), _dropin_modules())
    os.remove(real if side == "real" else dropin)
    assert G.compare(SUITE, real, dropin, None) == 1
    assert f"NO OUTCOMES ({side})" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["tests/test_a.py", "tests/test_b.py", "the suite"])
def test_too_few_passes_fail_even_when_both_sides_agree(tmp_path, capsys, where):
    if where == "the suite":  # every file at its minimum, the suite below its own
        G.MINIMUM_PASSED[SUITE][""] = 6
        fewer = _outcomes()
    else:
        fewer = _outcomes({f"{where}::test_0": "failed", f"{where}::test_1": "failed"})
    assert _compare(tmp_path, real=fewer, dropin=fewer) == 1
    out = capsys.readouterr().out
    assert f"TOO FEW PASSED (real): {where}" in out and f"TOO FEW PASSED (dropin): {where}" in out


def test_a_file_without_a_minimum_fails(tmp_path, capsys):
    extra = _outcomes({"tests/test_new.py::test_0": "passed"})
    assert _compare(tmp_path, real=extra, dropin=extra) == 1
    assert "NO MINIMUM (real): tests/test_new.py" in capsys.readouterr().out


def test_a_dropin_run_on_the_real_packages_fails(tmp_path, capsys):
    """The import hook failed silently: both runs tested genlm, and agree."""
    assert _compare(tmp_path, dropin_modules=_real_modules()) == 1
    out = capsys.readouterr().out
    assert "WRONG MODULE (dropin): genlm.backend" in out
    assert "WRONG MODULE (dropin): genlm.bytes" in out


def test_a_dropin_run_on_another_checkouts_genlm_fast_fails(tmp_path, capsys):
    elsewhere = {
        name: dict(m, file="/elsewhere" + m["file"]) for name, m in _dropin_modules().items()
    }
    assert _compare(tmp_path, dropin_modules=elsewhere) == 1
    assert "WRONG MODULE (dropin)" in capsys.readouterr().out


def test_a_real_run_on_genlm_fast_fails(tmp_path, capsys):
    assert _compare(tmp_path, real_modules=_dropin_modules()) == 1
    assert "WRONG MODULE (real)" in capsys.readouterr().out


def test_a_run_that_recorded_no_modules_fails(tmp_path, capsys):
    assert _compare(tmp_path, dropin_modules={}) == 1
    assert "nothing recorded" in capsys.readouterr().out


@pytest.mark.parametrize("hook", [False, True])
def test_the_recorder_reads_what_the_imports_resolve_to(hook):
    """resolved_modules() in a fresh interpreter, with and without the drop-in hook."""
    import subprocess

    code = (
        "import genlm_fast.dropin\n" if hook else ""
    ) + "import json, genlm_suite_outcomes as G\nprint(json.dumps(G.resolved_modules()))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "scripts")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert G._wrong_modules("dropin" if hook else "real", modules) == []
    assert G._wrong_modules("real" if hook else "dropin", modules) != []


@pytest.mark.parametrize("applies", [True, False])
def test_a_known_difference_is_accepted_only_where_it_applies_and_as_named(
    tmp_path, monkeypatch, applies
):
    nodeid = "tests/test_a.py::test_0"
    monkeypatch.setitem(
        G.KNOWN_DIFFERENCES,
        nodeid,
        (G.KNOWN_DIFFERENCES["tests/test_hf_llm.py::test_caching"][0], "why", lambda: applies),
    )
    real_path = _write(tmp_path / "real.json", _outcomes(), _real_modules())

    def dropin(message):
        path = tmp_path / "dropin.json"
        path.write_text(
            json.dumps(
                {
                    "outcomes": _outcomes({nodeid: "failed"}),
                    "messages": {nodeid: message},
                    "modules": _dropin_modules(),
                }
            )
        )
        return str(path)

    caching_failure = (
        "/x/tests/test_hf_llm.py:81: AssertionError: np.float64(6.2e-07)\n"
        "assert np.float64(6.2e-07) == 0"
    )
    named = G.compare(SUITE, real_path, dropin(caching_failure), None)
    assert named == (0 if applies else 1)
    # another failure of the same test still counts
    assert G.compare(SUITE, real_path, dropin("t.py:74: AssertionError: 17"), None) == 1
