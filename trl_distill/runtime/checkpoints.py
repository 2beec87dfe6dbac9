"""Crash-safe checkpoints: a checkpoint counts as complete only once every rank has finished writing it.

The Trainer writes `checkpoint-N/` piece by piece (weights, each rank's optimizer shard and RNG state, then
`trainer_state.json`); a rank killed in between leaves a directory that looks usable and resumes wrongly or
crashes. After all ranks have written, rank 0 adds `MARKER`, listing every file and its size. Resuming with
`resume_from_checkpoint=True` takes the newest checkpoint whose marker checks out.
"""

from __future__ import annotations

import json
import logging
import os
import re

logger = logging.getLogger(__name__)

MARKER = "trl_distill_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _files(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    sizes.pop(MARKER, None)
    sizes.pop(MARKER + ".tmp", None)
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
    present = _files(checkpoint)
    return all(present.get(name) == size for name, size in recorded.items())


def _checkpoints(output_dir: str) -> list[str]:
    """`checkpoint-N` directories under `output_dir`, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)
            if os.path.isdir(os.path.join(output_dir, name))]


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | bool | None:
    """What to pass to `Trainer.train(resume_from_checkpoint=...)`.

    ``True``: the newest complete checkpoint in `output_dir` (incomplete ones are skipped, with a warning); if
    none carries a marker (checkpoints written without trl_distill), the Trainer's own choice. A path: refused
    when it is one of ours left incomplete, naming the newest complete one instead.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return resume_from_checkpoint
    candidates = _checkpoints(output_dir)
    complete = [c for c in candidates if is_complete(c)]
    if resume_from_checkpoint is True:
        if not complete:
            return True
        skipped = candidates[: candidates.index(complete[0])]
        if skipped:
            logger.warning(f"Skipping incomplete checkpoint(s) {skipped} (a run stopped while writing them).")
        return complete[0]
    path = str(resume_from_checkpoint)
    if os.path.isdir(path) and not is_complete(path):
        if os.path.exists(os.path.join(path, MARKER)) or complete:
            instead = f" The newest complete one is {complete[0]!r}." if complete else ""
            raise ValueError(f"Checkpoint {path!r} is incomplete (a run stopped while writing it).{instead}")
        logger.warning(f"Checkpoint {path!r} has no completeness marker (not written by trl_distill); using it.")
    return path


RECORDED_SETTINGS = ("divergence", "temperature", "alpha", "beta", "skew_alpha", "kd_temperature_scaling", "lmbda",
                     "seq_kd", "teacher_cache")


def run_record(args, teacher: str | None, world_size: int, deepspeed: bool) -> dict:
    """What a checkpoint records of the run that wrote it: the teacher, the distillation settings, the process
    count and whether DeepSpeed holds per-rank optimizer states (see `check_resume`)."""
    return {"world_size": world_size, "deepspeed": bool(deepspeed),
            "settings": {"teacher": teacher, **{name: getattr(args, name) for name in RECORDED_SETTINGS}}}


def check_resume(checkpoint: str, run: dict, allow_changes: bool = False) -> None:
    """Refuse to resume `checkpoint` with another distillation set-up than the one that wrote it (unless
    `allow_changes`), or on another number of processes when its optimizer states are DeepSpeed's per-rank
    partitions; one line naming what differs and the way out. A checkpoint without a record is not checked."""
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
