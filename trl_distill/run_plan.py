"""`resolve(args) -> RunPlan`: how a `DistillationConfig`'s fields combine, checked once (one line each, before
anything loads), and the run's plan in typed parts that functions take instead of the whole config.

The config checks each field alone as it is built; `resolve` checks what needs several (a mode and the teacher that
refuses it, sampling and the engine, sequence parallelism and what it cannot split) and derives what follows from
them (several teachers parsed into `TeacherSpec` with their weights, accelerate's `ParallelismConfig`), leaving the
config as written. The trainer and the command line call it once each; it may run again on a config it resolved (the
command line's, handed to the trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .evaluation.checks import check_generation_eval_args
from .evaluation.verifiers import as_names
from .loss.sampled_token import SampledTokenSettings
from .loss.settings import LossSettings
from .rollout.engine_checks import check_engine_args
from .rollout.objective_checks import check_objective_args
from .rollout.sampling import Sampling
from .runtime.checkpoints import RecordedSettings
from .runtime.fsdp2 import fsdp_requested
from .runtime.guards import check_guard_args
from .runtime.sequence_parallel import attention_implementation, check_sequence_parallel_args, sequence_parallel_size
from .runtime.validation import refuse_quantization_without_gpu
from .teacher.privileged import check_teacher_prompt_args
from .teacher.resolve import refuse_unsupported
from .teacher.settings import TeacherSettings
from .teacher.specs import TeacherSpec, check_teachers


@dataclass(frozen=True)
class TaskRewardPlan:
    """The task reward of each sampled completion (`task_reward_funcs`): its verifiers, and the answer column and
    pattern the built-ins compare with."""

    funcs: tuple[str, ...] = ()  # empty: no task reward
    answer_column: str | None = None
    answer_pattern: str | None = None


@dataclass(frozen=True)
class OnPolicyPlan:
    """Completions sampled during training: on which share of steps (`lmbda`), by whom, how, and what is learnt."""

    lmbda: float
    seq_kd: bool
    sampling: Sampling
    objective: str  # `constants.OBJECTIVES`
    use_vllm: bool
    seed: int  # the run's: which steps sample (with `lmbda`, `rollout.sampling.completion_source`)
    task_rewards: TaskRewardPlan = TaskRewardPlan()
    sampled_token: SampledTokenSettings = SampledTokenSettings()  # the sampled-token objective's coefficients

    @property
    def samples(self) -> bool:
        """Whether any step samples its completions."""
        return self.lmbda > 0 or self.seq_kd


@dataclass(frozen=True)
class EvaluationPlan:
    """The generation-based evaluation: which verifiers judge how many completions of which prompts."""

    reward_funcs: tuple[str, ...]  # empty: no generation-based evaluation
    num_generations: int
    sampling: Sampling
    max_prompts: int | None
    answer_column: str | None
    answer_pattern: str | None


@dataclass(frozen=True)
class GuardPlan:
    """When the run stops by itself (`runtime.guards.Guards`): a loss that is not finite, a collapsing on-policy
    student; and the margin of the first step's teacher check."""

    stop_on_nonfinite_loss: bool
    collapse_max_repetition: float
    collapse_min_entropy: float
    collapse_patience: int
    teacher_ce_margin: float


@dataclass(frozen=True)
class Precision:
    """What the models train in, as settled for this machine (`model.precision.settle_precision`)."""

    bf16: bool
    fp16: bool


@dataclass(frozen=True)
class Parallelism:
    """How the run is split: DeepSpeed for the student and the teacher, and sequence parallelism."""

    student_deepspeed: bool
    teacher_deepspeed: bool
    sequence_parallel_size: int
    attn_implementation: str | None  # under sequence parallelism; None without it


@dataclass(frozen=True)
class TeacherEngine:
    """What a live teacher's own DeepSpeed engine is built from (`teacher.live.LiveTeacher.plugin`): its config as
    given, and the student's values that its ``"auto"`` entries take (`deepspeed_config.build_teacher_config`)."""

    deepspeed: Any  # `teacher_deepspeed`: a path, JSON or dict; None: derived from the student's config
    micro_batch_size: int  # the larger of the student's train and eval batch per device
    gradient_accumulation_steps: int
    world_size: int
    max_grad_norm: float
    bf16: bool  # the student's mixed precision (a teacher held whole is cast to it)
    fp16: bool
    bf16_full_eval: bool
    fp16_full_eval: bool
    seq_kd: bool  # the teacher samples
    fsdp_student: bool  # an FSDP student: its teachers are sharded with FSDP2, DeepSpeed settings refused


@dataclass(frozen=True)
class RunPlan:
    """One run as its arguments decide it, checked."""

    teachers: tuple[TeacherSpec, ...]  # several teachers; empty for one (or none)
    teacher_weights: tuple[float, ...] | None  # what several teachers mix with (None: routed, or one teacher)
    teacher_settings: TeacherSettings  # what building and running the teachers reads (their paths among it)
    loss: LossSettings  # its `vocab_size` is the models', known once they load
    alpha: float
    on_policy: OnPolicyPlan
    evaluation: EvaluationPlan
    precision: Precision
    parallelism: Parallelism
    guards: GuardPlan
    teacher_engine: TeacherEngine
    recorded: RecordedSettings  # what its checkpoints record of it


