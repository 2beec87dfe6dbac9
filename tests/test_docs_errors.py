"""docs/errors.md quotes the messages the code raises; keep it true."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_quoted_message_is_in_the_code():
    source = "\n".join(p.read_text() for p in (ROOT / "trl_distill").rglob("*.py"))
    rows = [line for line in (ROOT / "docs" / "errors.md").read_text().splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 25
    for row in rows:
        message_cell = row.split(" | ")[1]
        if message_cell.startswith("TRL's") or "invalid choice" in message_cell and "Unknown" not in message_cell:
            continue
        quoted = re.findall(r"`+\s?(.+?)\s?`+(?:\s|\)|$|,|;)", message_cell)
        assert quoted, row
        first = quoted[0].replace("``", "`")
        assert first in source, f"{first!r} (from: {row})"
