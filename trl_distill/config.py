"""`DistillationConfig`: `trl.SFTConfig` plus the teacher and the distillation loss."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from transformers import TrainingArguments
from trl import SFTConfig

from . import compat
from .evaluation.fields import GenerationEvalFields, check_generation_eval_args
from .loss.divergences import LOSS_TYPES
from .model.precision import settle_precision
from .rollout.engine_config import EngineRolloutFields, check_engine_args
from .runtime.deepspeed_config import load_deepspeed_config
from .runtime.distributed import prepare_cpu_distributed_state
from .runtime.guards import GuardFields, check_guard_args
from .runtime.sequence_parallel import SequenceParallelFields, check_sequence_parallel_args
from .runtime.validation import refuse_quantization_without_gpu
from .teacher.resolve import refuse_unsupported
from .teacher.specs import check_teachers


@dataclass
class DistillationConfig(SFTConfig, EngineRolloutFields, GuardFields, SequenceParallelFields, GenerationEvalFields):
    r"""
    Configuration for [`DistillationTrainer`]: every [`trl.SFTConfig`] field, plus the ones below.

    The loss is ``alpha * KD + (1 - alpha) * CE``, where KD is the chosen `divergence` between the teacher's and
    the student's next-token distributions at `temperature` (times ``temperature**2`` unless
    `kd_temperature_scaling` is off) and CE is the student's cross-entropy on the dataset's completion tokens.
    Both are averaged over the completion tokens of the whole (accumulated, all-rank) batch.

    > Teacher

    teacher_model_name_or_path: path or hub id of the teacher, used when the trainer gets no `teacher_model`.
    teacher_model_init_kwargs: keyword arguments for the teacher's `from_pretrained` (default dtype: the
        student's).
    teacher_deepspeed: the teacher's own DeepSpeed config (path, JSON string or dict). When absent and the
        student uses DeepSpeed, a ZeRO-3 inference config is derived. ``"auto"`` values come from these
        arguments; optimizer/scheduler blocks are dropped.

    > Loss

    divergence: one of ``forward_kl``, ``reverse_kl``, ``jsd``, ``skew_forward_kl``, ``skew_reverse_kl``,
        ``tvd``. (`loss_type` stays SFT's own field.)
    teacher_cache: train from a cache of the teacher's top-k distribution (`trl-distill cache-teacher`) instead of
        a live teacher.
    teacher_tokenizer_name_or_path, cross_tokenizer, cross_tokenizer_matched_weight, cross_tokenizer_uld_weight: a
        teacher with another tokenizer (cross-tokenizer distillation on aligned text, `trl_distill.cross_tokenizer`).
    teacher_server: distil from a teacher served by vLLM at this URL (no teacher in the training processes; its
        top-k per loss token, as from a cache); `teacher_server_top_k` / `_timeout` / `_concurrency` tune it.
    teachers, teacher_combine, teacher_weights, teacher_column: several teachers at once, each of any kind, routed per
        row by a dataset column or mixed (`trl_distill.teacher.panel`).
    teacher_step_pass, teacher_batch_size: the teacher runs once per optimizer step over all its micro-batches (at
        most `teacher_batch_size` rows per forward), so a ZeRO-3 teacher is gathered once per step.
    temperature, alpha, beta, skew_alpha, kd_temperature_scaling, loss_chunk_size: see each field's help.

    > On-policy

    lmbda, seq_kd, max_new_tokens, generation_temperature / _top_p / _top_k: completions sampled by the student or
        the teacher (GKD). use_vllm, vllm_server_base_url (or _host / _port), vllm_server_timeout, vllm_sync_steps,
        vllm_group_port: the student's completions sampled by a vLLM server whose weights follow the student's
        (TRL's names; `trl-distill vllm-serve` starts it).

    > Generation-based evaluation

    eval_reward_funcs, num_generations_eval, eval_temperature, eval_max_new_tokens, eval_generation_prompts,
        eval_answer_column, eval_answer_pattern: in evaluate(), the student completes the eval prompts and verifiers
        score each completion (pass@k), and the teacher scores them (`trl_distill.evaluation`).

    > Long rows

    sequence_parallel_size, sequence_parallel_attn_implementation: split each sequence over this many ranks
        (DeepSpeed Ulysses), student and teacher alike; or accelerate's `parallelism_config` with
        ``sp_backend="deepspeed"`` (`trl_distill.runtime.sequence_parallel`).
    """

    # Fields a JSON string may fill on the CLI (a TrainingArguments class attribute; transformers 5.24)
    _VALID_DICT_FIELDS = compat.valid_dict_fields(SFTConfig) + ["teacher_model_init_kwargs", "teacher_deepspeed"]

    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Path or hub id of the teacher model, used when no `teacher_model` is passed. 'self' with a "
            "LoRA student (--use_peft): self-distillation from the student's own base with its adapters disabled."
        },
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for the teacher's `AutoModelForCausalLM.from_pretrained` (e.g. `dtype`, "
            "`revision`, `attn_implementation`). The teacher's dtype follows the student's unless set here."
        },
    )
    teacher_deepspeed: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "The teacher's own DeepSpeed config: a JSON file, a JSON string or a dict. Its 'auto' values are "
            "filled from these arguments, its ZeRO-3 bucket sizes from the teacher's hidden size, and optimizer or "
            "scheduler blocks are dropped. When absent and the student uses DeepSpeed, a ZeRO-3 inference config "
            "is derived, so each rank holds 1/N of the teacher."
        },
    )
    teacher_step_pass: bool = field(
        default=True,
        metadata={
            "help": "Run the teacher once per optimizer step over all its micro-batches (rows batched, padding "
            "changes no value), keeping only its hidden states at the loss tokens and its lm_head gathered until the "
            "step's last micro-batch: a ZeRO-3 teacher then gathers each layer once per step, not once per "
            "micro-batch. False: once per micro-batch. Sampled steps (lmbda, seq_kd) always run per micro-batch."
        },
    )
    teacher_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "At most this many rows per teacher forward in the once-per-step pass (each forward gathers the "
            "teacher once more). None: all rows of the optimizer step (micro batch x gradient accumulation) at once."
        },
    )
    teacher_cache: str | None = field(
        default=None,
        metadata={
            "help": "A teacher cache directory written by `trl-distill cache-teacher` (the teacher's top-k "
            "log-probabilities per loss token). Training then loads no teacher at all; the divergence is computed on "
            "the top-k tokens plus the tail mass (see `trl_distill.loss.sparse`). For `cache-teacher` itself: "
            "where the cache is written."
        },
    )
    teacher_tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The teacher's tokenizer (default: the one saved with the teacher). When it maps tokens to "
                  "other ids than the student's, training switches to cross-tokenizer distillation by itself."},
    )
    cross_tokenizer: bool | None = field(
        default=None,
        metadata={"help": "Cross-tokenizer distillation: each model reads its own tokens of the same text, the loss "
                  "compares them on aligned groups (the divergence on the tokens both vocabularies hold, Universal "
                  "Logit Distillation on the rest). None: on when the tokenizers differ; True forces it."},
    )
    cross_tokenizer_matched_weight: float | None = field(
        default=None,
        metadata={"help": "Weight of the divergence on the shared tokens. None (with the ULD weight None): the shared "
                  "fraction of the teacher's vocabulary, as TRL's GOLD does."},
    )
    cross_tokenizer_uld_weight: float | None = field(
        default=None, metadata={"help": "Weight of the ULD term on the tokens only one side has. None: 1 - matched."}
    )
    teacher_server: str | None = field(
        default=None,
        metadata={
            "help": "The URL of an OpenAI-compatible vLLM server serving the teacher (`vllm serve TEACHER "
            "--max-logprobs 64`); --teacher_model_name_or_path then names the served model (default: the one it "
            "serves). No teacher is loaded here: each batch's loss tokens get the teacher's top-k log-probs from "
            "the server, requested ahead while the student computes, and the loss runs as from a teacher cache. "
            "Temperature 1 only. For `cache-teacher`: write the cache from the server."
        },
    )
    teacher_server_top_k: int = field(
        default=64,
        metadata={"help": "Teacher token ids per loss token from the server (it needs --max-logprobs >= this)."},
    )
    teacher_server_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds per teacher-server request; each is retried 3 times with backoff before the run "
                  "stops with the error."},
    )
    teacher_server_concurrency: int = field(
        default=4, metadata={"help": "Teacher-server requests in flight per process."}
    )
    teachers: list[str] | None = field(
        default=None,
        metadata={
            "help": "Several teachers, each NAME=SOURCE: SOURCE a path or hub id (a live teacher, its own ZeRO-3 "
            "plugin), cache:DIR (a teacher cache) or an http(s):// URL (a vLLM server). A recipe may give dicts "
            "(name, model/cache/server, deepspeed, init_kwargs, served_model). --teacher_combine says how they teach."
        },
    )
    teacher_combine: str = field(
        default="route",
        metadata={
            "help": "With several teachers: 'route' (each row learns from the teacher its teacher_column names; "
            "rows naming none, from the first listed), 'mixture' (the divergence against the mixture of their "
            "distributions, weights summing to 1; live teachers) or 'sum' (the weighted sum of each teacher's "
            "divergence; any kind).",
            "choices": ["route", "mixture", "sum"],
        },
    )
    teacher_weights: list[float] | None = field(
        default=None, metadata={"help": "The teachers' weights for mixture / sum, in the order of --teachers "
                                "(default: equal)."}
    )
    teacher_column: str = field(
        default="teacher", metadata={"help": "The dataset column naming each row's teacher (teacher_combine=route)."}
    )
    divergence: str = field(
        default="forward_kl",
        metadata={
            "help": "Divergence between teacher (p) and student (q) distributions.",
            "choices": list(LOSS_TYPES),
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Softmax temperature applied to both the teacher's and the student's logits in the KD term."},
    )
    alpha: float = field(
        default=0.5,
        metadata={"help": "Weight of the KD term: loss = alpha * KD + (1 - alpha) * CE. 1.0 is pure distillation."},
    )
    beta: float = field(
        default=0.5,
        metadata={"help": "Teacher weight in the mixture of the generalized JSD (`divergence='jsd'`), in [0, 1]."},
    )
    skew_alpha: float = field(
        default=0.1,
        metadata={"help": "Skew of `skew_forward_kl` / `skew_reverse_kl` (DistiLLM), in [0, 1]."},
    )
    kd_temperature_scaling: bool = field(
        default=True,
        metadata={"help": "Multiply the KD term by temperature**2 (Hinton et al.), keeping its gradient scale."},
    )
    lmbda: float = field(
        default=0.0,
        metadata={
            "help": "On-policy fraction (GKD): per optimizer step, with this probability the batch's completions are "
            "sampled from the student for the same prompts. The draw is seeded by (seed, step): equal on every rank "
            "and on resume. 0 is off-policy distillation on the dataset's completions."
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={"help": "Sequence-level KD: on the steps not drawn on-policy, completions are sampled from the "
                  "teacher instead of taken from the dataset."},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens sampled per completion (lmbda > 0 or seq_kd)."})
    generation_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of generated completions (not the loss temperature)."}
    )
    generation_top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of generated completions."})
    generation_top_k: int = field(default=0, metadata={"help": "Top-k sampling of generated completions (0: off)."})
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Compute KD and CE on assistant tokens only (conversational `messages` datasets). Unset: on when "
            "the chat template has generation markers or TRL can add them, off (with a warning) otherwise."
        },
    )
    resume_allow_changes: bool = field(
        default=False,
        metadata={"help": "Resume a checkpoint even though the teacher or the distillation settings (divergence, "
                  "temperature, alpha, ...) differ from the run that wrote it. Off: such a resume is refused."},
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens projected through the lm_heads at a time in the chunked loss. None picks a "
            "size from the vocabulary so one chunk of fp32 logits stays near 128 MiB."
        },
    )

    def __post_init__(self):
        if self.divergence not in LOSS_TYPES:
            raise ValueError(f"Unknown divergence {self.divergence!r}; choose one of {', '.join(LOSS_TYPES)}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.max_new_tokens < 1 or not self.generation_temperature > 0 or not 0 < self.generation_top_p <= 1:
            raise ValueError(
                "Generation settings: max_new_tokens must be >= 1, generation_temperature > 0, generation_top_p in "
                f"(0, 1]; got {self.max_new_tokens}, {self.generation_temperature}, {self.generation_top_p}."
            )
        for name in ("alpha", "beta", "skew_alpha", "lmbda"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}.")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}.")
        _check_counts(self)
        if self.max_steps == 0:
            raise ValueError("max_steps=0 trains nothing (and would still save over output_dir): pass max_steps > 0, "
                             "or -1 to train for num_train_epochs.")
        if isinstance(self.resume_from_checkpoint, str) and self.resume_from_checkpoint.lower() in ("true", "false"):
            # the CLI hands `--resume_from_checkpoint true` over as a string: the API's True (newest checkpoint)
            self.resume_from_checkpoint = True if self.resume_from_checkpoint.lower() == "true" else None
        if self.teacher_batch_size is not None and self.teacher_batch_size < 1:
            raise ValueError(f"teacher_batch_size must be a positive integer or None, got {self.teacher_batch_size}.")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be a positive integer or None, got {self.loss_chunk_size}.")
        if self.auto_find_batch_size and (self.deepspeed or self.teacher_deepspeed):
            raise ValueError(
                "auto_find_batch_size is not supported with DeepSpeed here: retrying a smaller batch would rebuild "
                "the student's engine but not the teacher's. Set per_device_train_batch_size yourself."
            )
        check_engine_args(self)
        check_guard_args(self)
        check_generation_eval_args(self)
        check_teachers(self)  # several teachers: their entries, weights and modes
        refuse_unsupported(self)  # what the run's kind of teacher refuses, where the arguments name both
        for name in ("model_init_kwargs", "teacher_model_init_kwargs"):
            refuse_quantization_without_gpu(getattr(self, name), name)
        self.deepspeed = _lenient_deepspeed(self.deepspeed if self.deepspeed else _accelerate_deepspeed_file())
        check_sequence_parallel_args(self)  # long rows split over ranks: what cannot combine, refused here
        _use_activation_checkpointing_names(self)
        settle_precision(self)
        super().__post_init__()

    def to_dict(self) -> dict:
        """`TrainingArguments.to_dict`, several teachers as plain dicts: `to_json_string`, which TensorBoard's and
        W&B's callbacks call as training starts, needs every value JSON-serialisable."""
        values = super().to_dict()
        if self.teachers:
            values["teachers"] = [e.as_dict() if hasattr(e, "as_dict") else e for e in self.teachers]
        return values

    @cached_property
    def _setup_devices(self):
        """Where transformers sets up the process (`TrainingArguments._setup_devices`, a private hook checked against
        transformers 5.24): on a machine without GPU, DeepSpeed first gets the gloo state it needs there
        (`distributed.prepare_cpu_distributed_state`). Building the config does nothing else to the process."""
        prepare_cpu_distributed_state(self)
        return super()._setup_devices


def _check_counts(args) -> None:
    """The integer knobs a 0 or a negative value breaks only later (a DataLoader, the save callback, generation, a
    run that trains nothing and saves over output_dir), refused as the config is built. Those transformers already
    refuses clearly (``logging_steps 0``, ``warmup_steps < 0``) are left to it."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}.")
    if args.max_length is not None and args.max_length < 1:
        raise ValueError(f"max_length must be a positive integer or None (no truncation), got {args.max_length}.")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps" and not args.save_steps > 0:
        raise ValueError(f"save_steps must be > 0 with save_strategy 'steps', got {args.save_steps} (or pass "
                         "--save_strategy no).")
    for name in ("logging_steps", "eval_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}.")
    if args.max_steps < 0 and not args.num_train_epochs > 0:
        raise ValueError(f"num_train_epochs={args.num_train_epochs} trains nothing (and would still save over "
                         "output_dir): pass num_train_epochs > 0, or max_steps > 0.")
    if args.dataloader_num_workers < 0:
        raise ValueError(f"dataloader_num_workers must be >= 0, got {args.dataloader_num_workers}.")
    if args.generation_top_k < 0:
        raise ValueError(f"generation_top_k must be >= 0 (0: off), got {args.generation_top_k}.")


def _use_activation_checkpointing_names(args) -> None:
    """TRL's config sets `gradient_checkpointing` (default True), which transformers 5.24 renamed
    `activation_checkpointing` and warns about on every config built. Carry the value over under the new name, as
    transformers itself does (same meaning, no warning the user could act on)."""
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if hasattr(args, new) and getattr(args, new) is None and getattr(args, old, None) is not None:
            setattr(args, new, getattr(args, old))


def _accelerate_deepspeed_file() -> str | None:
    """The student's DeepSpeed JSON named by `accelerate launch` (``deepspeed_config_file`` in its config, or
    ``--deepspeed_config_file``). Read here like `deepspeed=` so that trailing commas are accepted and ``"auto"`` is
    filled from these arguments; transformers would hand the path to accelerate, which reads it strictly."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("1", "true", "yes"):
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return path if path and os.path.isfile(path) else None


def _lenient_deepspeed(config):
    """The student's DeepSpeed config as a dict, read leniently: trailing commas (as in the examples of accelerate's
    multi-model guide) are accepted and other syntax errors name the line. A config without
    `train_micro_batch_size_per_gpu` / `gradient_accumulation_steps` gets them as ``"auto"`` (filled from these
    arguments) instead of failing deep inside DeepSpeed."""
    if config is None:
        return None
    config = load_deepspeed_config(config)
    if "train_batch_size" not in config:
        config.setdefault("train_micro_batch_size_per_gpu", "auto")
        config.setdefault("gradient_accumulation_steps", "auto")
    return config


def as_distillation_config(args) -> DistillationConfig:
    """A `DistillationConfig` with every value of a stock `TrainingArguments` (or `SFTConfig`), the distillation
    fields at their defaults: what makes the trainer a drop-in for `Trainer` and `SFTTrainer` scripts.

    A `Trainer` script tokenizes its own data and brings its own collator, so SFT's dataset preparation is skipped
    for plain `TrainingArguments` (as the stock `Trainer` would do)."""
    if isinstance(args, DistillationConfig):
        return args
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be a DistillationConfig or TrainingArguments, got {type(args).__name__}.")
    values = args.to_dict()
    for key in values:
        if key.endswith("_token"):  # to_dict masks these (hub_token, and SFT's eos_token / pad_token)
            values[key] = getattr(args, key)
    if not isinstance(args, SFTConfig):
        values["dataset_kwargs"] = {"skip_prepare_dataset": True}
    return DistillationConfig(**values)
