"""A live teacher's signal for the fused loss: its hidden states at the loss rows and its lm_head, projected one
chunk at a time into full log-probabilities."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..model.fused_forward import LMHead, finalise_logits
from .diagnostics import LossDiagnostics, observe_dense
from .divergences import at_temperature
from .signal import TeacherSignal
from .workspace import Workspace

if TYPE_CHECKING:
    from .settings import LossSettings


class DenseTeacherSignal(TeacherSignal):
    """The teacher side of the chunked loss from its hidden states: log-probs ``[c, vocab]`` one chunk at a time.

    ``states`` ``[n, H_t]`` hold the selected rows only, projected through ``head`` (its first ``vocab`` rows); with no
    head, ``states`` ``[n, V_t]`` are the teacher's own logits."""

    closed_form = True  # the chunk is full log-probs: the forward KL gradient has a closed form

    def __init__(self, states: Tensor, head: LMHead | None, vocab: int, temperature: float):
        self.states, self.head, self.vocab, self.temperature = states, head, vocab, temperature
        self.work = Workspace()  # this signal's chunk buffers, reused chunk after chunk
        if head is not None:
            self.weight = head.weight.detach()[:vocab]
            self.bias = None if head.bias is None else head.bias.detach()[:vocab]

    def chunk(self, rows: slice, compute: torch.dtype) -> Tensor:
        if self.head is None:
            logits = self.states[rows, : self.vocab].to(compute)
        else:
            logits = self.work.linear("teacher", self.states[rows], self.weight, self.bias, compute)
            logits = finalise_logits(logits, self.head.logit_scale, self.head.softcap)
        return self.work.log_softmax("teacher", at_temperature(logits, self.temperature))

    @staticmethod
    def per_token(student_logp: Tensor, teacher_logp: Tensor, settings: LossSettings) -> Tensor:
        return settings.per_token(student_logp, teacher_logp)

    @staticmethod
    def token_log_probs(teacher_logp: Tensor, labels: Tensor) -> Tensor:
        return teacher_logp.gather(1, labels[:, None]).squeeze(1)

    @staticmethod
    def observe(into: LossDiagnostics, rows: slice, logits: Tensor, teacher_logp: Tensor, labels: Tensor | None,
                settings: LossSettings) -> None:
        observe_dense(into, logits, teacher_logp, labels, settings.temperature)
