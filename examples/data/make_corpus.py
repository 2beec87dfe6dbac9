"""Rebuild `python_reference/`: the quickstart's corpus, from the Python Language Reference topics that ship
with CPython (`pydoc_data.topics`, the text `help()` shows; PSF license, see README.md here).

    python examples/data/make_corpus.py      # writes python_reference/{train,heldout}.jsonl

Each topic is cut into paragraphs packed into pieces of at most `MAX_CHARS` characters. Every `HELDOUT_EVERY`-th
topic (in name order) goes to the held-out split, so no topic is in both splits.
"""

import json
import os
import re
from pydoc_data.topics import topics

MAX_CHARS = 480
HELDOUT_EVERY = 8
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_reference")


def pieces(text: str) -> list[str]:
    """Paragraphs of `text` packed greedily into pieces of at most MAX_CHARS characters (long ones are cut)."""
    paragraphs = [re.sub(r"[ \t]+\n", "\n", p).strip("\n") for p in re.split(r"\n\s*\n", text)]
    out, current = [], ""
    for paragraph in filter(None, paragraphs):
        while len(paragraph) > MAX_CHARS:
            cut = paragraph.rfind(" ", 0, MAX_CHARS)
            cut = cut if cut > MAX_CHARS // 2 else MAX_CHARS
            out.append(paragraph[:cut].strip())
            paragraph = paragraph[cut:].strip()
        if current and len(current) + 2 + len(paragraph) > MAX_CHARS:
            out.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        out.append(current)
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    splits = {"train": [], "heldout": []}
    for i, name in enumerate(sorted(topics)):
        split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
        splits[split] += [{"text": piece, "topic": name} for piece in pieces(topics[name])]
    for split, rows in splits.items():
        with open(os.path.join(OUT, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{split}: {len(rows)} pieces, {sum(len(r['text']) for r in rows)} characters")


if __name__ == "__main__":
    main()
