"""No teacher at all: ``alpha=0`` without one trains on the dataset's completions alone, the cross-entropy that
`trl.SFTTrainer` trains on (the baseline every distillation run is compared with). Nothing is loaded; the fused loss
runs with a signal that adds no KD (its weight is 0, so it gets no gradient) and measures the student only."""

from __future__ import annotations

import torch

from ..loss.diagnostics import observe_student
from ..loss.signal import TeacherSignal
from .base import TeacherBatch, TeacherSource
from .capabilities import WritesCache

SFT_ONLY = ("Training with alpha=0 and no teacher: the cross-entropy on the dataset's completions alone, as "
            "trl.SFTTrainer trains (no teacher is loaded; kd_loss logs 0).")
"""The one line rank 0 says when a run trains so."""


class NoSignal(TeacherSignal):
    """A `loss.signal.TeacherSignal` with no teacher behind it: KD 0 on every row; the student's entropy and CE are
    still measured."""

    closed_form = False

    def chunk(self, rows: slice, compute: torch.dtype) -> None:
        return None

    def per_token(self, student_logp: torch.Tensor, chunk, settings) -> torch.Tensor:
        return student_logp.new_zeros(student_logp.shape[0])

    def observe(self, into, rows: slice, logits: torch.Tensor, chunk, labels: torch.Tensor | None, settings) -> None:
        observe_student(into, logits, labels)


class NoTeacherBatch(TeacherBatch):

    def signal(self, rows, n: int, settings) -> NoSignal:
        return NoSignal()


class NoTeacher(TeacherSource):
    """``alpha=0`` and no teacher named: supervised fine-tuning through the same loss, metrics and checkpoints."""

    name = "none (alpha=0)"
    refused = {
        "on-policy": "On-policy and sequence-level distillation learn from a teacher's judgement of sampled "
        "completions, and alpha=0 without a teacher has none: set lmbda=0 and seq_kd=False, or name a teacher.",
        "sampled-token": "On-policy and sequence-level distillation learn from a teacher's judgement of sampled "
        "completions, and alpha=0 without a teacher has none: set lmbda=0 and seq_kd=False, or name a teacher.",
        "cross-tokenizer": "Cross-tokenizer settings need a teacher with its own tokenizer, and alpha=0 without a "
        "teacher has none: drop teacher_tokenizer_name_or_path and cross_tokenizer.",
        WritesCache: "`trl-distill cache-teacher` writes a teacher's top-k: pass --teacher_model_name_or_path or "
        "--teacher_server.",
    }

    def describe(self) -> str:
        return "none (alpha=0: cross-entropy only)"

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> NoTeacherBatch:
        return NoTeacherBatch()
