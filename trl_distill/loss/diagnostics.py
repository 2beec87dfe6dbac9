"""What the fused loss measures beside itself: how close the student is to the teacher, and how good the teacher is,
from the rows it already projects (no extra logits, no extra teacher pass).

Every metric is a mean over loss tokens (the completion tokens) of a per-token value, at temperature 1 whatever the
training temperature, so runs with different divergences and temperatures compare:

- ``top1_agreement``: the student's most likely token is the teacher's;
- ``kl_teacher_student``: KL(p ‖ q), the forward KL of the teacher's distribution to the student's;
- ``teacher_ce`` / ``student_ce``: each model's cross-entropy on the labels (is the teacher any good on this data?);
- ``teacher_entropy`` / ``student_entropy``.

A sparse teacher (a cache's or a server's top-k) is compared on its k + 1 buckets (`loss.sparse`): its KL, CE and
entropy are those of the bucketed distributions, lower bounds of the full ones, equal when k = V; with a training
temperature other than 1 they are left out (the top-k at T do not give the distribution at 1). It adds
``teacher_tail_mass`` (its mass outside the top-k) and ``student_tail_clamped`` (share of tokens whose student tail
bucket sat at the loss's floor). Across tokenizers the metrics are taken on the aligned groups, the KL on the
shared vocabulary (the loss's matched part), agreement through the shared-token pairs, plus the aligned shares of
loss tokens and of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .divergences import at_temperature

# Every name a run can log, in one fixed order: every rank reduces the same vector (zero counts are not logged).
METRICS = ("top1_agreement", "kl_teacher_student", "teacher_ce", "student_ce", "student_entropy", "teacher_entropy",
           "teacher_tail_mass", "student_tail_clamped", "aligned_token_share", "aligned_row_share",
           "on_policy_teacher_logprob", "on_policy_student_entropy")
INTERNAL = ("student_ce",)  # measured for the first-step teacher check; `ce_loss` is what the run logs


class LossDiagnostics:
    """Per-metric sum and count, filled chunk by chunk by the teacher signals' `observe` (tensors: no host sync)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        self.counts = torch.zeros(len(METRICS), dtype=torch.float64, device=device)

    def add(self, name: str, values: Tensor, count: Tensor | int | None = None) -> None:
        """Add per-token ``values`` (their sum, over ``count`` tokens: default their number)."""
        i = METRICS.index(name)
        self.sums[i] += values.detach().sum().to(self.sums.dtype)
        self.counts[i] += values.numel() if count is None else count

    def merge(self, other: LossDiagnostics) -> None:
        self.sums += other.sums.to(self.sums.device)
        self.counts += other.counts.to(self.counts.device)

    def copy_as(self, source: str, target: str, sign: float = 1.0) -> None:
        """Record metric ``source`` again under ``target`` (e.g. the teacher's CE of on-policy samples)."""
        i, j = METRICS.index(source), METRICS.index(target)
        self.sums[j] += sign * self.sums[i]
        self.counts[j] += self.counts[i]

    def means(self, sums: Tensor | None = None, counts: Tensor | None = None) -> dict[str, float]:
        """Each measured metric's mean (over ``sums`` / ``counts``, e.g. reduced over ranks; default: these)."""
        sums = (self.sums if sums is None else sums)
        counts = (self.counts if counts is None else counts)
        sums, counts = (x.tolist() if isinstance(x, Tensor) else x for x in (sums, counts))
        return {name: s / c for name, s, c in zip(METRICS, sums, counts, strict=True) if c > 0}

    def reset(self) -> None:
        self.sums.zero_()
        self.counts.zero_()


def _teacher_at_one(teacher_logp: Tensor, temperature: float) -> Tensor:
    """The teacher's log-probs at T = 1 from its log-probs at ``temperature`` (exact: T·log p_T = z − const). One
    teacher's: the mixture of several at T, brought back to 1, is not their mixture at 1 (`combined.mixture_at_one`)."""
    return teacher_logp if temperature == 1.0 else F.log_softmax(teacher_logp * temperature, dim=-1)


def _entropy(logp: Tensor) -> Tensor:
    return -torch.linalg.vecdot(logp.exp(), logp)  # (a row-wise dot: no [c, V] product kept)


def _agreement(student_logits: Tensor, teacher_top: Tensor) -> Tensor:
    """Whether the teacher's most likely token is (one of) the student's: the student's max through `amax`, which
    costs a third of an `argmax` on CPU; with no tie it is ``argmax == teacher_top``."""
    top = student_logits.gather(1, teacher_top[:, None]).squeeze(1)
    return (top == student_logits.amax(-1)).double()