def resolve(args) -> RunPlan:
    """Check how the fields of `args` (a `DistillationConfig`) combine, one `ValueError` naming the fix for the
    first that cannot work, complete the values that follow from others, and return the run's plan."""
    _check_schedule(args)
    if args.auto_find_batch_size and (args.deepspeed or args.teacher_deepspeed):
        raise ValueError(
            "auto_find_batch_size is not supported with DeepSpeed here: retrying a smaller batch would rebuild "
            "the student's engine but not the teacher's. Set per_device_train_batch_size yourself."
        )
    check_engine_args(args)
    check_guard_args(args)
    check_generation_eval_args(args)
    teachers = check_teachers(args)  # several teachers: their entries, weights and modes
    check_objective_args(args)  # on the student's samples: a divergence, or the sampled-token objective
    check_teacher_prompt_args(args)  # a teacher that reads its own prompt
    teacher_settings = TeacherSettings.of(args)  # the plan's teacher part, made once
    refuse_unsupported(args, teacher_settings)  # what the run's kind of teacher refuses, where the arguments name both
    for name in ("model_init_kwargs", "teacher_model_init_kwargs"):
        refuse_quantization_without_gpu(getattr(args, name), name)
    check_sequence_parallel_args(args)  # long rows split over ranks: what cannot combine, refused here
    return _plan(args, teacher_settings, *teachers)


def _check_schedule(args) -> None:
    """The step counts that only fail together with another field: a run that saves every 0 steps, or trains for
    0 epochs (and would still save over output_dir)."""
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps" and not args.save_steps > 0:
        raise ValueError(f"save_steps must be > 0 with save_strategy 'steps', got {args.save_steps} (or pass "
                         "--save_strategy no).")
    if args.max_steps < 0 and not args.num_train_epochs > 0:
        raise ValueError(f"num_train_epochs={args.num_train_epochs} trains nothing (and would still save over "
                         "output_dir): pass num_train_epochs > 0, or max_steps > 0.")


def _plan(args, teacher_settings: TeacherSettings, teachers: tuple[TeacherSpec, ...],
          weights: tuple[float, ...] | None) -> RunPlan:
    """The run's plan from its checked arguments (and several teachers' specs and weights, parsed from them)."""
    # the eval completions' temperature: the field, else greedy for one generation, generation_temperature for n
    temperature = args.eval_temperature if args.eval_temperature is not None else \
        0.0 if args.num_generations_eval == 1 else args.generation_temperature
    evaluation = EvaluationPlan(
        as_names(args.eval_reward_funcs), args.num_generations_eval,
        Sampling(args.eval_max_new_tokens or args.max_new_tokens, temperature, args.generation_top_p,
                 args.generation_top_k),
        args.eval_generation_prompts, args.eval_answer_column, args.eval_answer_pattern)
    size = sequence_parallel_size(args)  # the field, or accelerate's parallelism_config
    return RunPlan(
        teachers=teachers,
        teacher_weights=weights,
        teacher_settings=teacher_settings,
        loss=LossSettings.of(args, None),
        alpha=args.alpha,
        on_policy=OnPolicyPlan(args.lmbda, args.seq_kd, Sampling.from_args(args), args.on_policy_objective,
                               args.use_vllm, args.seed, TaskRewardPlan(as_names(args.task_reward_funcs),
                                                                        args.eval_answer_column,
                                                                        args.eval_answer_pattern),
                               SampledTokenSettings.of(args)),
        evaluation=evaluation,
        precision=Precision(bool(args.bf16), bool(args.fp16)),
        parallelism=Parallelism(bool(args.deepspeed), bool(args.teacher_deepspeed), size,
                                attention_implementation(args) if size > 1 else None),
        guards=GuardPlan(args.stop_on_nonfinite_loss, args.collapse_max_repetition, args.collapse_min_entropy,
                         args.collapse_patience, args.teacher_ce_margin),
        teacher_engine=TeacherEngine(
            args.teacher_deepspeed, max(args.per_device_train_batch_size, args.per_device_eval_batch_size),
            args.gradient_accumulation_steps, args.world_size, args.max_grad_norm, bool(args.bf16), bool(args.fp16),
            bool(args.bf16_full_eval), bool(args.fp16_full_eval), args.seq_kd,
            fsdp_requested(getattr(args, "fsdp_plugin_args", None))),
        recorded=RecordedSettings(
            args.divergence, args.temperature, args.alpha, args.beta, args.skew_alpha, args.kd_temperature_scaling,
            args.lmbda, args.seq_kd, args.teacher_cache, args.on_policy_objective,
            None if args.task_reward_funcs is None else as_names(args.task_reward_funcs), args.teacher_prompt),
    )
