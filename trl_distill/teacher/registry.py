"""The one place a run's teachers are described and built, through the registry of kinds (`kinds`).

A run's teachers are `TeacherSpec` entries (`specs.py`), plain data that serialise: the config's `teachers` (as
`run_plan.resolve` parses them), or the one that its single-teacher flags describe (`describe`). Each spec's `kind`
names an entry of `TEACHER_KINDS`, which builds its `TeacherSource`; `resolve.resolve_teacher` makes several of them
one panel. A kind registers with `register_kind` (as vLLM's weight-transfer factory registers its engines by name).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import TeacherSource
from .kinds import TEACHER_KINDS, SourceForm, TeacherKind, register_kind, register_teacher_kind, teacher_kind
from .settings import TeacherSettings
from .specs import SINGLE, TeacherSpec

__all__ = ["TEACHER_KINDS", "BuildContext", "SourceForm", "TeacherKind", "build_teacher", "describe", "register_kind",
           "register_teacher_kind", "teacher_kind"]


@dataclass(frozen=True)
class BuildContext:
    """What a kind's builder may read: the run's teacher settings (the plan's `TeacherSettings`), the student and
    its tokenizer, and the attention a model teacher loads with under sequence parallelism (the plan's
    `Parallelism.attn_implementation`; None without it)."""

    settings: TeacherSettings
    student: Any
    processing_class: Any
    attention: str | None = None


def describe(teachers: Sequence[TeacherSpec], settings: TeacherSettings, teacher_model=None) -> list[TeacherSpec]:
    """The run's teachers as specs: several `teachers` (the run plan's, parsed from the config), else one spec named
    ``"teacher"`` from the single-teacher flags (`settings`; a `teacher_model` object or name passed to the trainer
    first), else none (alpha 0 without a teacher). With a server, the model flag names the served model."""
    if teachers:
        return list(teachers)
    model = teacher_model if teacher_model is not None else settings.paths.model
    if settings.server is not None:
        return [TeacherSpec(SINGLE, server=settings.server, served_model=model)]
    if settings.paths.cache is not None:
        return [TeacherSpec(SINGLE, cache=settings.paths.cache)]
    return [] if model is None else [TeacherSpec(SINGLE, model=model)]


def build_teacher(spec: TeacherSpec, context: BuildContext, *, eval_dataset=None, peft: bool = False) -> TeacherSource:
    """`spec`'s teacher, its kind's refusals checked first (and the built class's, when the kind picked a subclass:
    a model whose tokenizer differs from the student's is a cross-tokenizer teacher)."""
    kind = teacher_kind(spec.kind)
    kind.source_class.refuse(context.settings, eval_dataset=eval_dataset, peft=peft)
    source = kind.build(spec, context)
    if type(source) is not kind.source_class:
        type(source).refuse(context.settings, eval_dataset=eval_dataset, peft=peft)
    return source