def observe_student(into: LossDiagnostics, logits: Tensor, labels: Tensor | None) -> Tensor:
    """The student's entropy and CE over its full vocabulary; returns its log-probs at T = 1 ``[c, V_s]``."""
    logp = F.log_softmax(logits, dim=-1)
    into.add("student_entropy", _entropy(logp))
    if labels is not None:
        into.add("student_ce", -logp.gather(1, labels[:, None]))
    return logp


def observe_dense(into: LossDiagnostics, logits: Tensor, teacher_logp: Tensor, labels: Tensor | None,
                  temperature: float) -> None:
    """Metrics of one chunk against the teacher's full log-probs ``[c, V]`` at ``temperature`` (V <= V_s)."""
    student = observe_student(into, logits, labels)
    teacher = _teacher_at_one(teacher_logp, temperature)
    vocab = teacher.shape[1]
    p = teacher.exp()
    teacher_entropy = -torch.linalg.vecdot(p, teacher)
    into.add("teacher_entropy", teacher_entropy)
    into.add("kl_teacher_student", -teacher_entropy - torch.linalg.vecdot(p, student[:, :vocab]))
    into.add("top1_agreement", _agreement(logits, teacher.argmax(-1)))
    if labels is not None:
        inside = labels < vocab  # a label the compared vocabulary lacks: the teacher gives it no mass
        teacher_ce = -teacher.gather(1, labels.clamp(max=vocab - 1)[:, None]).squeeze(1)
        into.add("teacher_ce", torch.where(inside, teacher_ce, 0.0), inside.sum())  # no mask indexing: no wait


def observe_buckets(into: LossDiagnostics, logits: Tensor, ids: Tensor, teacher_buckets: Tensor, labels: Tensor | None,
                    temperature: float, floor: float, bucketed) -> None:
    """Metrics of one chunk against a sparse teacher: top-k ``ids`` ``[c, k]`` and its k + 1 bucket log-probs
    ``[c, k + 1]`` at ``temperature``; ``floor``: the loss's lowest bucket log-prob; ``bucketed``: the loss's
    coarse-graining of the student's log-probs onto the buckets (`loss.sparse.bucketed`)."""
    student = observe_student(into, logits, labels)
    k = ids.shape[1]
    teacher_top = ids.gather(1, teacher_buckets[:, :k].argmax(-1, keepdim=True)).squeeze(1)
    into.add("top1_agreement", _agreement(logits, teacher_top))
    into.add("teacher_tail_mass", teacher_buckets[:, k].exp())
    student_at_t = student if temperature == 1.0 else F.log_softmax(at_temperature(logits, temperature), -1)
    vocab_tail = student_at_t.scatter(1, ids, float("-inf")).logsumexp(-1)  # -inf: k = V, no tail to floor
    into.add("student_tail_clamped", ((vocab_tail < floor) & (k < logits.shape[1])).double())
    if temperature != 1.0:
        return
    student_buckets = bucketed(student, ids)
    p = teacher_buckets.exp()
    teacher_entropy = -(p * teacher_buckets).sum(-1)
    into.add("teacher_entropy", teacher_entropy)
    into.add("kl_teacher_student", -teacher_entropy - (p * student_buckets).sum(-1))
    if labels is not None:
        hits = ids == labels[:, None]
        label_logp = torch.where(hits.any(1), (teacher_buckets[:, :k] * hits).sum(1), teacher_buckets[:, k])
        into.add("teacher_ce", -label_logp)


def observe_groups(into: LossDiagnostics, logits: Tensor, teacher_scaled: Tensor, is_group: Tensor,
                   teacher_labels: Tensor, vocabulary, temperature: float) -> None:
    """Metrics of one chunk across tokenizers, on the rows that start an aligned group: the teacher's logits over
    its own vocabulary divided by ``temperature`` ``[c, V_t]``, its own next token per row (``teacher_labels``,
    -100 off the groups), and the `SharedVocabulary` that pairs the two vocabularies."""
    logits, teacher = logits[is_group], F.log_softmax(teacher_scaled[is_group] * temperature, dim=-1)
    teacher_labels = teacher_labels[is_group]
    student = observe_student(into, logits, None)
    into.add("teacher_entropy", _entropy(teacher))
    into.add("teacher_ce", -teacher.gather(1, teacher_labels[:, None].clamp(min=0)))
    partner = vocabulary.teacher_partner(logits.shape[1]).to(logits.device)
    into.add("top1_agreement", (partner[logits.argmax(-1)] == teacher.argmax(-1)).double())  # (via the pairs)
    if vocabulary.size:
        s_ids, t_ids = (v.to(logits.device) for v in (vocabulary.student, vocabulary.teacher))
        t_shared = F.log_softmax(teacher.index_select(1, t_ids), -1)
        s_shared = F.log_softmax(student.index_select(1, s_ids), -1)
        into.add("kl_teacher_student", (t_shared.exp() * (t_shared - s_shared)).sum(-1))
