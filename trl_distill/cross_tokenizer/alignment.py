"""Two tokenizations of the same text, aligned: groups of student tokens and teacher tokens that cover exactly the
same characters.

A *cut* is a character position that no token of either side strictly contains. Between two consecutive cuts, the
tokens of each side lie wholly inside, so each interval pairs a run of student tokens with a run of teacher tokens
over identical text, and the text before a group is identical for both models: their next-token distributions at
a group's first token are conditioned on the same prefix. Tokens that stand for no characters (special tokens, a
chat template's markers: offsets ``(a, a)``) never start or end a group. An interval with tokens on one side only
(e.g. a space one tokenizer keeps as its own token and the other leaves out of every token's offsets) joins the next
group (the last one joins the previous). Several byte-fallback tokens of one character share its offsets, so they always
fall in one group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenGroup:
    """Token index ranges ``[start, stop)`` of the student's and the teacher's tokens that cover the same text."""

    student: tuple[int, int]
    teacher: tuple[int, int]


def _inside(offsets: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the tokens with characters that overlap ``[start, end)``."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]


def align_offsets(student_offsets: list[tuple[int, int]], teacher_offsets: list[tuple[int, int]],
                  span: tuple[int, int] | None = None, widen: bool = True) -> list[TokenGroup]:
    """The groups of two tokenizations of one text, given each token's character offsets ``(start, end)``, over
    the characters `span` (default: all). A token that crosses the span's edge widens the span to cover it, on
    both sides, so every group is whole; with ``widen=False`` the span narrows instead, leaving that token out
    (for a span whose surroundings differ between the sides). Empty when the sides share no cut inside the span
    (never silent: the caller counts such rows)."""
    student_offsets = [tuple(o) for o in student_offsets]
    teacher_offsets = [tuple(o) for o in teacher_offsets]
    if span is None:
        ends = [b for _, b in student_offsets + teacher_offsets]
        span = (0, max(ends, default=0))
    start, end = span
    while True:  # widen the span over tokens that cross its edges, until both sides agree
        tokens = [_inside(offsets, start, end) for offsets in (student_offsets, teacher_offsets)]
        edges = [offsets[i] for offsets, kept in zip((student_offsets, teacher_offsets), tokens, strict=True)
                 for i in kept]
        if not edges:
            return []
        if widen:
            moved = (min(start, *(a for a, _ in edges)), max(end, *(b for _, b in edges)))
        else:
            moved = (max([start] + [b for a, b in edges if a < start]), min([end] + [a for a, b in edges if b > end]))
            if moved[0] >= moved[1]:
                return []
        if moved == (start, end):
            break
        start, end = moved
    student_kept, teacher_kept = tokens
    candidates = sorted({start, end, *(x for a, b in edges for x in (a, b))})
    cuts = [c for c in candidates if not any(a < c < b for a, b in edges)]
    groups, carry = [], None
    for left, right in zip(cuts, cuts[1:], strict=False):
        runs = [[i for i in kept if offsets[i][0] >= left and offsets[i][1] <= right]
                for offsets, kept in ((student_offsets, student_kept), (teacher_offsets, teacher_kept))]
        if carry is not None:  # a one-sided interval before this one
            runs = [previous + run for previous, run in zip(carry, runs, strict=True)]
            carry = None
        if not runs[0] and not runs[1]:
            continue
        if not runs[0] or not runs[1]:
            carry = runs
            continue
        groups.append(runs)
    if carry is not None and groups:  # a one-sided tail joins the last group
        groups[-1] = [last + run for last, run in zip(groups[-1], carry, strict=True)]
    return [TokenGroup((s[0], s[-1] + 1), (t[0], t[-1] + 1)) for s, t in groups]


def align_text(student_tokenizer, teacher_tokenizer, text: str, span: tuple[int, int] | None = None):
    """Tokenize `text` with both (fast) tokenizers, without special tokens; ``(student_ids, teacher_ids, groups)``
    over the characters `span` (default: the whole text)."""
    encoded = [tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
               for tokenizer in (student_tokenizer, teacher_tokenizer)]
    groups = align_offsets(encoded[0]["offset_mapping"], encoded[1]["offset_mapping"], span or (0, len(text)))
    return encoded[0]["input_ids"], encoded[1]["input_ids"], groups
