"""What a teacher hands the fused loss for one micro-batch (a `base.TeacherBatch`): a live model's states, or a
top-k signal that came with the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loss.dense import DenseTeacherSignal
from ..loss.settings import LossSettings
from ..loss.sparse import SparseSignalChunks, SparseTeacherSignal
from ..model.fused_forward import LMHead
from .base import TeacherBatch


@dataclass
class DenseRows(TeacherBatch):
    """A teacher model's last hidden states and lm_head (or, with ``head`` None, its own logits).

    ``states`` ``[B, K, F]`` at the kept positions, or, when ``selected``, ``[n, F]`` at the loss rows already (row,
    position order: computed ahead by the once-per-step pass)."""

    states: torch.Tensor
    head: LMHead | None
    selected: bool = False

    def signal(self, rows: torch.Tensor | None, n: int, settings: LossSettings,
               picks: torch.Tensor | None = None) -> DenseTeacherSignal:
        """Over the `n` loss rows (`rows`: their indices into the kept positions), or, with `picks`, over those of
        them only (indices into the `n`: a routed teacher's rows)."""
        states = self.states
        if not self.selected:
            states = states.reshape(-1, states.shape[-1])
            states = states if rows is None else states.index_select(0, rows)
        if states.shape[0] != n:
            raise RuntimeError(f"The teacher has {states.shape[0]} loss rows, the student {n}.")
        if picks is not None:
            states = states.index_select(0, picks)
        return DenseTeacherSignal(states.detach(), self.head, settings.vocab_size, settings.temperature)


@dataclass
class SparseRows(TeacherBatch):
    """The teacher's top-k and tail per loss token, read from a cache or fetched from a server."""

    sparse: SparseTeacherSignal
    head: LMHead | None = None

    def signal(self, rows: torch.Tensor | None, n: int, settings: LossSettings,
               picks: torch.Tensor | None = None) -> SparseSignalChunks:
        chunks = SparseSignalChunks(self.sparse, n, settings.vocab_size)  # checked against all n rows
        if picks is not None:
            chunks.signal = SparseTeacherSignal(*(t.index_select(0, picks.to(t.device)) for t in self.sparse))
        return chunks
