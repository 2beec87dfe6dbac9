"""What a run left to report on: its `trainer_state.json` (the output directory's, else its newest checkpoint's)
and its run record (`trl_distill_run.json` beside it, else a checkpoint's completion marker)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import ExternalError
from ..runtime.checkpoints import MARKER, checkpoints_newest_first

RUN_RECORD = "trl_distill_run.json"  # written by `trl-distill` beside the final model


class ReportError(ExternalError):
    """The directory holds nothing to report on."""


@dataclass
class RunHistory:
    """A run's logged values: ``series[name]`` = ``[(step, value), ...]`` in step order, plus its settings."""

    directory: str
    state_file: str
    global_step: int
    max_steps: int
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    run: dict = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)
    """trainer_state.json files found but not readable (cut short, not JSON), newer than `state_file`."""

    def values(self, name: str) -> list[tuple[int, float]]:
        return self.series.get(name, [])


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_history(directory: str) -> RunHistory:
    """The run in `directory` (a `trl-distill` output directory, or one of its checkpoints)."""
    if not os.path.isdir(directory):
        raise ReportError(f"{directory} is not a directory: pass the output_dir of a run (`trl-distill report OUT`).")
    candidates = [directory, *checkpoints_newest_first(directory)]
    passed_over, state_file, state = [], None, None
    for candidate in candidates:  # the output directory's, else the newest checkpoint's that reads
        path = os.path.join(candidate, "trainer_state.json")
        if not os.path.isfile(path):
            continue
        state = _read_json(path)
        if isinstance(state, dict):
            state_file = path
            break
        passed_over.append(path)
        state = None
    if state is None:
        unreadable = f" ({', '.join(passed_over)} cannot be read: cut short?)" if passed_over else ""
        raise ReportError(f"{directory} holds no readable trainer_state.json, nor do its checkpoints{unreadable}: "
                          "`trl-distill` writes one when training ends (Python API: call trainer.save_state()).")
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in state.get("log_history", []):
        if "train_runtime" in entry or "step" not in entry:
            continue  # the run's summary line
        for name, value in entry.items():
            if name not in ("step", "epoch") and isinstance(value, int | float):
                series.setdefault(name, []).append((int(entry["step"]), float(value)))
    run = _read_json(os.path.join(directory, RUN_RECORD)) or next(
        (record["run"] for c in checkpoints_newest_first(directory)
         if (record := _read_json(os.path.join(c, MARKER))) and record.get("run")), {})
    return RunHistory(directory, state_file, int(state.get("global_step", 0)), int(state.get("max_steps", 0)),
                      series, run, passed_over)


def write_run_record(directory: str, run: dict) -> str:
    """Write `run` (`DistillationTrainer.run_record()`) as `RUN_RECORD` in `directory`, whole or not at all."""
    path = os.path.join(directory, RUN_RECORD)
    with open(path + ".tmp", "w") as f:
        json.dump(run, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path
