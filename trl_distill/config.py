"""`DistillationConfig`: `trl.SFTConfig` plus the teacher and the distillation loss."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from transformers import TrainingArguments
from trl import SFTConfig

from . import compat
from .evaluation.fields import GenerationEvalFields, check_generation_eval_args
from .loss.divergences import LOSS_TYPES
from .loss.fields import LossFields
from .model.precision import settle_precision
from .rollout.fields import EngineRolloutFields, OnPolicyFields, check_engine_args
from .rollout.objective_fields import OnPolicyObjectiveFields, check_objective_args
from .runtime.checkpoints import ReliabilityFields
from .runtime.deepspeed_config import load_deepspeed_config
from .runtime.distributed import prepare_cpu_distributed_state
from .runtime.guards import GuardFields, check_finite_settings, check_guard_args
from .runtime.sequence_parallel import SequenceParallelFields, check_sequence_parallel_args
from .runtime.validation import refuse_quantization_without_gpu
from .teacher.fields import CacheFields, SeveralTeachersFields, TeacherFields
from .teacher.privileged import check_teacher_prompt_args
from .teacher.resolve import refuse_unsupported
from .teacher.specs import check_teachers


@dataclass
class DistillationConfig(ReliabilityFields, GenerationEvalFields, GuardFields, SequenceParallelFields,
                         SeveralTeachersFields, CacheFields, OnPolicyObjectiveFields, EngineRolloutFields,
                         OnPolicyFields, LossFields,
                         TeacherFields, SFTConfig):
    r"""
    Configuration for [`DistillationTrainer`]: every [`trl.SFTConfig`] field, then the distillation's own, below in
    the order `HfArgumentParser` (`--help`) lists them. Each section's fields live beside the code that uses them
    (`trl_distill/*/fields.py`).

    The loss is ``alpha * KD + (1 - alpha) * CE``, where KD is the chosen `divergence` between the teacher's and
    the student's next-token distributions at `temperature` (times ``temperature**2`` unless
    `kd_temperature_scaling` is off) and CE is the student's cross-entropy on the dataset's completion tokens.
    Both are averaged over the completion tokens of the whole (accumulated, all-rank) batch.

    Parameters:
        > Teacher

        teacher_model_name_or_path (`str`, *optional*):
            Path or hub id of the teacher, used when the trainer gets no `teacher_model`; ``"self"``: a LoRA student's
            own base with its adapters off.
        teacher_model_init_kwargs (`dict[str, Any] | str`, *optional*):
            Keyword arguments for the teacher's `from_pretrained` (default dtype: the student's).
        teacher_deepspeed (`dict[str, Any] | str`, *optional*):
            The teacher's own DeepSpeed config; absent with a DeepSpeed student: a ZeRO-3 inference config derived.
        teacher_step_pass (`bool`, *optional*, defaults to `True`):
            Run the teacher once per optimizer step over all its micro-batches (a ZeRO-3 teacher gathered once).
        teacher_batch_size (`int`, *optional*):
            At most this many rows per teacher forward in that pass (default: all rows of the step).
        teacher_tokenizer_name_or_path (`str`, *optional*):
            The teacher's tokenizer (default: the teacher's own); another vocabulary switches to cross-tokenizer KD.
        cross_tokenizer (`bool`, *optional*):
            Cross-tokenizer distillation on aligned text; default: on when the tokenizers differ.
        cross_tokenizer_matched_weight (`float`, *optional*):
            Weight of the divergence on the tokens both vocabularies hold (default: their share, as GOLD).
        cross_tokenizer_uld_weight (`float`, *optional*):
            Weight of the ULD term on the other tokens (default: 1 - matched).
        teacher_server (`str`, *optional*):
            URL of a vLLM server of the teacher: its top-k log-probs per loss token, no teacher loaded here.
        teacher_server_top_k (`int`, *optional*, defaults to `64`):
            Teacher token ids per loss token from the server (its --max-logprobs must be at least this).
        teacher_server_timeout (`float`, *optional*, defaults to `120.0`):
            Seconds per teacher-server request (3 retries with backoff).
        teacher_server_concurrency (`int`, *optional*, defaults to `4`):
            Teacher-server requests in flight per process.
        teacher_prompt (`str`, *optional*):
            The column (or `{column}` template) the teacher reads in place of each row's prompt: privileged context.

        > Loss

        divergence (`str`, *optional*, defaults to `"forward_kl"`):
            `forward_kl`, `reverse_kl`, `jsd`, `skew_forward_kl`, `skew_reverse_kl` or `tvd` (`loss_type` stays SFT's).
        temperature (`float`, *optional*, defaults to `1.0`):
            Softmax temperature of both models' logits in the KD term.
        alpha (`float`, *optional*, defaults to `0.5`):
            Weight of KD: ``alpha * KD + (1 - alpha) * CE``; 1 is pure distillation, 0 SFT.
        beta (`float`, *optional*, defaults to `0.5`):
            Teacher weight in the mixture of the generalized JSD.
        skew_alpha (`float`, *optional*, defaults to `0.1`):
            Skew of `skew_forward_kl` / `skew_reverse_kl` (DistiLLM).
        kd_temperature_scaling (`bool`, *optional*, defaults to `True`):
            Multiply KD by ``temperature**2`` (Hinton et al.).
        loss_chunk_size (`int`, *optional*):
            Completion tokens projected through the lm_heads at a time (default: about 128 MiB of fp32 logits).
        assistant_only_loss (`bool`, *optional*):
            KD and CE on assistant tokens only; default: on when the chat template marks them (SFT's default: off).

        > On-policy and rollouts

        lmbda (`float`, *optional*, defaults to `0.0`):
            Share of optimizer steps whose completions the student samples for the batch's prompts (GKD).
        seq_kd (`bool`, *optional*, defaults to `False`):
            On the other steps, completions sampled from the teacher instead of the dataset's.
        max_new_tokens (`int`, *optional*, defaults to `128`):
            Tokens sampled per completion.
        generation_temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of the completions (not the loss temperature).
        generation_top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling of the completions.
        generation_top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling of the completions (0: off).
        use_vllm (`bool`, *optional*, defaults to `False`):
            Sample the student's completions from a vLLM server of the student whose weights follow the trainer's.
        vllm_mode (`str`, *optional*, defaults to `"server"`):
            `server` (`trl-distill vllm-serve`); `colocate` is refused with one line.
        vllm_server_base_url (`str`, *optional*):
            Base URL of the rollout server; when set, host and port are ignored.
        vllm_server_host (`str`, *optional*, defaults to `"0.0.0.0"`):
            Host of the rollout server.
        vllm_server_port (`int`, *optional*, defaults to `8000`):
            Port of the rollout server.
        vllm_server_timeout (`float`, *optional*, defaults to `240.0`):
            Seconds the server may take to answer or sync before training stops with one line.
        vllm_group_port (`int`, *optional*, defaults to `51216`):
            Port on rank 0 for the weight-sync group with the server's workers.
        vllm_sync_steps (`int`, *optional*, defaults to `1`):
            Sync the student's weights to the server every this many optimizer steps.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            Weight each sampled token by the clipped ratio of the trainer's to the engine's probability.
        vllm_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            Upper bound of those weights (TRL's GRPO name).

        > On-policy objective

        on_policy_objective (`str`, *optional*, defaults to `"divergence"`):
            `divergence` (over the whole vocabulary) or `sampled_token` (a policy gradient on the sampled tokens).
        sampled_token_kl_coef (`float`, *optional*, defaults to `1.0`):
            The coefficient of each sampled token's reward, log p_teacher − log p_student.
        sampled_token_discount (`float`, *optional*, defaults to `0.0`):
            Each token's advantage also sums the later tokens' rewards, discounted by this per token.
        epsilon (`float`, *optional*, defaults to `0.2`):
            The importance ratio against the sampling engine is clipped to [1 − epsilon, 1 + epsilon_high].
        epsilon_high (`float`, *optional*):
            Its upper clip (default: epsilon).
        task_reward_funcs (`list[str]`, *optional*):
            Reward functions of each sampled completion (verifiers, TRL's signature) added to its advantages.
        task_reward_weight (`float`, *optional*, defaults to `1.0`):
            The task reward's weight beside the teacher's per-token reward.

        > Cache

        teacher_cache (`str`, *optional*):
            Train from this teacher cache (`trl-distill cache-teacher`) instead of a teacher; for `cache-teacher`:
            where it is written.

        > Several teachers

        teachers (`list[str]`, *optional*):
            Several teachers, each ``NAME=SOURCE`` (a model, ``cache:DIR`` or a server URL; dicts in a recipe).
        teacher_combine (`str`, *optional*, defaults to `"route"`):
            `route` (each row from the teacher its column names), `mixture` or `sum`.
        teacher_weights (`list[float]`, *optional*):
            The teachers' weights for mixture / sum, in the order of `teachers` (default: equal).
        teacher_column (`str`, *optional*, defaults to `"teacher"`):
            The dataset column naming each row's teacher (route); without it, `teacher_id` (TRL's name).

        > Long rows

        sequence_parallel_size (`int`, *optional*, defaults to `1`):
            Split each sequence over this many ranks (DeepSpeed Ulysses), student and teacher alike.
        sequence_parallel_attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            The attention both models run under sequence parallelism (not eager).

        > Metrics and guards

        log_distill_metrics (`bool`, *optional*, defaults to `True`):
            Log top-1 agreement, KL, teacher CE and the entropies, measured inside the fused loss.
        distill_metrics_every_step (`bool`, *optional*, defaults to `False`):
            Measure them on every step and log the mean, instead of on the logged steps only.
        stop_on_nonfinite_loss (`bool`, *optional*, defaults to `True`):
            Stop every rank before the backward when a rank's loss is NaN or inf.
        collapse_max_repetition (`float`, *optional*, defaults to `0.9`):
            On-policy: stop when the samples' repeated 4-gram share stays above this (1: off).
        collapse_min_entropy (`float`, *optional*, defaults to `0.02`):
            On-policy: stop when the student's entropy on its samples stays below this (0: off).
        collapse_patience (`int`, *optional*, defaults to `3`):
            Consecutive logging steps past a collapse bound before the run stops.
        teacher_ce_margin (`float`, *optional*, defaults to `0.0`):
            Warn at the first step when the teacher's CE on the data exceeds the student's by more than this.

        > Generation-based evaluation

        eval_reward_funcs (`list[str]`, *optional*):
            Verifiers that score the student's completions of the eval prompts in evaluate() (pass@k).
        num_generations_eval (`int`, *optional*, defaults to `1`):
            Completions per eval prompt (TRL's name); n > 1 also logs pass@n.
        eval_temperature (`float`, *optional*):
            Sampling temperature of the eval completions (default: greedy for one, generation_temperature for n).
        eval_max_new_tokens (`int`, *optional*):
            Tokens per eval completion at most (default: max_new_tokens).
        eval_generation_prompts (`int`, *optional*):
            Generate for the eval split's first N prompts only (default: all).
        eval_answer_column (`str`, *optional*):
            The column the built-in verifiers compare with (default: `answer`, else `solution`).
        eval_answer_pattern (`str`, *optional*):
            The regular expression `regex_match` extracts the answer with.

        > Reliability

        resume_allow_changes (`bool`, *optional*, defaults to `False`):
            Resume a checkpoint although the teacher or the distillation settings differ from the run that wrote it.
    """

    # Fields a JSON string may fill on the CLI (a TrainingArguments class attribute; transformers 5.24)
    _VALID_DICT_FIELDS = compat.valid_dict_fields(SFTConfig) + ["teacher_model_init_kwargs", "teacher_deepspeed"]

    def __post_init__(self):
        check_finite_settings(self)  # a NaN coefficient, temperature, ... named here, not as a NaN loss
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
        check_objective_args(self)  # on the student's samples: a divergence, or the sampled-token objective
        check_teacher_prompt_args(self)  # a teacher that reads its own prompt
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
