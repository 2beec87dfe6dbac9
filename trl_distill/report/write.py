"""Write a run's report: ``report.png`` and ``report.md`` in its output directory (or another one)."""

from __future__ import annotations

import os

from .curves import TITLE, write_curves
from .history import load_history
from .summary import HEADING, summary

PICTURE, TEXT = "report.png", "report.md"


def _is_our_picture(path: str) -> bool:
    from PIL import Image  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return image.info.get("Title") == TITLE
    except Exception:  # not an image at all
        return False


def _is_our_text(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(HEADING)
    except (OSError, UnicodeDecodeError):
        return False


def refuse_foreign_files(picture: str, text: str) -> None:
    """A ``report.png`` or ``report.md`` already at the target that an earlier report did not write (the user's own
    file) is left as it is: one clear error before either is written."""
    for path, ours in ((picture, _is_our_picture), (text, _is_our_text)):
        if os.path.lexists(path) and not (os.path.isfile(path) and ours(path)):
            raise ValueError(f"{path} exists and is not a report `trl-distill report` wrote: it is left as it is. "
                             "Move it away, or write the report elsewhere with --into DIR.")


def write_report(directory: str, into: str | None = None) -> tuple[str, str]:
    """Read the run in `directory` and write its picture and summary into `into` (default: `directory`), each
    written whole or not at all, replacing only an earlier report (never a file of the same name the user owns);
    returns their paths."""
    history = load_history(directory)
    into = into or directory
    os.makedirs(into, exist_ok=True)
    picture, text = os.path.join(into, PICTURE), os.path.join(into, TEXT)
    refuse_foreign_files(picture, text)
    write_curves(history, picture + ".tmp.png")
    os.replace(picture + ".tmp.png", picture)
    with open(text + ".tmp", "w") as f:
        f.write(summary(history, PICTURE))
    os.replace(text + ".tmp", text)
    return picture, text
