"""Sampled completions across tokenizers: the student's sampled token ids, re-rendered for the teacher and aligned.

The student's tokens are kept as sampled (no decode and re-encode: a sampled sequence is often not the one its
tokenizer would produce); each gets the characters it adds to the decoded text (`sampled_offsets`). The teacher
reads its own rendering of the row's prompt (`data.teacher_prompt_ids`, from the raw example) then its own tokens
of the completion's text, and its EOS where the student sampled EOS. Both sides then cover the same prompt text
and the same completion text, so the groups `alignment.align_offsets` finds in the completion compare the two models
after identical text, as for dataset completions.
"""

from __future__ import annotations

from .alignment import TokenGroup, align_offsets


def sampled_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text `ids` decode to (special tokens dropped) and each token's ``(start, end)`` in it. A token that
    rewrites text decoded before it (the last byte of a character split over several tokens) shares one span with
    the tokens back to the last prefix its text extends, as byte-fallback tokens of one character do; special tokens
    have empty spans. Every span lies in the final text, in order."""
    texts = [""] + [tokenizer.decode(ids[: k + 1], skip_special_tokens=True) for k in range(len(ids))]
    offsets: list[tuple[int, int]] = []
    for k in range(1, len(texts)):
        if texts[k].startswith(texts[k - 1]):
            offsets.append((len(texts[k - 1]), len(texts[k])))
            continue
        j = max(j for j in range(k) if texts[k].startswith(texts[j]))  # j = 0 always qualifies
        offsets[j:] = [(len(texts[j]), len(texts[k]))] * (k - j)
    return texts[-1], offsets


def align_sampled(completion_ids: list[int], ended: bool, student_tokenizer, teacher_tokenizer
                  ) -> tuple[list[int], list[TokenGroup]]:
    """The teacher's tokens of a sampled completion (its EOS appended when `ended`), and the groups of both sides'
    completion tokens (indices within the completion) that cover the same text, but none over text the student's
    bytes did not decode to; the two EOS are one more group."""
    text, student_offsets = sampled_offsets(student_tokenizer, completion_ids)
    encoded = teacher_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    teacher_ids, teacher_offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    groups = align_offsets(student_offsets, teacher_offsets, span=(0, len(text)), widen=False) if text else []
    # a group whose text holds U+FFFD stands for bytes the decode could not read (a sampled run of byte tokens that
    # is no UTF-8): the teacher would read that replacement character, not the student's bytes, so it is left out
    # (the groups after it are kept: both read the same text there, after a prefix where the teacher reads U+FFFD
    # for the student's bytes)
    groups = [g for g in groups if "\ufffd" not in text[student_offsets[g.student[0]][0]:
                                                          student_offsets[g.student[1] - 1][1]]]
    if ended and teacher_tokenizer.eos_token_id is not None:
        teacher_ids.append(teacher_tokenizer.eos_token_id)
        groups.append(TokenGroup((len(completion_ids) - 1, len(completion_ids)), (len(teacher_ids) - 1,
                                                                                  len(teacher_ids))))
    return teacher_ids, groups
