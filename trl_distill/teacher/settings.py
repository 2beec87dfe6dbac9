"""`TeacherSettings`: what the run's teachers read of its arguments, as they are built (each kind's builder, through
`registry.BuildContext`) and as they run (``context.plan.teacher_settings``). The run plan's teacher part, made once
by `run_plan.resolve`; the loss's settings are not here (the loss reads them from the run as it goes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .support import Mode, active_modes


@dataclass(frozen=True)
class TeacherPaths:
    """What the one teacher's flags name (several teachers: `run_plan.RunPlan.teachers`)."""

    model: str | None  # `teacher_model_name_or_path` (a `teacher_model` given to the trainer comes first)
    cache: str | None  # `teacher_cache`
    tokenizer: str | None  # `teacher_tokenizer_name_or_path`


@dataclass(frozen=True)
class TeacherSettings:
    """The teacher fields of a `DistillationConfig`, as the run's teachers read them."""

    paths: TeacherPaths
    server: str | None  # `teacher_server`: the one teacher served by vLLM at this URL
    server_top_k: int
    server_timeout: float
    server_concurrency: int
    init_kwargs: dict[str, Any] | None  # `teacher_model_init_kwargs` (a spec's own come first)
    fsdp_config: Any  # `teacher_fsdp_config` (a spec's own `fsdp` comes first)
    cross_tokenizer: bool | None  # None: across tokenizers when the vocabularies differ
    matched_weight: float | None  # `cross_tokenizer_matched_weight`
    uld_weight: float | None  # `cross_tokenizer_uld_weight`
    prompt: str | None  # `teacher_prompt`: the teacher's own prompt in place of each row's
    several: bool  # `teachers` lists them (else the single-teacher flags name the one)
    combine: str  # `teacher_combine`: how several teach
    column: str  # `teacher_column`: the column naming each row's teacher (routed)
    max_length: int | None  # the rows' bound (a teacher's own tokens of them too)
    dataset_num_proc: int | None  # the processes a teacher's dataset preparation maps over
    step_pass: bool  # `teacher_step_pass`: a live teacher once per optimizer step
    batch_size: int | None  # `teacher_batch_size`: rows per forward of that pass (None: all)
    seq_kd: bool  # the teacher samples the completions
    modes: tuple[Mode, ...]  # the modes of `support` its arguments decide (the eval split and LoRA: the trainer's)

    @classmethod
    def of(cls, args) -> TeacherSettings:
        """The settings of `args` (a `DistillationConfig`)."""
        return cls(
            TeacherPaths(args.teacher_model_name_or_path, args.teacher_cache, args.teacher_tokenizer_name_or_path),
            args.teacher_server, args.teacher_server_top_k, args.teacher_server_timeout,
            args.teacher_server_concurrency, args.teacher_model_init_kwargs, args.teacher_fsdp_config,
            args.cross_tokenizer, args.cross_tokenizer_matched_weight, args.cross_tokenizer_uld_weight,
            args.teacher_prompt, args.teachers is not None, args.teacher_combine, args.teacher_column,
            args.max_length, args.dataset_num_proc, bool(args.teacher_step_pass), args.teacher_batch_size,
            bool(args.seq_kd), tuple(active_modes(args)))
