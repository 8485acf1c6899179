"""pytest plugin of tools/gpu/session.sh: appends the node id of every test that has
finished (passed, failed or skipped) to the file named by $PYTEST_DONE_LOG. When a test
kills the interpreter (a signal), the session's next attempt deselects these and the
culprit, so it runs only the tests not yet run instead of the whole suite again. Each
failure's report also goes, as it happens, to the same file name + ".failures": a run
stopped by its timeout never prints pytest's summary.

    PYTEST_DONE_LOG=done.txt python -m pytest -p tools.gpu.session_progress tests/ops
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_DONE_LOG")
    if path and report.failed:
        with open(path + ".failures", "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("PYTEST_DONE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(nodeid + "\n")
