"""`trl-distill`: distil a teacher into a student from the command line, the way `trl sft` trains.

    trl-distill --model_name_or_path STUDENT --teacher_model_name_or_path TEACHER --dataset_name DATA \
        --output_dir OUT [--config recipe.yaml] [--divergence reverse_kl ...] [--use_peft --lora_r 16 ...]
    trl-distill merge --adapter DIR --output DIR     # a LoRA student's adapter merged into its base model
    trl-distill plan --student S --teacher T --nodes 2 --gpus_per_node 8 --gpu_memory_gb 80   # memory per GPU
    trl-distill cache-teacher --teacher_cache DIR --cache_top_k 64 [the training flags]   # teacher top-k, once
    trl-distill --teacher_cache DIR [the training flags]            # then train students without the teacher

Runs under `accelerate launch --config_file configs/...yaml`, `torchrun` and plain `python -m trl_distill`.
Every `DistillationConfig` (so `SFTConfig` and `TrainingArguments`) field is a flag, as are TRL's
`ScriptArguments` (dataset) and `ModelConfig` (student model, PEFT) fields.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

# `trl-distill NAME ...`: tools beside training, each a module with `main(argv)`
SUBCOMMANDS = {"merge": "trl_distill.merge", "plan": "trl_distill.plan", "cache-teacher": "trl_distill.cache.cli"}


def make_parser():
    from trl import ModelConfig, ScriptArguments, TrlParser

    from .config import DistillationConfig

    return TrlParser((ScriptArguments, DistillationConfig, ModelConfig), prog="trl-distill")


def validate(script_args, training_args, model_args) -> None:
    """Checks that need no model: fail in seconds, before anything is loaded or written."""
    from .validation import check_model_path, refuse_quantization_without_gpu

    if not model_args.model_name_or_path:
        raise ValueError("Pass the student with --model_name_or_path.")
    if not training_args.teacher_model_name_or_path and not training_args.teacher_cache:
        raise ValueError("Pass the teacher with --teacher_model_name_or_path (or a cache of it with --teacher_cache).")
    if training_args.teacher_model_name_or_path == "self" and not model_args.use_peft:
        raise ValueError("--teacher_model_name_or_path self (self-distillation) needs a LoRA student: add --use_peft.")
    if model_args.load_in_4bit or model_args.load_in_8bit:
        refuse_quantization_without_gpu({"load_in_4bit": True}, "--load_in_4bit/--load_in_8bit")
    check_model_path(model_args.model_name_or_path, "--model_name_or_path")
    if training_args.teacher_cache:
        pass  # the teacher is not loaded: its weights need not exist here
    elif training_args.teacher_model_name_or_path != "self":
        check_model_path(training_args.teacher_model_name_or_path, "--teacher_model_name_or_path")
    if not script_args.dataset_name:
        raise ValueError("Pass a dataset with --dataset_name (a hub id, a .jsonl/.json/.parquet/.csv file or a dir).")


def run(script_args, training_args, model_args) -> None:
    trainer = build_trainer(script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:  # global rank 0, the one that wrote it
        print(f"Distilled student saved to {training_args.output_dir}")


def build_trainer(script_args, training_args, model_args):
    """The `DistillationTrainer` the command line describes: data loaded and checked, student and PEFT set up."""
    from trl import get_peft_config, get_quantization_config

    from .data import check_format, load_dataset_any
    from .trainer import DistillationTrainer

    validate(script_args, training_args, model_args)
    dataset = load_dataset_any(script_args.dataset_name, script_args.dataset_config)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"No split {script_args.dataset_train_split!r} in the dataset (found {sorted(dataset)}); "
            "set --dataset_train_split."
        )
    train = dataset[script_args.dataset_train_split]
    if training_args.dataset_text_field == "text":  # a custom text field is SFT's to check
        check_format(train, script_args.dataset_train_split)
    evaluation = None
    if training_args.eval_strategy != "no":
        evaluation = dataset.get(script_args.dataset_test_split)
        if evaluation is None:
            raise ValueError(
                f"eval_strategy is {training_args.eval_strategy!r} but the dataset has no "
                f"{script_args.dataset_test_split!r} split; set --dataset_test_split or --eval_strategy no."
            )
    model_init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                         "dtype": model_args.dtype, "trust_remote_code": training_args.trust_remote_code}
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:  # QLoRA, on a GPU (validate() refused it without one)
        model_init_kwargs["quantization_config"] = quantization_config
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    return DistillationTrainer(
        model_args.model_name_or_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        peft_config=get_peft_config(model_args),
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `trl-distill` console script and `python -m trl_distill`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    parser = make_parser()
    with errors_as_messages():
        script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
        run(script_args, training_args, model_args)


@contextlib.contextmanager
def errors_as_messages():
    """Bad input ends the command with one line, `trl-distill: error: ...`, and exit status 2."""
    try:
        yield
    except (ValueError, FileNotFoundError, TypeError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"trl-distill: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
