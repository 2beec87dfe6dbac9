"""What `DistillationConfig.__post_init__` does before `TrainingArguments.__post_init__` runs: each field checked
alone (a value no run can take, named as the config is built), and the values transformers reads put in the form
it needs. How the fields combine is `trl_distill.run_plan.resolve`'s."""

from __future__ import annotations

import os

from .constants import LOSS_TYPES


def check_each_field(args) -> None:
    """One line for a value of one field that no run can take."""
    from .runtime.guards import check_finite_settings

    check_finite_settings(args)  # a NaN coefficient, temperature, ... named here, not as a NaN loss
    if args.divergence not in LOSS_TYPES:
        raise ValueError(f"Unknown divergence {args.divergence!r}; choose one of {', '.join(LOSS_TYPES)}.")
    if not args.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {args.temperature}.")
    if args.max_new_tokens < 1 or not args.generation_temperature > 0 or not 0 < args.generation_top_p <= 1:
        raise ValueError(
            "Generation settings: max_new_tokens must be >= 1, generation_temperature > 0, generation_top_p in "
            f"(0, 1]; got {args.max_new_tokens}, {args.generation_temperature}, {args.generation_top_p}."
        )
    for name in ("alpha", "beta", "skew_alpha", "lmbda"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
    if args.gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {args.gradient_accumulation_steps}.")
    _check_counts(args)
    if args.max_steps == 0:
        raise ValueError("max_steps=0 trains nothing (and would still save over output_dir): pass max_steps > 0, "
                         "or -1 to train for num_train_epochs.")
    if args.teacher_batch_size is not None and args.teacher_batch_size < 1:
        raise ValueError(f"teacher_batch_size must be a positive integer or None, got {args.teacher_batch_size}.")
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        raise ValueError(f"loss_chunk_size must be a positive integer or None, got {args.loss_chunk_size}.")
    if args.teacher_fsdp_config is not None:  # read as the teacher attaches, after the student loaded: named here
        from .runtime.fsdp2 import TeacherShardSettings

        TeacherShardSettings.parse(args.teacher_fsdp_config)


def _check_counts(args) -> None:
    """The integer knobs a 0 or a negative value breaks only later (a DataLoader, generation), refused as the config
    is built. Those transformers already refuses clearly (``logging_steps 0``, ``warmup_steps < 0``) are left to
    it; those that depend on another field (``save_steps``, ``num_train_epochs``) are `run_plan.resolve`'s."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}.")
    if args.max_length is not None and args.max_length < 1:
        raise ValueError(f"max_length must be a positive integer or None (no truncation), got {args.max_length}.")
    for name in ("logging_steps", "eval_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}.")
    if args.dataloader_num_workers < 0:
        raise ValueError(f"dataloader_num_workers must be >= 0, got {args.dataloader_num_workers}.")
    if args.generation_top_k < 0:
        raise ValueError(f"generation_top_k must be >= 0 (0: off), got {args.generation_top_k}.")


def student_deepspeed(config):
    """The student's DeepSpeed config as `TrainingArguments.__post_init__` needs it: `deepspeed=` (or the one
    `accelerate launch` names) read leniently, as a dict."""
    return _lenient_deepspeed(config if config else _accelerate_deepspeed_file())


def settle_for_transformers(args) -> None:
    """The other values `TrainingArguments.__post_init__` reads, in the form it needs: `resume_from_checkpoint` as
    the API's, TRL's activation-checkpointing names carried over, and the precision a machine without GPU can train
    in; and a reward-function list given as one name (a recipe, the API) as a list of it, as it is written out."""
    from .model.precision import settle_precision

    if isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint.lower() in ("true", "false"):
        # the CLI hands `--resume_from_checkpoint true` over as a string: the API's True (newest checkpoint)
        args.resume_from_checkpoint = True if args.resume_from_checkpoint.lower() == "true" else None
    _use_activation_checkpointing_names(args)
    settle_precision(args)
    for name in ("eval_reward_funcs", "task_reward_funcs"):
        if isinstance(getattr(args, name), str):
            setattr(args, name, [getattr(args, name)])


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
    from .runtime.deepspeed_config import load_deepspeed_config

    config = load_deepspeed_config(config)
    if "train_batch_size" not in config:
        config.setdefault("train_micro_batch_size_per_gpu", "auto")
        config.setdefault("gradient_accumulation_steps", "auto")
    return config
