"""Crash-safe checkpoints: a checkpoint counts as complete only once every rank has finished writing it.

The Trainer writes `checkpoint-N/` piece by piece (weights, each rank's optimizer shard and RNG state, then
`trainer_state.json`); a rank killed in between leaves a directory that looks usable and resumes wrongly or
crashes. After all ranks have written, rank 0 adds `MARKER`, listing every file and its size. Resuming with
`resume_from_checkpoint=True` takes the newest checkpoint whose marker checks out, and starts afresh (saying so)
when there is none; a checkpoint of ours without a valid marker is never resumed. The marker records the run
(`run_record`: the student's architecture, the teacher, the distillation settings), which a resume must match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

MARKER = "trl_distill_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


# What the HF Trainer's JIT checkpoint (`--enable_jit_checkpoint`, transformers 5.x trainer_jit_checkpoint.py)
# writes in a checkpoint while it saves it and removes once saved: not one of its files, and a sign it is not whole
JIT_IN_PROGRESS = "checkpoint-is-incomplete.txt"


def _files(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    sizes.pop(MARKER, None)
    sizes.pop(MARKER + ".tmp", None)
    sizes.pop(JIT_IN_PROGRESS, None)
    return sizes


def mark_complete(checkpoint: str, run: dict | None = None) -> None:
    """Record that `checkpoint` is whole (call on one rank, after every rank has finished writing it), with the
    `run` that wrote it (its distillation settings and process count, for `check_resume`)."""
    tmp = os.path.join(checkpoint, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": _files(checkpoint), "run": run}, f)
    os.replace(tmp, os.path.join(checkpoint, MARKER))  # atomic: the marker is there whole or not at all


def is_complete(checkpoint: str) -> bool:
    """Whether `checkpoint` has a marker and still holds every file it lists, at the recorded sizes."""
    try:
        with open(os.path.join(checkpoint, MARKER)) as f:
            recorded = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return False
    if os.path.exists(os.path.join(checkpoint, JIT_IN_PROGRESS)):
        return False
    present = _files(checkpoint)
    return all(present.get(name) == size for name, size in recorded.items())


def checkpoints_newest_first(output_dir: str) -> list[str]:
    """`checkpoint-N` directories under `output_dir`, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)
            if os.path.isdir(os.path.join(output_dir, name))]


def written_by_us(checkpoint: str) -> bool:
    """Whether trl_distill wrote `checkpoint` (its pickled training arguments are a `DistillationConfig`, or it holds
    our marker): without a valid marker such a checkpoint is incomplete, whatever else it holds."""
    if os.path.exists(os.path.join(checkpoint, MARKER)) or os.path.exists(os.path.join(checkpoint, MARKER + ".tmp")):
        return True
    try:
        with open(os.path.join(checkpoint, "training_args.bin"), "rb") as f:
            return b"trl_distill" in f.read(4 << 20)  # the class's module, as pickled (torch.save stores, never packs)
    except OSError:
        return False


