"""A real corpus that every Python installation ships: the standard library's own source files.

    python benchmarks/quality/stdlib_corpus.py OUT_DIR     # writes OUT_DIR/{train,heldout}.jsonl, prints the counts

Files are split into train and held-out BY FILE: a file is held out when the SHA-1 of its path relative to the
stdlib directory, read as an integer, is 0 modulo `HELDOUT_MODULUS`. No file has pieces in both splits. Each file
is cut into pieces of whole lines of at most `max_chars` characters (a longer line is cut), runs of blank lines
squeezed to one. Left out: tests, tools and demos (`test`, `idlelib`, `lib2to3`, `turtledemo`), data tables
rather than code (`encodings`, `pydoc_data`, the build's `config-*` and `_sysconfigdata*`), installed packages.
The corpus therefore depends on the Python version, recorded by `build`.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import re
import sys
import sysconfig
from pathlib import Path

HELDOUT_MODULUS = 16
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "pydoc_data", "site-packages",
             "dist-packages", "__pycache__"}


def source_files(stdlib: Path) -> list[Path]:
    """The stdlib's `*.py` files, relative paths in sorted order, without the skipped directories and build data."""
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.parts[0].startswith(("config-", "_sysconfigdata")):
            continue
        files.append(rel)
    return sorted(files)


def is_heldout(rel: Path) -> bool:
    return int(hashlib.sha1(rel.as_posix().encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def pieces(text: str, max_chars: int) -> list[str]:
    """Whole lines packed greedily into pieces of at most `max_chars` characters (a longer line is cut)."""
    lines = re.sub(r"\n\s*\n+", "\n\n", text.replace("\r\n", "\n")).strip("\n").split("\n")
    out, current = [], ""
    for line in lines:
        while len(line) > max_chars:
            out.append(line[:max_chars])
            line = line[max_chars:]
        if current and len(current) + 1 + len(line) > max_chars:
            out.append(current)
            current = ""
        current = f"{current}\n{line}" if current else line
    out.append(current)
    return [p for p in out if p.strip()]


def build(out_dir: Path, *, max_chars: int = 384, train_pieces: int | None = None, heldout_pieces: int | None = None,
          stdlib: Path | None = None) -> dict:
    """Write `out_dir`/{train,heldout}.jsonl; returns the counts, the split rule and the Python version.

    `train_pieces` / `heldout_pieces` keep that many pieces of each split, drawn at random (seed 0) over the
    whole split, so that every file may contribute; None keeps all of them."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    splits = {"train": [], "heldout": []}
    files = {"train": 0, "heldout": 0}
    for rel in source_files(stdlib):
        text = (stdlib / rel).read_text(encoding="utf-8", errors="replace")
        split = "heldout" if is_heldout(rel) else "train"
        files[split] += 1
        splits[split] += [{"text": piece, "file": rel.as_posix()} for piece in pieces(text, max_chars)]
    info = {"source": "Python standard library source (*.py)", "python": platform.python_version(),
            "implementation": sys.implementation.name, "stdlib": str(stdlib), "split": (
                f"by file: held out when int(sha1(relative path)) % {HELDOUT_MODULUS} == 0"),
            "max_chars": max_chars, "skipped_dirs": sorted(SKIP_DIRS)}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", train_pieces), ("heldout", heldout_pieces)):
        rows = splits[split]
        info[f"{split}_files"], info[f"{split}_pieces_available"] = files[split], len(rows)
        info[f"{split}_chars_available"] = sum(len(r["text"]) for r in rows)
        if keep is not None and keep < len(rows):
            rows = sorted(random.Random(0).sample(range(len(rows)), keep))
            rows = [splits[split][i] for i in rows]
        info[f"{split}_pieces"], info[f"{split}_chars"] = len(rows), sum(len(r["text"]) for r in rows)
        info[f"{split}_files_used"] = len({r["file"] for r in rows})
        with open(out_dir / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    assert not {r["file"] for r in splits["train"]} & {r["file"] for r in splits["heldout"]}
    return info


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1])), indent=2))
