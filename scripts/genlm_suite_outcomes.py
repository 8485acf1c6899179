"""Record and compare test outcomes for scripts/test_genlm_suites.sh.

As a pytest plugin (``-p genlm_suite_outcomes``, with ``scripts/`` on ``PYTHONPATH``) it
writes ``{node id: outcome}`` to the JSON file named by ``GENLM_SUITE_OUTCOMES``. A test
counts as ``passed`` only when its call passed and neither its setup nor its teardown failed.

As a script it compares the outcomes of one suite run with the real genlm packages and
with ``-p genlm_fast.dropin``:

    python scripts/genlm_suite_outcomes.py compare NAME REAL.json DROPIN.json [REGRESSED.txt]

prints the counts and every node id that passed with the real packages but not on
genlm_fast, writes those ids (one a line) to REGRESSED.txt, and exits 1 if there is any,
or if fewer tests passed than ``MINIMUM_PASSED`` asks (of the suite, or of one of its
files), on either side: a suite whose models or fixtures stopped loading, or that collected
nothing, fails instead of comparing two empty runs. ``KNOWN_DIFFERENCES`` lists the tests
that demand what genlm_fast deliberately does otherwise; each is accepted only when it
fails at the assertion named there (any other failure of it still counts).
"""

from __future__ import annotations

import json
import os
import re
import sys

# Least number of passing tests, per suite ("" = the whole run) and per file that matters
# (what loads a model, the tries, the beam). About 90% of what passes offline with the
# stand-in models (scripts/make_hf_standins.py) with the default file selection.
MINIMUM_PASSED = {
    "genlm-backend": {
        "": 58,
        "tests/test_hf_llm.py": 14,
        "tests/test_trie.py": 14,
        "tests/test_token.py": 18,
        "tests/test_hf_lora.py": 2,
    },
    "genlm-bytes": {
        "": 104,
        "tests/test_beam.py": 13,
        "tests/test_healing.py": 13,
        "tests/test_trie.py": 20,
        "tests/test_util.py": 52,
    },
    "genlm-control": {
        "": 182,
        "tests/potential/test_llm.py": 24,
        "tests/potential/test_bytellm.py": 10,
        "tests/potential/test_canonical.py": 13,
        "tests/potential/test_ensemble.py": 70,
        "tests/test_setups.py": 9,
    },
}

# node id -> (pattern the failure's message must match, why genlm_fast differs)
KNOWN_DIFFERENCES: dict[str, tuple[str, str]] = {}

_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.failed:
        _outcomes[nodeid] = "error" if report.when != "call" else "failed"
        crash = getattr(report.longrepr, "reprcrash", None)  # where it failed, and why
        _messages.setdefault(
            nodeid,
            report.longreprtext[-2000:]
            if crash is None
            else f"{crash.path}:{crash.lineno}: {crash.message[-2000:]}",
        )
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
            json.dump({"outcomes": _outcomes, "messages": _messages}, f, indent=0, sort_keys=True)


def _load(path: str) -> tuple[dict[str, str], dict[str, str]]:
    """(outcomes, failure messages) of one run."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}, {}
    return data["outcomes"], data["messages"]


def _per_file(passed) -> dict[str, int]:
    counts = {"": len(passed)}
    for nodeid in passed:
        path = nodeid.split("::")[0]
        counts[path] = counts.get(path, 0) + 1
    return counts


def _too_few(name: str, label: str, passed) -> list[str]:
    counts = _per_file(passed)
    return [
        f"  TOO FEW PASSED ({label}): {where or 'the suite'}: {counts.get(where, 0)} < {least}"
        for where, least in MINIMUM_PASSED.get(name, {}).items()
        if counts.get(where, 0) < least
    ]


def compare(name: str, real_path: str, dropin_path: str, regressed_path: str | None) -> int:
    (real, _), (dropin, messages) = _load(real_path), _load(dropin_path)
    passed_real = {n for n, o in real.items() if o == "passed"}
    passed_dropin = {n for n, o in dropin.items() if o == "passed"}
    accepted, regressed = [], []
    for nodeid in sorted(passed_real - passed_dropin):
        known = KNOWN_DIFFERENCES.get(nodeid)
        if (
            known
            and dropin.get(nodeid) == "failed"
            and re.search(known[0], messages.get(nodeid, ""))
        ):
            accepted.append(nodeid)
        else:
            regressed.append(nodeid)
    print(
        f"{name}: passed real {len(passed_real)} / passed dropin {len(passed_dropin)} / "
        f"failed only on dropin {len(regressed)}, known differences {len(accepted)}  "
        f"(collected: real {len(real)}, dropin {len(dropin)})"
    )
    for nodeid in regressed:
        print(f"  FAILED ONLY ON genlm_fast: {nodeid}  ({dropin.get(nodeid, 'not run')})")
    for nodeid in accepted:
        print(f"  known difference: {nodeid}: {KNOWN_DIFFERENCES[nodeid][1]}")
    too_few = _too_few(name, "real", passed_real) + _too_few(name, "dropin", passed_dropin)
    for line in too_few:
        print(line)
    if regressed_path:
        with open(regressed_path, "w") as f:
            f.writelines(n + "\n" for n in regressed)
    if not real:
        print(f"  {name}: no outcomes recorded for the real packages", file=sys.stderr)
        return 1
    return 1 if regressed or too_few else 0


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6) or sys.argv[1] != "compare":
        sys.exit(__doc__)
    sys.exit(compare(*sys.argv[2:5], sys.argv[5] if len(sys.argv) == 6 else None))
