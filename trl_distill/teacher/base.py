"""The one teacher interface: the core that `DistillationTrainer` and `trl-distill cache-teacher` ask of any kind of
teacher, and `TeacherBatch`, what a kind hands the fused loss for one micro-batch.

The core (`TeacherSource`): the run settings a kind refuses (`refused`, checked by `refuse`), its name, how it
attaches to the run, its preparation (a collective load, or nothing), the signal it hands the fused loss
(`for_batch`) and its release. Everything else a kind may do (its own collator and dataset columns, its own DeepSpeed
engine, a once-per-step pass, scoring sampled rows, writing a cache...) is a capability it declares
(`capabilities`), which callers ask for by `capability`. The trainer holds one `TeacherSource` and asks it; it never
branches on the kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, TypeVar

import torch

from .support import run_modes

if TYPE_CHECKING:
    from ..loss.settings import LossSettings
    from ..loss.signal import TeacherSignal
    from ..model.fused_forward import LMHead
    from ..runtime.context import RunContext
    from .settings import TeacherSettings

C = TypeVar("C")


class TeacherBatch(ABC):
    """A kind's teacher over one micro-batch's loss rows, made before the student's forward (`for_batch`)."""

    head: LMHead | None = None
    """The teacher's lm_head to gather around the loss (None: nothing to gather)."""

    @property
    def heads(self) -> tuple[LMHead | None, ...]:
        """Every lm_head to gather around the loss (several teachers: each one's)."""
        return (self.head,)

    @abstractmethod
    def signal(self, rows: torch.Tensor | None, n: int, settings: LossSettings) -> TeacherSignal:
        """The `loss.signal.TeacherSignal` over the `n` loss rows the student selected (`rows`: their row-major
        indices into the ``[B·K]`` kept positions)."""


class TeacherSource(ABC):
    """One kind of teacher: the core every kind implements. What only some kinds do (their own collator, dataset
    columns, engine, step pass, cache writing, sampling...) each declares as a capability (`capabilities`), which
    callers ask for with `capability` instead of calling a default that does nothing."""

    refused: dict = {}
    """Run settings this kind cannot serve (`support.Mode`), each with the one-line message that names the fix; a
    capability it lacks (`capabilities.WritesCache`) may name its own line too."""
    name: str = ""
    """What a checkpoint's run record and a cache's manifest record as the teacher."""
    context: RunContext | None = None
    """The run it is attached to (`attach`); None before, and for a teacher prepared on its own."""

    @classmethod
    def refuse(cls, settings: TeacherSettings, *, eval_dataset=None, peft: bool = False) -> None:
        """One `ValueError` naming the fix when the run (its teacher `settings`, eval split and student) uses a
        setting this kind refuses (see `support`); asked before the kind is built, so nothing is loaded first."""
        for mode in run_modes(settings.modes, eval_dataset=eval_dataset, peft=peft):
            if mode in cls.refused:
                raise ValueError(cls.refused[mode])

    def describe(self) -> str:
        return type(self).__name__

    def capability(self, capability: type[C]) -> C | None:
        """This teacher as `capability` (a protocol of `capabilities`) when its kind declares it, else None. A
        wrapper answers for what it wraps."""
        return self if capability in type(self).__mro__ else None

    def attach(self, context: RunContext) -> None:
        """Bind to the run (`runtime.context.RunContext`: its arguments, student, tokenizer, vocabulary, collator):
        check it fits this teacher. Called once, at the end of the trainer's set-up."""
        self.context = context

    def prepare(self, accelerator, device: torch.device) -> None:
        """Load and prepare the teacher (collective under DeepSpeed: every rank, once). Nothing for most kinds."""
        return None

    @abstractmethod
    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> TeacherBatch:
        """The teacher over this micro-batch's loss tokens: `mask` ``[B, K]`` over the kept positions `keep`
        ``[K]``; `extras`: what its collator added (`capabilities.OwnBatch.pop_batch`), else None. Every rank calls it
        for every micro-batch (a partitioned teacher's gathers are collective)."""

    def release(self) -> None:
        """Drop anything held for training (at train end)."""
        return None
