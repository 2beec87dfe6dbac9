"""What a collaborator of the trainer receives instead of the trainer: the run's arguments, its accelerator and
device, the optimizer step, whether the student trains, and a logger. Calls go down: a collaborator reads the run
through this and never calls back into the trainer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunContext:
    """The run as a collaborator sees it. `state`, `step` and `training` are read when asked (the Trainer makes a new
    state when training starts, and switches the student between train and eval)."""

    args: Any
    """The run's `DistillationConfig`."""
    accelerator: Any
    """The trainer's `accelerate.Accelerator` (the student's, with the teachers' DeepSpeed plugins beside it)."""
    state_of: Callable[[], Any]
    """The Trainer's `TrainerState` (made anew as training starts): its ``global_step``, ``logging_steps``."""
    training_of: Callable[[], bool]
    """Whether the student is in training mode (False in evaluate())."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("trl_distill"))

    @property
    def state(self):
        return self.state_of()

    @property
    def step(self) -> int:
        """The optimizer steps done so far."""
        return self.state_of().global_step

    @property
    def training(self) -> bool:
        return self.training_of()

    @property
    def device(self):
        return self.args.device

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes
