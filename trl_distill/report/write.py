"""Write a run's report: ``report.png`` and ``report.md`` in its output directory (or another one)."""

from __future__ import annotations

import os

from .curves import write_curves
from .history import load_history
from .summary import summary

PICTURE, TEXT = "report.png", "report.md"


def write_report(directory: str, into: str | None = None) -> tuple[str, str]:
    """Read the run in `directory` and write its picture and summary into `into` (default: `directory`), each
    written whole or not at all; returns their paths."""
    history = load_history(directory)
    into = into or directory
    os.makedirs(into, exist_ok=True)
    picture, text = os.path.join(into, PICTURE), os.path.join(into, TEXT)
    write_curves(history, picture + ".tmp.png")
    os.replace(picture + ".tmp.png", picture)
    with open(text + ".tmp", "w") as f:
        f.write(summary(history, PICTURE))
    os.replace(text + ".tmp", text)
    return picture, text
