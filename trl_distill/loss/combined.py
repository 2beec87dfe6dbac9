"""The teacher side of the fused loss when several teachers teach one student (`teacher.panel`): three ways to
combine their signals, each itself a `loss.signal.TeacherSignal`, so the chunked pass is the same one.

- `RoutedSignal` (``teacher_combine="route"``): each loss row has one teacher. The loss rows are ordered teacher by
  teacher (`order`), and the fused loss cuts its chunks at the teachers' edges (`bounds`), so every chunk is one
  teacher's: the loss is exactly the sum of each teacher's loss on its own rows.
- `MixtureSignal` (``"mixture"``): the divergence against the one distribution ``p = Σ w_i p_i``, its log taken
  chunk by chunk from each teacher's full log-probs (``log Σ exp(log w_i + log p_i)``); the forward KL keeps its
  closed-form gradient. Needs each teacher's whole distribution: live teachers only.
- `SumSignal` (``"sum"``): the weighted sum of divergences ``Σ w_i D(p_i ‖ q)``, each term as that teacher's signal
  computes it (dense, or a cache's or a server's top-k).

Routed and summed signals count each teacher's part of the KD sum (`parts`) and take each teacher's metrics apart
(`own`, `loss.diagnostics`), which the trainer logs per teacher. The metrics of a mixture (`mixture`, and `sum` of
live teachers), at temperature 1 like every metric, are against the mixture of the teachers' distributions at 1
(`mixture_at_one`): at a training temperature T != 1 the mixture at T, brought back to 1 as one teacher, is another
distribution (a power of a sum is not the sum of the powers).
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import torch

from .dense import DenseTeacherSignal
from .diagnostics import LossDiagnostics, observe_dense
from .signal import TeacherSignal

if TYPE_CHECKING:
    from torch import Tensor

    from .settings import LossSettings

__all__ = ["MixtureSignal", "RoutedSignal", "SumSignal", "mixture_at_one", "routed_order"]


def routed_order(route: Tensor, count: int) -> tuple[Tensor, list[int]]:
    """``(order, bounds)`` for the loss rows' teacher indices `route` ``[n]`` in ``[0, count)``: the row order that
    groups them teacher by teacher (stable: the loss's own order within a teacher), and where each teacher's rows
    start (plus the end)."""
    order = torch.sort(route, stable=True).indices
    sizes = torch.bincount(route, minlength=count).tolist()
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return order, bounds


def mixture_at_one(parts: list[tuple[Tensor, float]], temperature: float, overwrite: bool) -> Tensor:
    """``log Σ w_i p_i`` of the teachers' distributions at T = 1 ``[c, V]``, from each teacher's chunk of log-probs at
    `temperature` (a row may be shifted by a constant) and its ``log w_i`` (`parts`): each teacher brought back to
    1 alone (``log_softmax(T · log p_T)``, exact), then mixed. `overwrite`: the parts' tensors may be written (the
    result is then the first's: no new ``[c, V]`` tensor); else one new tensor per teacher, the first kept."""
    mixed = None
    for part, log_w in parts:
        if temperature == 1.0:
            part = part.add_(log_w) if overwrite else part + log_w
        else:
            part = part.mul_(temperature) if overwrite else part * temperature
            part = torch.log_softmax(part, -1, out=part).add_(log_w)
        mixed = part if mixed is None else torch.logaddexp(mixed, part, out=mixed)
    return mixed


def own_metrics(signal: RoutedSignal | SumSignal, like: LossDiagnostics) -> list[LossDiagnostics]:
    """The per-teacher metrics of a signal of several teachers (made on `like`'s device at its first chunk)."""
    if signal.own is None:
        signal.own = [LossDiagnostics(like.sums.device) for _ in signal.signals]
    return signal.own


class RoutedSignal(TeacherSignal):
    """One teacher per loss row: `signals[i]` covers teacher i's rows, which are rows ``bounds[i]:bounds[i+1]`` of the
    loss once it has taken its rows in `order` (`routed_order`)."""

    def __init__(self, signals: list[TeacherSignal], order: Tensor, bounds: list[int]):
        self.signals, self.order, self.bounds = signals, order, bounds
        present = [s for i, s in enumerate(signals) if bounds[i + 1] > bounds[i]]
        self.closed_form = bool(present) and all(s.closed_form for s in present)
        self.parts = [0.0] * len(signals)  # each teacher's KD sum (tensors once counted)
        self.own: list[LossDiagnostics] | None = None  # each teacher's metrics, when measured
        self._owner = 0

    def _local(self, rows: slice) -> tuple[int, slice]:
        i = bisect.bisect_right(self.bounds, rows.start) - 1
        while self.bounds[i + 1] <= rows.start:  # skip teachers with no rows
            i += 1
        start = self.bounds[i]
        if rows.stop > self.bounds[i + 1]:
            raise RuntimeError(f"Loss rows {rows.start}:{rows.stop} straddle two teachers' rows (edges {self.bounds}).")
        return i, slice(rows.start - start, rows.stop - start)

    def chunk(self, rows: slice, compute: torch.dtype):
        # The fused loss asks for a chunk, then (maybe) observes it, then takes its per-token divergence: the owner
        # of the chunk asked for last is the one `per_token` asks.
        self._owner, local = self._local(rows)
        return self.signals[self._owner].chunk(local, compute)

    def per_token(self, student_logp: Tensor, chunk, settings: LossSettings) -> Tensor:
        return self.signals[self._owner].per_token(student_logp, chunk, settings)

    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, chunk, labels: Tensor | None,
                settings: LossSettings) -> None:
        """Each chunk against its own teacher, into that teacher's metrics (`own`), all of them added to `into` once
        the batch is done (`observe_batch`)."""
        i, local = self._local(rows)
        self.signals[i].observe(own_metrics(self, into)[i], local, logits, chunk, labels, settings)

    def observe_batch(self, into: LossDiagnostics) -> None:
        for signal, own in zip(self.signals, own_metrics(self, into), strict=True):
            signal.observe_batch(own)
            into.merge(own)

    def tally(self, rows: slice, kd: Tensor) -> None:
        i, _ = self._local(rows)
        self.parts[i] = self.parts[i] + kd

    def token_log_probs(self, chunk, labels: Tensor) -> Tensor:
        return self.signals[self._owner].token_log_probs(chunk, labels)  # the teacher of the chunk asked for last

    def token_coverage(self, chunk) -> Tensor | None:
        return self.signals[self._owner].token_coverage(chunk)