def resumable(checkpoint: str) -> bool:
    """A checkpoint a resume may use: ours and marked complete, or another trainer's that holds its trainer state
    (what the Trainer reads first; such a one has no marker to check)."""
    if is_complete(checkpoint):
        return True
    return not written_by_us(checkpoint) and os.path.isfile(os.path.join(checkpoint, "trainer_state.json"))


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once per run, not once per rank
        logger.warning(message)


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | bool | None:
    """What to pass to `Trainer.train(resume_from_checkpoint=...)`.

    ``True``: the newest `resumable` checkpoint in `output_dir` (incomplete ones are skipped, with a warning);
    with none (a new or empty `output_dir`, or only checkpoints a run stopped writing) None, a fresh start, said in
    one line: the preemptible job's ``--resume_from_checkpoint true`` on every start. A path: refused when it is
    one of ours left incomplete, naming the newest complete one instead; another trainer's is used as it is.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return resume_from_checkpoint
    candidates = checkpoints_newest_first(output_dir)
    usable = [c for c in candidates if resumable(c)]
    if resume_from_checkpoint is True:
        incomplete = [os.path.basename(c) for c in candidates[: candidates.index(usable[0]) if usable else None]]
        if not usable:
            found = f" ({', '.join(incomplete)} incomplete: a run stopped while writing)" if incomplete else ""
            _say(f"--resume_from_checkpoint true: no complete checkpoint in {output_dir!r}{found}; starting from "
                 "step 0.")
            return None
        if incomplete:
            _say(f"Skipping incomplete checkpoint(s) {incomplete} in {output_dir!r} (a run stopped while writing "
                 f"them); resuming {os.path.basename(usable[0])}.")
        if not is_complete(usable[0]):
            _say(f"Checkpoint {usable[0]!r} has no completeness marker (not written by trl_distill); using it.")
        return usable[0]
    path = str(resume_from_checkpoint)
    if os.path.isdir(path) and not is_complete(path):
        complete = [c for c in candidates if is_complete(c)]
        if written_by_us(path) or complete:
            instead = f" The newest complete one is {complete[0]!r}." if complete else ""
            raise ValueError(f"Checkpoint {path!r} is incomplete (a run stopped while writing it).{instead}")
        _say(f"Checkpoint {path!r} has no completeness marker (not written by trl_distill); using it.")
    return path


@dataclass(frozen=True)
class RecordedSettings:
    """The distillation settings a checkpoint records (`run_record`), as the run plan has them: a resume under others
    is another set-up (`check_resume`). Each field is the `DistillationConfig` field of its name."""

    divergence: str
    temperature: float
    alpha: float
    beta: float
    skew_alpha: float
    kd_temperature_scaling: bool
    lmbda: float
    seq_kd: bool
    teacher_cache: str | None
    on_policy_objective: str
    task_reward_funcs: tuple[str, ...] | None  # recorded as a list
    teacher_prompt: str | None

# Config entries that do not shape the weights (ids, dtype, runtime switches): left out of the architecture hash
_NOT_ARCHITECTURE = {"transformers_version", "dtype", "torch_dtype", "attn_implementation", "use_cache",
                     "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
                     "output_hidden_states", "output_attentions", "return_dict", "use_return_dict", "id2label",
                     "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
                     "quantization_config", "initializer_range", "torchscript", "chunk_size_feed_forward",
                     "architectures", "name_or_path"}
_PEFT_ARCHITECTURE = ("peft_type", "r", "target_modules", "modules_to_save", "use_dora", "bias", "layers_to_transform")


def _architecture(values):
    if isinstance(values, dict):
        return {k: _architecture(v) for k, v in sorted(values.items())
                if k not in _NOT_ARCHITECTURE and not k.startswith("_") and "dropout" not in k}
    if isinstance(values, list | tuple | set):
        return sorted(map(str, values)) if isinstance(values, set) else [_architecture(v) for v in values]
    return values


def student_identity(student, peft_config=None, trust_remote_code: bool = False) -> dict | None:
    """``{"name", "architecture"}`` of a student (a path / hub id or a model): its name and a hash of its config's
    entries that shape the weights (and of its LoRA's rank and targets); None when its config cannot be read."""
    config = None
    if isinstance(student, str | os.PathLike):
        name = os.fspath(student)
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - unreadable here: the load names it; nothing to record
            logger.debug("Not recording the student %s: %s", name, error)
            return None
    else:
        base = student.get_base_model() if hasattr(student, "get_base_model") else student
        config, name = getattr(base, "config", None), str(getattr(base, "name_or_path", "") or type(base).__name__)
        peft_config = peft_config or (getattr(student, "peft_config", None) or {}).get("default")
    if config is None:
        return None
    values = {"model": _architecture(config.to_dict())}
    if peft_config is not None:
        peft = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(vars(peft_config))
        values["lora"] = _architecture({k: peft.get(k) for k in _PEFT_ARCHITECTURE})
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"name": name, "architecture": digest}


