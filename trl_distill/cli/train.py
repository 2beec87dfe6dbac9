"""`trl-distill` (training): TRL's dataset and model flags plus every `DistillationConfig` field, then train."""

from __future__ import annotations

from ..report.history import write_run_record
from ..run_plan import RunPlan, resolve
from .errors import (
    Terminated,
    errors_as_messages,
    faults_as_messages,
    kept_checkpoint,
    note_sigterm,
    sigterm_raises,
)


def make_parser():
    from trl import ModelConfig, ScriptArguments, TrlParser

    from ..config import DistillationConfig

    return TrlParser((ScriptArguments, DistillationConfig, ModelConfig), prog="trl-distill")


def validate(script_args, training_args, model_args) -> None:
    """Checks that need no model: fail in seconds, before anything is loaded or written."""
    from ..runtime.validation import (
        check_apart,
        check_model_path,
        check_weights_complete,
        refuse_quantization_without_gpu,
    )
    from ..teacher.resolve import check_teacher_flags
    from ..teacher.specs import parse_teachers

    if not model_args.model_name_or_path:
        raise ValueError("Pass the student with --model_name_or_path.")
    check_teacher_flags(parse_teachers(training_args.teachers), training_args, model_args.use_peft)
    if model_args.load_in_4bit or model_args.load_in_8bit:
        refuse_quantization_without_gpu({"load_in_4bit": True}, "--load_in_4bit/--load_in_8bit")
    check_model_path(model_args.model_name_or_path, "--model_name_or_path")
    check_weights_complete(model_args.model_name_or_path, "--model_name_or_path")
    if not script_args.dataset_name:
        raise ValueError("Pass a dataset with --dataset_name (a hub id, a .jsonl/.json/.parquet/.csv file or a dir).")
    from ..data.prepare import named_datasets

    named = named_datasets(script_args.dataset_name) if training_args.teachers else None
    inputs = {f"the dataset {k} (--dataset_name)": path for k, paths in named.items() for path in paths} if named \
        else {"the dataset (--dataset_name)": script_args.dataset_name}
    check_apart(training_args.output_dir, inputs)


def build_trainer(script_args, training_args, model_args, plan: RunPlan | None = None):
    """The `DistillationTrainer` the command line describes: data loaded and checked, student and PEFT set up.
    `plan`: the arguments' plan where the caller resolved them (else resolved here)."""
    from trl import get_peft_config, get_quantization_config

    from ..data.prepare import named_datasets
    from ..trainer import DistillationTrainer

    validate(script_args, training_args, model_args)
    plan = resolve(training_args) if plan is None else plan
    named = named_datasets(script_args.dataset_name) if training_args.teachers else None
    if named is None:
        train, evaluation = load_splits(script_args, training_args, plan, script_args.dataset_name, "--dataset_name")
    else:  # several teachers, a dataset each: routed as a whole (each evaluated apart, eval_NAME_loss)
        splits = {name: load_named(script_args, training_args, plan, name, paths) for name, paths in named.items()}
        train = {name: split[0] for name, split in splits.items()}
        evaluation = None if training_args.eval_strategy == "no" else {
            name: split[1].add_column(training_args.teacher_column, [name] * len(split[1]))
            for name, split in splits.items()}
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


def load_named(script_args, training_args, plan: RunPlan, name: str, paths: list[str]):
    """``(train, eval or None)`` of the teacher `name`'s datasets (``--dataset_name name=A,name=B``): all their rows, in
    order, each dataset checked as `load_splits` checks one; datasets of different formats are one line naming
    both."""
    from datasets import concatenate_datasets

    from ..data.prepare import dataset_format

    parts = [load_splits(script_args, training_args, plan, path, f"--dataset_name {name}={path}") for path in paths]
    if len(parts) == 1:
        return parts[0]
    formats = {path: dataset_format(train) for path, (train, _) in zip(paths, parts, strict=True)}
    if len(set(formats.values())) > 1:
        raise ValueError(f"--dataset_name gives the teacher {name!r} datasets of different formats ("
                         f"{', '.join(f'{path}: {fmt}' for path, fmt in formats.items())}); convert them to one "
                         "format.")
    evaluation = None if parts[0][1] is None else concatenate_datasets([split[1] for split in parts])
    return concatenate_datasets([split[0] for split in parts]), evaluation


