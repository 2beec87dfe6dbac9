"""The vocabulary two tokenizers share: token ids of each that stand for the same bytes.

A token's bytes are read through its tokenizer's own scheme: byte-level BPE maps each character back to its byte
(GPT-2's table), SentencePiece-style ``▁`` is a space and ``<0xAB>`` byte-fallback tokens are that byte; anything
else is its UTF-8 text. So a GPT-2-style ``Ġthe`` and a Llama-style ``▁the`` match (both are b" the"), which exact
strings (TRL's GOLD) would miss. Special and added tokens match only a token of the same content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _uses(component, kind: str) -> bool:
    """Whether a tokenizer.json component (a dict, a list, nested sequences) contains a step of type `kind`."""
    if isinstance(component, dict):
        return component.get("type") == kind or any(_uses(value, kind) for value in component.values())
    if isinstance(component, list):
        return any(_uses(value, kind) for value in component)
    return False


def token_bytes(tokenizer) -> list[bytes | str]:
    """For every id of (fast) `tokenizer`: the bytes its token stands for, or its content (a `str`) for a special
    or added token."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    steps = [backend.get("pre_tokenizer"), backend.get("decoder")]
    byte_level, metaspace = _uses(steps, "ByteLevel"), _uses(steps, "Metaspace") or "▁" in json.dumps(steps)
    byte_fallback = bool((backend.get("model") or {}).get("byte_fallback"))
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    added = {entry["id"] for entry in backend.get("added_tokens", [])} | set(tokenizer.all_special_ids)
    out = []
    for index, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if index in added or token is None:
            out.append(str(token))
        elif byte_fallback and _BYTE_FALLBACK.match(token):
            out.append(bytes([int(token[3:5], 16)]))
        elif byte_level and all(char in to_byte for char in token):
            out.append(bytes(to_byte[char] for char in token))
        elif metaspace:
            out.append(token.replace("▁", " ").encode())
        else:
            out.append(token.encode())
    return out


@dataclass(frozen=True)
class SharedVocabulary:
    """Pairs of ids with the same bytes (``student[j]`` ↔ ``teacher[j]``) and, per side, the logit columns that
    match nothing (ids no token of the other side shares, and padded embedding rows past the tokenizer)."""

    student: Tensor
    teacher: Tensor
    student_only: Tensor
    teacher_only: Tensor

    @property
    def size(self) -> int:
        return int(self.student.numel())

    def teacher_partner(self, student_width: int) -> Tensor:
        """Per student id ``[student_width]``: the teacher id with its bytes, -1 where none has them."""
        partner = torch.full((student_width,), -1, dtype=torch.long)
        keep = self.student < student_width
        return partner.index_copy_(0, self.student[keep], self.teacher[keep])


def shared_vocabulary(student_tokenizer, teacher_tokenizer, student_width: int | None = None,
                      teacher_width: int | None = None) -> SharedVocabulary:
    """The vocabulary the two tokenizers share, for logits `student_width` and `teacher_width` wide (default: the
    tokenizers' lengths). When several ids of one side stand for the same bytes, the lowest is matched. The two
    EOS tokens match whatever their text: both end a sequence."""
    keys = [token_bytes(tokenizer) for tokenizer in (student_tokenizer, teacher_tokenizer)]
    eos = [tokenizer.eos_token_id for tokenizer in (student_tokenizer, teacher_tokenizer)]
    if None not in eos:
        keys[0][eos[0]] = keys[1][eos[1]] = ("eos",)  # a key no other token has
    widths = [width or len(key) for width, key in zip((student_width, teacher_width), keys, strict=True)]
    teacher_index = {}
    for index, key in enumerate(keys[1]):
        teacher_index.setdefault(key, index)  # (keys are hashable: bytes, str, or the EOS marker)
    pairs, seen = [], set()
    for index, key in enumerate(keys[0]):
        if key in teacher_index and key not in seen:
            seen.add(key)
            pairs.append((index, teacher_index[key]))
    student = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    teacher = torch.tensor([t for _, t in pairs], dtype=torch.long)
    only = []
    for width, matched in zip(widths, (student, teacher), strict=True):
        mask = torch.ones(width, dtype=torch.bool)
        mask[matched] = False
        only.append(mask.nonzero().squeeze(1))
    return SharedVocabulary(student, teacher, *only)
