"""What a collaborator of the trainer receives instead of the trainer: the run's arguments and their plan, its
accelerator and device, the student (as trained, and as its engine), the collator and the input preparation, the
tokenizer and the shared vocabulary, the logit paths, the optimizer step, whether the student trains, and a logger.
Calls go down: a collaborator reads the run through this and never calls back into the trainer, nor changes it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunContext:
    """The run as a collaborator sees it. What the Trainer replaces as it runs (its state as training starts, the
    student's engine once prepared, the composed collator) is read when asked, through the callables."""

    args: Any
    """The run's `DistillationConfig`."""
    accelerator: Any
    """The trainer's `accelerate.Accelerator` (the student's, with the teachers' DeepSpeed plugins beside it)."""
    state_of: Callable[[], Any]
    """The Trainer's `TrainerState` (made anew as training starts): its ``global_step``, ``logging_steps``."""
    model_of: Callable[[], Any]
    """The student as the Trainer trains it (a `PeftModel` for LoRA): ``Trainer.model``."""
    wrapped_of: Callable[[], Any] | None = None
    """The student's engine once prepared (``Trainer.model_wrapped``); the model itself before."""
    collate: Callable[[list[dict]], dict] | None = None
    """The run's collator, composed (the teacher kind's and sequence parallelism's around SFT's)."""
    prepare_inputs: Callable[[dict], dict] | None = None
    """A collated batch moved to the device as the training step moves it."""
    processing_class_of: Callable[[], Any] | None = None
    """The student's tokenizer or processor (``Trainer.processing_class``)."""
    vocab_size: int = 0
    """The vocabulary the loss compares (the student's and the teacher's shared ids)."""
    logit_paths: Any = None
    """Each model's logit path, settled once on the first batch (`model.logit_check.LogitPaths`)."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("trl_distill"))
    layouts: Any = None
    """The step's loss-token layouts, measured as its batches are fetched (`data.loss_layout.LayoutMemo`)."""
    deferred: Any = None
    """What the step found not finite, read once before its last backward (`runtime.guards.StepFlags`)."""
    plan: Any = None
    """The run's `run_plan.RunPlan`: its arguments' typed parts, as resolved once."""

    @property
    def state(self):
        return self.state_of()

    @property
    def step(self) -> int:
        """The optimizer steps done so far."""
        return self.state_of().global_step

    @property
    def training(self) -> bool:
        """Whether the student is in training mode (False in evaluate())."""
        return self.model_of().training

    @property
    def device(self):
        return self.args.device

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def processing_class(self):
        return None if self.processing_class_of is None else self.processing_class_of()

    @property
    def tokenizer(self):
        """The student's tokenizer (a processor's)."""
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    @property
    def model(self):
        return self.model_of()

    @property
    def student(self):
        """The student model itself (the base model of a PEFT student)."""
        model = self.model_of()
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    @property
    def wrapped(self):
        """What the student's forward runs through: its engine once prepared, the model before."""
        return self.model_of() if self.wrapped_of is None else self.wrapped_of()

    @property
    def deepspeed_plugin(self):
        """The student's DeepSpeed plugin (the selected one), None without DeepSpeed."""
        return getattr(self.accelerator.state, "deepspeed_plugin", None)