def load_splits(script_args, training_args, plan: RunPlan, name: str, what: str):
    """``(train, eval or None)`` of the dataset `name`, each split checked (`what`: the flag, in messages; `plan`:
    the arguments', whose verifiers and task rewards read the splits' references)."""
    from ..data.prepare import check_format, load_dataset_any
    from ..evaluation.references import check_loaded_references

    dataset = load_dataset_any(name, script_args.dataset_config, what)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(f"No split {script_args.dataset_train_split!r} in the dataset {name!r} (found "
                         f"{sorted(dataset)}); set --dataset_train_split.")
    train = dataset[script_args.dataset_train_split]
    if training_args.dataset_text_field == "text":  # a custom text field is SFT's to check
        check_format(train, script_args.dataset_train_split)
    evaluation = None if training_args.eval_strategy == "no" else dataset.get(script_args.dataset_test_split)
    if evaluation is None and training_args.eval_strategy != "no":
        raise ValueError(f"eval_strategy is {training_args.eval_strategy!r} but the dataset has no "
                         f"{script_args.dataset_test_split!r} split; set --dataset_test_split or --eval_strategy no.")
    check_loaded_references(plan.evaluation, plan.on_policy.task_rewards, name,
                            {"train": (script_args.dataset_train_split, train),
                             "eval": (script_args.dataset_test_split, evaluation)})
    return train, evaluation


def parse_recipe(parser, argv: list[str]):
    """`parser.parse_args_and_config(argv)`: a recipe (``--config FILE``) that is not valid YAML is one line naming
    the file and the line, not yaml's traceback."""
    import yaml

    path = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    if path is None and "--config" in argv:
        raise ValueError("--config needs the path of a YAML recipe.")
    try:
        return parser.parse_args_and_config(args=argv)
    except yaml.YAMLError as error:
        mark, context = getattr(error, "problem_mark", None), getattr(error, "context", None)
        opened = getattr(error, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "not YAML"
        problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
        if context and opened is not None:
            problem += f" ({context} from line {opened.line + 1})"
        raise ValueError(f"{path}: {where}: {problem}. The recipe (--config) is not valid YAML.") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}). The recipe (--config) must "
                         "be a YAML file.") from error


def check_student_eos(script_args, training_args, model_args) -> None:
    """The student's tokenizer has an EOS, or --eos_token gives one (`data.prepare.check_eos_token`)."""
    from ..data.prepare import check_eos_before_loading

    if (training_args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        return  # SFT adds no EOS to data it does not prepare
    check_eos_before_loading(model_args.model_name_or_path, script_args.dataset_name, script_args.dataset_config,
                             script_args.dataset_train_split, training_args.eos_token)


def saved_line(output_dir: str, teacher, alpha: float, lora: bool) -> str:
    """What the run saved, said as it is: a distilled student, or with alpha 0 a student trained on the CE alone (the
    SFT baseline when no `teacher` was loaded); a LoRA student's adapter (`lora`) as an adapter, with the way to a
    whole model."""
    from ..teacher.no_teacher import NoTeacher

    if isinstance(teacher, NoTeacher):
        what = "SFT baseline (alpha 0, no teacher)"
    elif alpha == 0:
        what = "Student trained on the cross-entropy alone (alpha 0: the teacher measured, not distilled)"
    else:
        what = "Distilled student"
    report = f"its curves: trl-distill report {output_dir}"
    if lora:  # `save_model` wrote the adapter only
        return (f"{what}: its LoRA adapter saved to {output_dir} (a whole model: trl-distill merge --adapter "
                f"{output_dir} --output DIR); {report}")
    return f"{what} saved to {output_dir}; {report}"


def main(argv: list[str]) -> None:
    """`trl-distill [flags]`: parse, set up (bad input: one line), then train and save (an expected fault: one line;
    SIGTERM: one line naming the checkpoint to resume; our own bugs keep their traceback)."""
    with sigterm_raises():
        with errors_as_messages():
            script_args, training_args, model_args = parse_recipe(make_parser(), argv)
            plan = resolve(training_args)  # how the fields combine: one line before anything loads
            check_student_eos(script_args, training_args, model_args)
            trainer = build_trainer(script_args, training_args, model_args, plan)
            resume = trainer.resume_point(training_args.resume_from_checkpoint)
            jit_stopped = note_sigterm()  # --enable_jit_checkpoint: the HF Trainer's handler saves and stops
        # an expected fault from here on is one line too (a full disk, a dead server, SIGTERM)
        with faults_as_messages(kept=lambda: kept_checkpoint(training_args.output_dir)):
            trainer.train(resume_from_checkpoint=resume)
            if jit_stopped.is_set() and trainer.state.global_step < trainer.state.max_steps:
                raise Terminated  # stopped early with its checkpoint saved: not a result to save as the student
            trainer.save_model(training_args.output_dir)
            trainer.save_state()  # trainer_state.json, and our run record beside it: what `trl-distill report` reads
            if trainer.accelerator.is_main_process:
                write_run_record(training_args.output_dir, trainer.run_record())
    if trainer.accelerator.is_main_process:  # global rank 0, the one that wrote it
        print(saved_line(training_args.output_dir, trainer.teacher, training_args.alpha,
                         lora=hasattr(trainer.model, "peft_config")))
