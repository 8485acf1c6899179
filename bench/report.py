"""How a benchmark hands its report over: the command line that reruns it, and the text
printed and written to a markdown file."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command_line(module: str, argv=None) -> str:
    """``python -m <module> <arguments>``, for the report to say how it was made;
    ``argv`` defaults to this process's arguments."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python -m {module}", *args])


def write_report(text: str, out=None, stem: str | None = None) -> Path | None:
    """Print ``text`` and write it to ``out``. Without ``out``: with a ``stem``, to
    ``bench/results/<stem>-<date>.md``, else nowhere. Returns the file written."""
    print(text)
    if out is None and stem is not None:
        out = REPO / "bench" / "results" / f"{stem}-{datetime.date.today().isoformat()}.md"
    if out is None:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
