"""The teacher side of the fused loss, declared once: what `loss.fused.fused_loss` asks of any teacher signal.

The fused loss walks the selected loss rows a chunk at a time. For each chunk it asks the signal for `chunk(rows,
compute)` (whatever the signal needs to compare with that chunk: full log-probs, top-k buckets, per-group logits),
computes the student's log-probs, and asks `per_token(student_logp, chunk, settings)` for the divergence of each
row. A signal whose chunk is the teacher's full log-probabilities sets `closed_form`, so the forward KL's gradient
is taken in closed form. The signals: `loss.fused.DenseTeacherSignal` (a live teacher's hidden states and lm_head),
`loss.sparse.SparseSignalChunks` (a cache's or a server's top-k), `teacher.cross_tokenizer.CrossTokenizerSignal`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    import torch

    from .diagnostics import LossDiagnostics
    from .fused import LossSettings


@runtime_checkable
class TeacherSignal(Protocol):
    """The teacher over the loss rows of one micro-batch, in the order the loss selects them (row-major)."""

    closed_form: bool
    """True when `chunk` returns the teacher's full log-probabilities ``[c, V]`` (forward KL in closed form)."""

    def chunk(self, rows: slice, compute: torch.dtype) -> Any:
        """What `per_token` compares for the loss rows `rows`, in the `compute` dtype (>= fp32)."""

    def per_token(self, student_logp: Tensor, chunk: Any, settings: LossSettings) -> Tensor:
        """The divergence per row ``[c]`` between this chunk and the student's log-probs ``[c, V]``."""

    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, chunk: Any, labels: Tensor | None,
                settings: LossSettings) -> None:
        """Add this chunk's metrics (`loss.diagnostics`) to `into`, from the student's logits ``[c, V_s]`` at T = 1,
        before `per_token` (which may overwrite the chunk). A signal may also have ``observe_batch(into)``, called
        once per batch after the chunks."""
