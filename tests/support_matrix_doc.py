"""The README's support matrix (teacher kinds x modes), rendered from `trl_distill.teacher.support_matrix()`.

`tests/test_docs.py` checks that the README's block equals `render(support_matrix())`. After changing what a kind
of teacher refuses, rewrite the block with

    python tests/support_matrix_doc.py
"""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- support-matrix -->", "<!-- /support-matrix -->"
REFUSED = "refused: "
_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(matrix: dict[str, dict[str, str]]) -> str:
    """A markdown table, one row per kind and one column per mode: `yes`, or `refused` with a superscript number
    naming its message in the numbered list right below the table (one number per distinct message)."""
    if not matrix:
        raise ValueError("an empty support matrix")
    modes = list(next(iter(matrix.values())))
    notes: list[str] = []
    lines = ["| teacher | " + " | ".join(_cell(mode) for mode in modes) + " |",
             "|---" * (len(modes) + 1) + "|"]
    for kind, cells in matrix.items():
        if list(cells) != modes:
            raise ValueError(f"{kind!r} lists the modes {list(cells)}, not {modes}")
        row = []
        for mode in modes:
            value = cells[mode]
            if value == "yes":
                row.append("yes")
            elif value.startswith(REFUSED) and value[len(REFUSED):].strip():
                message = " ".join(value[len(REFUSED):].split())
                if message not in notes:
                    notes.append(message)
                row.append("refused" + str(notes.index(message) + 1).translate(_SUPERSCRIPT))
            else:
                raise ValueError(f"{kind!r} x {mode!r}: {value!r} is neither 'yes' nor 'refused: <message>'")
        lines.append(f"| {_cell(kind)} | " + " | ".join(row) + " |")
    if notes:
        lines += ["", *(f"{number}. {message}" for number, message in enumerate(notes, 1))]
    return "\n".join(lines)


def block(text: str) -> str:
    """What stands between the markers in `text` (a README), stripped."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"expected one {START} and one {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def write(readme: Path = README) -> bool:
    """Rewrite the block in `readme` from the code; True when it changed."""
    from trl_distill.teacher import support_matrix

    text = readme.read_text()
    block(text)  # both markers, once each
    head, rest = text.split(START, 1)
    new = f"{head}{START}\n{render(support_matrix())}\n{END}{rest.split(END, 1)[1]}"
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":
    print(f"{README}: {'rewritten' if write() else 'already current'}")
