"""What the report tests check of a written report: the PNG's size and panels, the summary's numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


def check_picture(path: Path, panels: list[str]) -> None:
    """The PNG is the size its panels take (2 columns of 500 x 350 px), names them in its metadata, and each panel's
    area holds the axes' black frame and at least one curve in matplotlib's first colour."""
    import numpy as np
    from PIL import Image

    image = Image.open(path)
    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    assert image.size == (500 * columns, 350 * rows)
    assert image.info["Description"] == "panels: " + "; ".join(panels)
    pixels = np.asarray(image.convert("RGB")).astype(int)
    for i in range(len(panels)):
        row, column = divmod(i, columns)
        area = pixels[row * 350:(row + 1) * 350, column * 500:(column + 1) * 500]
        black = (area.sum(-1) < 60).sum()
        first_colour = (np.abs(area - np.array([31, 119, 180])).sum(-1) < 40).sum()  # matplotlib's C0
        assert black > 500 and first_colour > 20, (panels[i], black, first_colour)
    for i in range(len(panels), rows * columns):  # an unused cell is blank
        row, column = divmod(i, columns)
        area = pixels[row * 350 + 40:(row + 1) * 350 - 40, column * 500 + 40:(column + 1) * 500 - 40]
        assert (area.sum(-1) < 600).sum() == 0


def check_summary(path: Path, state_file: Path) -> int:
    """Every row of the summary's tables (first, last, best, with their steps) equals `trainer_state.json`'s
    values; returns the number of rows checked."""
    history = json.loads(state_file.read_text())["log_history"]
    rows = 0
    for line in path.read_text().splitlines():
        match = re.match(r"\| (\w+) \| (\S+) \((\d+)\) \| (\S+) \((\d+)\) \| (\S+) \((\d+)\) \|$", line)
        if not match:
            continue
        name = match.group(1)
        logged = {h["step"]: h[name] for h in history if name in h and "train_runtime" not in h}
        steps = sorted(logged)
        for value, step in ((match.group(2), match.group(3)), (match.group(4), match.group(5)),
                            (match.group(6), match.group(7))):
            assert float(value) == pytest.approx(logged[int(step)], rel=1e-5), (name, step)
        assert int(match.group(3)) == steps[0] and int(match.group(5)) == steps[-1]
        rows += 1
    return rows
