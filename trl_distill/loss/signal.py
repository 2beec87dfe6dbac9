"""The teacher side of the fused loss, declared once: what `loss.fused.fused_loss` asks of any teacher signal.

The fused loss walks the selected loss rows a chunk at a time. For each chunk it asks the signal for `chunk(rows,
compute)` (whatever the signal needs to compare with that chunk: full log-probs, top-k buckets, per-group logits),
computes the student's log-probs, and asks `per_token(student_logp, chunk, settings)` for the divergence of each
row. A signal whose chunk is the teacher's full log-probabilities sets `closed_form`, so the forward KL's gradient
is taken in closed form. Every member the loss reads is declared here, with a default where a kind needs none (as
Liger's `LigerFusedLinearDistillationBase` declares its pluggable part). The signals: `loss.dense.DenseTeacherSignal`
(a live teacher's hidden states and lm_head), `loss.sparse.SparseSignalChunks` (a cache's or a server's top-k),
`teacher.cross_tokenizer.CrossTokenizerSignal`, `teacher.no_teacher.NoSignal`, and several teachers' as one
(`loss.combined`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    import torch

    from .diagnostics import LossDiagnostics
    from .settings import LossSettings
    from .workspace import Workspace


class TeacherSignal(ABC):
    """The teacher over the loss rows of one micro-batch, in the order the loss selects them (row-major)."""

    closed_form: bool = False
    """True when `chunk` returns the teacher's full log-probabilities ``[c, V]`` (forward KL in closed form)."""
    work: Workspace | None = None
    """Chunk buffers the loss may share with this signal (a dense teacher's); None: the loss makes its own."""
    bounds: list[int] | None = None
    """Row indices the loss's chunks must be cut at (several teachers routed: each one's rows); None: anywhere."""
    order: Tensor | None = None
    """The order the loss must take its rows in (routed: teacher by teacher); None: as selected."""

    @abstractmethod
    def chunk(self, rows: slice, compute: torch.dtype) -> Any:
        """What `per_token` compares for the loss rows `rows`, in the `compute` dtype (>= fp32)."""

    @abstractmethod
    def per_token(self, student_logp: Tensor, chunk: Any, settings: LossSettings) -> Tensor:
        """The divergence per row ``[c]`` between this chunk and the student's log-probs ``[c, V]``."""

    @abstractmethod
    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, chunk: Any, labels: Tensor | None,
                settings: LossSettings) -> None:
        """Add this chunk's metrics (`loss.diagnostics`) to `into`, from the student's logits ``[c, V_s]`` at T = 1,
        before `per_token` (which may overwrite the chunk)."""

    def observe_batch(self, into: LossDiagnostics) -> None:
        """Add what is measured once per batch, after the chunks (an aligned share across tokenizers); none here."""
        return None

    def tally(self, rows: slice, kd: Tensor) -> None:
        """Count a chunk's KD sum (several teachers: each one's part, logged per teacher); nothing here."""
        return None

    def token_log_probs(self, chunk: Any, labels: Tensor) -> Tensor:
        """The teacher's log-prob of each row's token `labels` ``[c]`` from this chunk (the sampled-token objective,
        `loss.sampled_token`); a signal that does not hold it refuses."""
        raise ValueError(f"on_policy_objective='sampled_token' reads the teacher's log-prob of each sampled token, "
                         f"which {type(self).__name__} does not give: use one teacher (or several routed), or "
                         "on_policy_objective='divergence'.")

    def token_coverage(self, chunk: Any) -> Tensor | None:
        """Which rows of this chunk `token_log_probs` has a log-prob for (``[c]`` bool); None: every row. Only a
        teacher of another tokenizer lacks some (a sampled token no aligned group covers)."""
        return None