class MixtureSignal(TeacherSignal):
    """The mixture ``Σ w_i p_i`` of dense teachers' distributions (weights summing to 1) as one teacher."""

    closed_form = True

    def __init__(self, signals: list[TeacherSignal], weights: list[float]):
        if not all(s.closed_form for s in signals):
            raise ValueError("teacher_combine='mixture' needs each teacher's whole distribution; a teacher cache or "
                             "a served teacher gives its top-k only: use teacher_combine='sum'.")
        self.signals = signals
        self.log_weights = [math.log(w) if w > 0 else -math.inf for w in weights]
        self._parts: list[tuple[Tensor, float]] = []  # the last chunk's teachers' log-probs at T (for `observe`)

    def chunk(self, rows: slice, compute: torch.dtype) -> Tensor:
        mixed, self._parts = None, []
        for signal, log_w in zip(self.signals, self.log_weights, strict=True):
            if log_w == -math.inf:
                continue
            part = signal.chunk(rows, compute)  # that teacher's buffer, reused at its next chunk: add it now
            self._parts.append((part, log_w))  # (the later ones shifted by log_w: the same distribution)
            mixed = part + log_w if mixed is None else torch.logaddexp(mixed, part.add_(log_w))
        return mixed

    # Its chunk is full log-probs, like a dense teacher's: the same per-token divergence
    per_token = staticmethod(DenseTeacherSignal.per_token)

    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, mixed: Tensor, labels: Tensor | None,
                settings: LossSettings) -> None:
        """The metrics against the mixture of the teachers at T = 1: at another temperature, from the teachers' own
        log-probs at T, which the chunk's mixture no longer needs (overwritten in their buffers: no extra copy)."""
        parts, self._parts = self._parts, []
        if settings.temperature != 1.0:
            mixed = mixture_at_one(parts, settings.temperature, overwrite=True)
        observe_dense(into, logits, mixed, labels, 1.0)


class SumSignal(TeacherSignal):
    """``Σ w_i D(p_i ‖ q)``: each teacher's divergence from its own signal (any kind), weighted."""

    closed_form = False

    def __init__(self, signals: list[TeacherSignal], weights: list[float]):
        self.signals, self.weights = signals, weights
        self.parts = [0.0] * len(signals)
        self.own: list[LossDiagnostics] | None = None

    def chunk(self, rows: slice, compute: torch.dtype) -> list:
        return [signal.chunk(rows, compute) if w else None for signal, w in zip(self.signals, self.weights,
                                                                              strict=True)]

    def per_token(self, student_logp: Tensor, chunks: list, settings: LossSettings) -> Tensor:
        total = None
        for i, (signal, w, chunk) in enumerate(zip(self.signals, self.weights, chunks, strict=True)):
            if not w:
                continue
            term = w * signal.per_token(student_logp, chunk, settings)
            self.parts[i] = self.parts[i] + term.detach().sum()
            total = term if total is None else total + term
        return total

    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, chunks: list, labels: Tensor | None,
                settings: LossSettings) -> None:
        """Each teacher's metrics against its own signal (`own`), and into `into` the metrics against the teachers'
        mixture when every teacher gives its whole distribution (else none: top-k signals share no support)."""
        for signal, own, chunk, w in zip(self.signals, own_metrics(self, into), chunks, self.weights, strict=True):
            if w:
                signal.observe(own, rows, logits, chunk, labels, settings)
        if not all(s.closed_form for s in self.signals):
            return
        total = sum(self.weights)
        parts = [(chunk, math.log(w / total)) for w, chunk in zip(self.weights, chunks, strict=True) if w]
        # not overwritten: `per_token` reads the chunks next
        observe_dense(into, logits, mixture_at_one(parts, settings.temperature, overwrite=False), labels, 1.0)