def run_record(settings: RecordedSettings, teacher: str | None, world_size: int, deepspeed: bool,
               student: dict | None = None) -> dict:
    """What a checkpoint records of the run that wrote it: the teacher, the distillation `settings` (the run plan's),
    the student (`student_identity`), the process count and whether DeepSpeed holds per-rank optimizer states (see
    `check_resume`)."""
    values = asdict(settings)
    if values["task_reward_funcs"] is not None:
        values["task_reward_funcs"] = list(values["task_reward_funcs"])
    record = {"world_size": world_size, "deepspeed": bool(deepspeed), "settings": {"teacher": teacher, **values}}
    if student is not None:
        record["student"] = student
    return record


def check_resume(checkpoint: str, run: dict, allow_changes: bool = False) -> None:
    """Refuse to resume `checkpoint` with another student architecture or distillation set-up than the one that
    wrote it (unless `allow_changes`), or on another number of processes when its optimizer states are DeepSpeed's
    per-rank partitions; one line naming what differs and the way out. A checkpoint without a record is not checked."""
    try:
        with open(os.path.join(checkpoint, MARKER)) as f:
            recorded = json.load(f).get("run")
    except (OSError, ValueError):
        return
    if not recorded:
        return
    if recorded.get("deepspeed") and recorded.get("world_size") != run.get("world_size"):
        raise ValueError(
            f"Checkpoint {checkpoint!r} was written by {recorded.get('world_size')} processes and this run has "
            f"{run.get('world_size')}: its DeepSpeed optimizer states are partitioned per process. Resume on "
            f"{recorded.get('world_size')} processes, or start a new run from its weights (--model_name_or_path "
            f"{checkpoint})."
        )
    theirs, mine = recorded.get("student"), run.get("student")
    if theirs and mine and theirs.get("architecture") != mine.get("architecture"):
        line = (f"Checkpoint {checkpoint!r} was trained from another student: {theirs.get('name')!r} (architecture "
                f"{theirs.get('architecture')}) there, {mine.get('name')!r} (architecture {mine.get('architecture')}) "
                "now")
        if not allow_changes:
            raise ValueError(f"{line}. Resume with that student (--model_name_or_path), start a new run in another "
                             "--output_dir, or pass --resume_allow_changes true to resume it anyway.")
        logger.warning(f"{line}; resuming anyway (--resume_allow_changes).")
    settings = recorded.get("settings", {})
    differing = [f"{key}: {settings[key]!r} there, {value!r} now" for key, value in run.get("settings", {}).items()
                 if key in settings and settings[key] != value]
    if differing and not allow_changes:
        raise ValueError(f"Checkpoint {checkpoint!r} was trained with other distillation settings ("
                         f"{'; '.join(differing)}). Resume with the same settings, or pass --resume_allow_changes "
                         "true to change them on purpose.")
    if differing:
        logger.warning(f"Resuming {checkpoint} with changed settings: {'; '.join(differing)}.")


def resume_point(resume_from_checkpoint: str | bool | None, output_dir: str, run: dict,
                 allow_changes: bool = False) -> str | bool | None:
    """`resolve_resume`, then `check_resume` on the checkpoint it picks."""
    resume = resolve_resume(resume_from_checkpoint, output_dir)
    if isinstance(resume, str):
        check_resume(resume, run, allow_changes)
    return resume


def save_complete_checkpoint(context, save, model, trial, run_dir: str, record: dict) -> None:
    """`save(model, trial)` (the Trainer's own checkpoint save, into `run_dir`) marked complete once every rank's part
    is on disk; older checkpoints are rotated out (`save_total_limit`) only after that, never before the new one is
    complete, so a crash in between still leaves a complete checkpoint."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    args, state = context.args, context.state
    limit, args.save_total_limit = args.save_total_limit, None  # the Trainer would rotate inside `save`
    try:
        save(model, trial)
    finally:
        args.save_total_limit = limit
    context.accelerator.wait_for_everyone()  # every rank's optimizer shard and RNG state is on disk
    if args.should_save:
        mark_complete(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"), record)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
