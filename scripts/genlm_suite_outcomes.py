"""Record and compare test outcomes for scripts/test_genlm_suites.sh.

As a pytest plugin (``-p genlm_suite_outcomes``, with ``scripts/`` on ``PYTHONPATH``) it
writes ``{node id: outcome}`` to the JSON file named by ``GENLM_SUITE_OUTCOMES``. A test
counts as ``passed`` only when its call passed and neither its setup nor its teardown failed.

As a script it compares the outcomes of one suite run with the real genlm packages and
with ``-p genlm_fast.dropin``:

    python scripts/genlm_suite_outcomes.py compare NAME REAL.json DROPIN.json [REGRESSED.txt]

prints the counts and every node id that passed with the real packages but not on
genlm_fast, writes those ids (one a line) to REGRESSED.txt, and exits 1 if there is any.
"""

from __future__ import annotations

import json
import os
import sys

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.failed:
        _outcomes[nodeid] = "error" if report.when != "call" else "failed"
    elif report.skipped:
        _outcomes.setdefault(nodeid, "skipped")
    elif report.when == "call" and nodeid not in _outcomes:
        _outcomes[nodeid] = "passed"


def pytest_collectreport(report):
    if report.failed:  # a module that does not even import: none of its tests ran
        _outcomes[report.nodeid] = "collection error"


def pytest_sessionfinish(session):
    path = os.environ.get("GENLM_SUITE_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)


def _load(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def compare(name: str, real_path: str, dropin_path: str, regressed_path: str | None) -> int:
    real, dropin = _load(real_path), _load(dropin_path)
    passed_real = {n for n, o in real.items() if o == "passed"}
    passed_dropin = {n for n, o in dropin.items() if o == "passed"}
    regressed = sorted(passed_real - passed_dropin)
    print(f"{name}: passed real {len(passed_real)} / passed dropin {len(passed_dropin)} / "
          f"failed only on dropin {len(regressed)}  (collected: real {len(real)}, "
          f"dropin {len(dropin)})")
    for nodeid in regressed:
        print(f"  FAILED ONLY ON genlm_fast: {nodeid}  ({dropin.get(nodeid, 'not run')})")
    if regressed_path:
        with open(regressed_path, "w") as f:
            f.writelines(n + "\n" for n in regressed)
    if not real:
        print(f"  {name}: no outcomes recorded for the real packages", file=sys.stderr)
        return 1
    return 1 if regressed else 0


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6) or sys.argv[1] != "compare":
        sys.exit(__doc__)
    sys.exit(compare(*sys.argv[2:5], sys.argv[5] if len(sys.argv) == 6 else None))
