"""One example, tokenized by both tokenizers from the same text, each its own way, and its completion aligned.

Each side renders the raw example itself: language-modeling text and prompt + completion strings as they are, with
its own special tokens (and its own EOS after them); conversations through its own chat template. The completion
text is the same on both sides (the whole text, the completion, or each assistant message's content), found in
each rendering and aligned there (`alignment`), so template markers on one side only never enter a group. Per
group, the loss compares the two models' next-token distributions at the token before the group's first token:
``student_positions[j]`` and ``teacher_positions[j]``. Plain text and prompt–completion rows end with both EOS
tokens, one more group (the same event: the completion ends). A completion neither side can align (no common cut
in it, or a chat template that does not render an assistant message verbatim) gives None: the caller counts such
rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .alignment import TokenGroup, align_offsets


@dataclass(frozen=True)
class AlignedRow:
    """Both sides' token ids and the aligned groups' positions (each predicts its group's first token)."""

    student_input_ids: list[int]
    teacher_input_ids: list[int]
    student_positions: list[int]
    teacher_positions: list[int]
    groups: list[TokenGroup]


def _is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def render(example: dict, tokenizer) -> tuple[str, list[tuple[int, int]], bool] | None:
    """``(text, completion character spans, is_chat)`` of `example` as `tokenizer` renders it; None when an
    assistant message's content is not in its chat template's text. Each assistant message is looked for after the
    rendering of the messages before it (its own prompt may quote it: a teacher prompt holding the answer)."""
    if "messages" in example or _is_conversation(example.get("prompt")):
        messages = example["messages"] if "messages" in example else example["prompt"] + example["completion"]
        first = 0 if "messages" in example else len(example["prompt"])  # the index of the first trained message
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans, cursor = [], 0
        for index in range(first, len(messages)):
            message = messages[index]
            if message["role"] != "assistant" or not message["content"]:
                continue
            cursor = max(cursor, _prefix_length(tokenizer, messages[:index], text))
            start = text.find(message["content"], cursor)
            if start < 0:
                return None
            cursor = start + len(message["content"])
            spans.append((start, cursor))
        return text, spans, True
    if "prompt" in example:
        text = example["prompt"] + example["completion"]
        return text, [(len(example["prompt"]), len(text))], False
    return example["text"], [(0, len(example["text"]))], False


def _prefix_length(tokenizer, before: list[dict], text: str) -> int:
    """The length of the rendering of the messages `before` an assistant turn (with the generation prompt), when
    `text` starts with it; else 0 (a template whose renderings are not prefixes of each other)."""
    if not before:
        return 0
    try:
        prefix = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses a conversation ending before an assistant turn
        return 0
    return len(prefix) if text.startswith(prefix) else 0


def _tokenize(tokenizer, text: str, chat: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets; a chat template's text has its own markers, plain text gets the tokenizer's
    special tokens and its EOS (zero-width: in no group)."""
    encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    if not chat and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        offsets.append((len(text), len(text)))
    return ids, offsets


def align_example(example: dict, student_tokenizer, teacher_tokenizer,
                  teacher_example: dict | None = None) -> AlignedRow | None:
    """`example` (a raw text, prompt–completion or conversational row, without SFT's added EOS) tokenized by both
    and its completion aligned; None where that is impossible. `teacher_example` (default: `example`) is what the
    teacher renders: the same completion after another prompt (privileged context, `teacher_prompt`)."""
    sides, rendered_texts = [], []
    for side, tokenizer in ((example, student_tokenizer), (teacher_example or example, teacher_tokenizer)):
        rendered = render(side, tokenizer)
        if rendered is None:
            return None
        text, spans, chat = rendered
        rendered_texts.append(rendered)
        sides.append((*_tokenize(tokenizer, text, chat), spans))
    (s_ids, s_offsets, s_spans), (t_ids, t_offsets, t_spans) = sides
    if len(s_spans) != len(t_spans):
        return None
    groups = []
    for (s_start, s_end), (t_start, _) in zip(s_spans, t_spans, strict=True):
        # both spans hold the same content: align in its coordinates, then map back to each row's token indices
        s_local = [(a - s_start, b - s_start) if b > a else (a, a) for a, b in s_offsets]
        t_local = [(a - t_start, b - t_start) if b > a else (a, a) for a, b in t_offsets]
        groups += align_offsets(s_local, t_local, span=(0, s_end - s_start), widen=False)
    s_end, t_end = (len(text) for text, _, _ in rendered_texts)
    if not chat and s_spans[-1][1] == s_end and t_spans[-1][1] == t_end and s_offsets[-1] == (s_end, s_end) \
            and t_offsets[-1] == (t_end, t_end):  # both EOS tokens end the completion: the same event
        groups.append(TokenGroup((len(s_ids) - 1, len(s_ids)), (len(t_ids) - 1, len(t_ids))))
    groups = [g for g in groups if g.student[0] > 0 and g.teacher[0] > 0]  # a position must precede the group
    if not groups:
        return None
    return AlignedRow(s_ids, t_ids, [g.student[0] - 1 for g in groups], [g.teacher[0] - 1 for g in groups], groups)


def teacher_prompt_ids(example: dict, teacher_tokenizer) -> list[int]:
    """The teacher's own tokens of `example`'s prompt (its rendering up to the first completion character), for
    completions sampled later (`sampled`); empty when a token of its rendering crosses the prompt's end."""
    rendered = render(example, teacher_tokenizer)
    if rendered is None or not rendered[1]:
        return []
    text, spans, chat = rendered
    ids, offsets = _tokenize(teacher_tokenizer, text, chat)
    cut = spans[0][0]
    first = next((i for i, (a, b) in enumerate(offsets) if b > cut and b > a), len(ids))
    if first < len(ids) and offsets[first][0] < cut:
        return []
    return ids[:first]
