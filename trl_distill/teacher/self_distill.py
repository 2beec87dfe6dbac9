"""Self-distillation of a LoRA student: the teacher is the student's own frozen base model with its adapters
disabled, so no second copy of the base weights exists."""

from __future__ import annotations

import torch
from torch import nn

from ..model.fused_forward import LossFeatures, features_only
from ..runtime.fsdp2 import is_fsdp2
from ..runtime.guards import check_teacher_finite
from .base import TeacherSource
from .capabilities import OwnRows, Samples, ScoresSamples
from .rows import DenseRows
from .support import TEACHER_PROMPT_REFUSAL

SELF = "self"


class SelfTeacher(TeacherSource, ScoresSamples, Samples, OwnRows):
    """The student's base with its adapters off (``teacher_model="self"``); bound to the PEFT student as it
    attaches. Runs once per micro-batch: its forward is the student's own engine."""

    name = SELF
    routes_own_rows = True  # routed among several: the base runs on its own rows only
    refused = {
        "teacher-prompt": TEACHER_PROMPT_REFUSAL,
        "cross-tokenizer": "teacher 'self' is the student's own base model and shares its tokenizer: cross-tokenizer "
        "distillation does not apply. Drop teacher_tokenizer_name_or_path and cross_tokenizer.",
    }

    @classmethod
    def refuse(cls, settings, *, eval_dataset=None, peft: bool = False) -> None:
        if not peft:
            raise ValueError("teacher 'self' (self-distillation) uses the student's base model with its LoRA adapters "
                             "disabled, so it needs a PEFT student: pass `peft_config=` (CLI: --use_peft).")
        super().refuse(settings, eval_dataset=eval_dataset, peft=peft)

    def __init__(self):
        self.peft_model: nn.Module | None = None
        self.module: nn.Module | None = None
        self.runner: nn.Module | None = None  # what runs its forward: the base, or the FSDP2 student's root

    def describe(self) -> str:
        return "'self' (the student's base)"

    def attach(self, context) -> None:
        super().attach(context)
        if not hasattr(context.model, "disable_adapter"):
            raise ValueError("teacher 'self' needs a PEFT student; the student is not a PeftModel.")
        self.peft_model, self.module = context.model, context.model.get_base_model()
        # An FSDP2 student's root group (embeddings, final norm) is gathered by the root's own forward: run that
        self.runner = self.peft_model if is_fsdp2(context.accelerator) else self.module

    def generation(self, num_processes: int) -> tuple[nn.Module, object, bool]:
        """Sampling from the base: the PEFT model with its adapters disabled."""
        return self.peft_model, self.peft_model.disable_adapter, False

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """Nothing to add: the base runs on the sampled batch itself."""

    @torch.no_grad()
    def features(self, model_inputs: dict, positions: torch.Tensor | None = None) -> LossFeatures:
        was_training = self.module.training
        self.module.eval()  # the frozen base, without dropout
        try:
            # adapters off: a trained `modules_to_save` lm_head falls back to the original too
            with self.peft_model.disable_adapter():
                return self.runner(**model_inputs, fused_distillation=features_only, loss_positions=positions)
        finally:
            self.module.train(was_training)

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> DenseRows:
        features = self.features(model_inputs, keep)
        run = self.context
        check_teacher_finite(features.states, run.accelerator, f"step {run.step + 1}",
                             run.deferred if run.training else None)  # in training: read with the step's guards
        return DenseRows(features.states, features.head)
