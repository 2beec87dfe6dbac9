"""Distillation from a sparse teacher signal: the teacher's top-k log-probabilities plus the log of its tail mass.

A cached teacher gives, per loss token, k token ids ``S`` with ``log p_i`` and ``log r``, the log of the mass it
puts outside them, ``r = 1 − Σ_S p_i``, all at the training temperature. The student's full distribution ``q``
(at the same temperature) is coarse-grained onto the same k + 1 buckets, ``q_i`` for ``i ∈ S`` and
``q_tail = Σ_{j ∉ S} q_j``, and the divergence is taken between the two (k+1)-bucket distributions:

    KL(p ‖ q) ≈ Σ_{i ∈ S} p_i · log(p_i / q_i) + r · log(r / q_tail)      (and alike for every divergence)

Exactness. With k = V the tail is empty and every divergence equals the dense one. With k < V every divergence
here (forward and reverse KL, JSD, both skew KLs, TVD) is an f-divergence, so the bucketed value is a lower bound
on the full one (data processing inequality), equal when ``p_j / q_j`` is constant over the tail. The forward KL's
gradient on the top-k logits is exact (``q_i − p_i``); on a tail logit it is ``q_j − r · q_j / q_tail``: the
teacher's tail mass spread like the student's own tail. The temperature adds no approximation: the cache is
computed at the training temperature (the trainer refuses another one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .diagnostics import LossDiagnostics, observe_buckets
from .divergences import at_temperature
from .settings import LossSettings
from .signal import TeacherSignal

__all__ = ["SparseSignalChunks", "SparseTeacherSignal", "top_k_teacher_signal"]

# An empty bucket's log-probability (k = V leaves no tail): finite, so neither values nor gradients become NaN,
# and exp() of it is exactly 0 in fp32, so it adds nothing to any divergence.
_EMPTY_LOG_PROB = -1.0e4


class SparseTeacherSignal(NamedTuple):
    """Per selected token: ``ids`` ``[n, k]`` (int), ``log_probs`` ``[n, k]`` and ``tail_log_prob`` ``[n]``."""

    ids: Tensor
    log_probs: Tensor
    tail_log_prob: Tensor


@torch.no_grad()
def top_k_teacher_signal(logits: Tensor, k: int, temperature: float = 1.0) -> SparseTeacherSignal:
    """The sparse signal of teacher logits ``[n, V]``: the k most likely ids (most likely first), their fp32
    log-probabilities at ``temperature`` and the log of the remaining mass (``-inf`` when k = V)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, vocabulary size {logits.shape[-1]}], got {k}.")
    log_probs = F.log_softmax(at_temperature(logits.float(), temperature), dim=-1)
    top, ids = log_probs.topk(k, dim=-1)
    tail = log_probs.scatter(1, ids, float("-inf")).logsumexp(-1)
    return SparseTeacherSignal(ids, top, tail)


def bucketed(student_log_probs: Tensor, ids: Tensor) -> Tensor:
    """The student's log-probs ``[c, V]`` coarse-grained onto ``ids``' k buckets plus the tail: ``[c, k + 1]``."""
    top = student_log_probs.gather(1, ids)
    tail = student_log_probs.scatter(1, ids, _EMPTY_LOG_PROB).logsumexp(-1, keepdim=True)
    return torch.cat([top, tail.clamp_min(_EMPTY_LOG_PROB)], dim=1)


class SparseSignalChunks(TeacherSignal):
    """The teacher side of the chunked loss (see `losses.fused_loss`) from a cached sparse signal over ``n`` selected
    tokens, checked against the batch (row count, ids below ``vocab``)."""

    closed_form = False

    def __init__(self, signal: SparseTeacherSignal, n: int, vocab: int):
        k = signal.ids.shape[-1] if signal.ids.dim() == 2 else 0
        if signal.ids.shape != (n, k) or signal.log_probs.shape != (n, k) or signal.tail_log_prob.shape != (n,):
            raise ValueError(
                f"The sparse teacher signal has {signal.ids.shape[0]} rows (ids {tuple(signal.ids.shape)}, log-probs "
                f"{tuple(signal.log_probs.shape)}, tail {tuple(signal.tail_log_prob.shape)}) but the batch has {n} "
                "loss tokens: the cache was written for other data."
            )
        if n and k and int(signal.ids.max()) >= vocab:
            raise ValueError(f"The sparse teacher signal holds token id {int(signal.ids.max())} >= vocab_size "
                             f"{vocab}.")
        self.signal = signal

    def chunk(self, rows: slice, compute: torch.dtype) -> tuple[Tensor, Tensor]:
        ids = self.signal.ids[rows].long()
        tail = self.signal.tail_log_prob[rows].to(compute).clamp_min(_EMPTY_LOG_PROB).unsqueeze(1)
        return ids, torch.cat([self.signal.log_probs[rows].to(compute).clamp_min(_EMPTY_LOG_PROB), tail], dim=1)

    @staticmethod
    def per_token(student_logp: Tensor, chunk: tuple[Tensor, Tensor], settings: LossSettings) -> Tensor:
        ids, teacher_buckets = chunk
        return settings.per_token(bucketed(student_logp, ids), teacher_buckets.to(student_logp.dtype))

    @staticmethod
    def token_log_probs(chunk: tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
        """The log-prob of each row's token, which must be among its ids (a served teacher under the sampled-token
        objective is asked for exactly the sampled tokens)."""
        ids, teacher_buckets = chunk
        match = ids == labels[:, None].to(ids.device)
        if not bool(match.any(1).all()):
            raise ValueError("The teacher's sparse signal lacks the log-prob of a sampled token (it holds a top-k "
                             "that does not contain it): the sampled-token objective needs a live teacher or a "
                             "served one, which is asked for the sampled tokens themselves.")
        return teacher_buckets.gather(1, match.int().argmax(1, keepdim=True)).squeeze(1)

    @staticmethod
    def observe(into: LossDiagnostics, rows: slice, logits: Tensor, chunk: tuple[Tensor, Tensor],
                labels: Tensor | None, settings: LossSettings) -> None:
        ids, teacher_buckets = chunk
        observe_buckets(into, logits, ids, teacher_buckets, labels, settings.temperature, _EMPTY_LOG_PROB,
                        bucketed)
