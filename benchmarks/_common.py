"""What every benchmark shares: one description of the machine, the README block a benchmark rewrites and a step
timer. Workers write their per-rank records with `trl_distill.testing.write_rank_record`."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "trl")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine(**extra) -> dict:
    """The machine and software a result was measured on (one schema for every benchmark), plus `extra`."""
    from importlib.metadata import version

    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(),
            **{package: version(package) for package in PACKAGES},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": list(os.getloadavg()), **extra}


def replace_readme_block(markers: tuple[str, str], block: str, readme: Path = ROOT / "docs" / "benchmarks.md") -> bool:
    """Replace what stands between the two markers of the results page (docs/benchmarks.md) by `block`; False when
    the page lacks them."""
    start, end = markers
    text = readme.read_text()
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    readme.write_text(f"{head}{start}\n{block.rstrip()}\n{end}{rest.split(end, 1)[1]}")
    return True


def median_range(d: dict | None, fmt: str = ".0f") -> str:
    """``median [min, max]`` of a summary or ratio dict; "n/a" when it has none (no repeat succeeded)."""
    return f"{d['median']:{fmt}} [{d['min']:{fmt}}, {d['max']:{fmt}}]" if d and "median" in d else "n/a"


def step_timer(split=None):
    """A Trainer callback recording the `time.perf_counter()` at the end of every optimizer step (`.ends`), and
    snapshotting `split` (a `step_split.Split`) there when given."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.split = split

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            if self.split is not None:
                self.split.snapshot()

    return StepTimer()


def summarise(values: list[float]) -> dict:
    """``{"median", "min", "max"}`` of per-repeat values (what `median_range` prints)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_into(function, spent: list[float]):
    """`function`, adding the seconds each call takes to ``spent[0]``."""

    def timed(*arguments, **keywords):
        start = time.perf_counter()
        try:
            return function(*arguments, **keywords)
        finally:
            spent[0] += time.perf_counter() - start

    return timed


def train_timed(trainer, spent: list[float]) -> dict:
    """Train; the mean seconds per optimizer step after the first (logit check, warm-up), ``step_s``, and of them
    the seconds `spent` gathered (a `timed_into` counter), ``teacher_s``."""
    from transformers import TrainerCallback

    marks = []  # (time, seconds spent so far) at each optimizer step's end: a step is from one end to the next

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            marks.append((time.perf_counter(), spent[0]))

    trainer.add_callback(Clock())
    trainer.train()
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    return {"step_s": statistics.mean(s for s, _ in steps), "teacher_s": statistics.mean(t for _, t in steps)}
