"""The sampled-token objective of on-policy distillation (``on_policy_objective="sampled_token"``): a policy gradient
on the student's own samples instead of a divergence over the whole vocabulary.

Each sampled token ``y_t`` of a completion gets the reward ``r_t = kl_coef · (log π_teacher(y_t) − log π_student(y_t))``
(the negative of the reverse KL's one-sample estimate: tinker's and verl's policy-gradient OPD), its advantage is
``A_t = Σ_{k ≥ t} γ^{k−t} r_k`` over the rest of its completion (``discount`` γ; 0: ``A_t = r_t``), plus, with a
task reward ``R`` per completion (`task_reward_funcs`), ``task_weight · (R − mean R)`` over the micro-batch's
completions. The loss is GRPO's clipped surrogate, ``−min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε_high) A_t)`` with
``ρ_t = π_student(y_t) / π_old(y_t)``: π_old is the engine that sampled (a vLLM rollout server's log-probs) or the
student itself when HF `generate` sampled (ρ = 1, the plain policy gradient). With the engine's truncated
importance-sampling correction (`vllm_importance_sampling_correction`, as TRL's GRPO applies it) π_old is the
trainer's own student instead, and each token's surrogate is weighted by ``min(π_student / π_engine, clip_max)``
(detached; `loss.rollout_correction`). Advantages are never differentiated.

Only the teacher's log-prob of each sampled token is read (`TeacherSignal.token_log_probs`): any teacher whose signal
holds it (a live teacher's full distribution, a served teacher asked for the sampled tokens' log-probs, a teacher of
another tokenizer: its log-prob of each aligned group's text shared by the group's student tokens, so a group's
rewards sum to ``log π_teacher(text) − log π_student(text)``; a token no group covers gets no teacher reward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .signal import TeacherSignal

if TYPE_CHECKING:
    from .diagnostics import LossDiagnostics
    from .rollout_correction import RolloutCorrection
    from .settings import LossSettings


@dataclass(frozen=True)
class SampledTokenSettings:
    """The objective's coefficients: `kl_coef` on the teacher−student log-prob gap, its `discount` along the
    completion, GRPO's clip range (`epsilon`, `epsilon_high`) and the task reward's `task_weight`."""

    kl_coef: float = 1.0
    discount: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    task_weight: float = 1.0

    @classmethod
    def of(cls, args) -> SampledTokenSettings:
        high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        return cls(args.sampled_token_kl_coef, args.sampled_token_discount, args.epsilon, high,
                   args.task_reward_weight)


@dataclass
class SampledTokenJob:
    """One micro-batch's sampled-token loss: its settings, the task reward of each completion (``[B]``, or None) and
    what the loss counted (filled as it runs: summed advantages, the summed teacher gap and the tokens it covers,
    clipped tokens, tokens)."""

    settings: SampledTokenSettings
    rewards: Tensor | None = None
    stats: dict = field(default_factory=lambda: dict.fromkeys(("advantage", "gap", "gap_tokens", "clipped", "tokens"),
                                                              0.0))


def ratio_reference(correction: RolloutCorrection | None) -> Tensor | None:
    """The log-probs ρ is taken against: the engine's (`correction.engine`); None (the student's own, ρ = 1) when
    no engine sampled, or when the correction's importance weights already account for the engine (its cap set)."""
    return None if correction is None or correction.cap is not None else correction.engine


def discounted(rewards: Tensor, sequence: Tensor, gamma: float) -> Tensor:
    """``A_t = Σ_{k ≥ t, same sequence} γ^{k−t} r_k`` for the loss rows `rewards` ``[n]``, whose completion
    `sequence` ``[n]`` gives (each completion's rows contiguous and in order, as the loss takes them)."""
    if gamma == 0 or rewards.numel() == 0:
        return rewards.clone()
    out = rewards.detach().double().cpu().clone()
    same = (sequence[1:] == sequence[:-1]).cpu().tolist()
    for t in range(len(out) - 2, -1, -1):
        if same[t]:
            out[t] += gamma * out[t + 1]
    return out.to(rewards)


def covered_gap(gap: Tensor, covered: Tensor | None) -> Tensor:
    """`gap` with 0 on the tokens the teacher has no log-prob of (`covered` False: another tokenizer's text no group
    covers); None covers every token, and a NaN anywhere else stays NaN (the loss guard stops the run)."""
    return gap if covered is None else torch.where(covered.to(gap.device), gap, 0.0)


def task_advantages(rewards: Tensor | None, sequence: Tensor, weight: float) -> Tensor | None:
    """``weight · (R − mean R)`` of each loss row's completion (the micro-batch's mean as the baseline), or None."""
    if rewards is None:
        return None
    rewards = rewards.to(sequence.device, torch.float64)
    return (weight * (rewards - rewards.mean()))[sequence]


class SampledTokenSignal(TeacherSignal):
    """A teacher signal (`inner`) read at the sampled tokens only, its per-token term the clipped surrogate above.

    `labels` ``[n]``: the sampled tokens in the loss's row order; `old` ``[n]``: the sampling engine's log-probs
    (None: the student's own, ρ = 1); `extra` ``[n]``: the task advantage (None: none); `advantages` ``[n]``: given
    whole when the discount needs every token's reward first (`precompute`), else each chunk's from its own tokens."""

    closed_form = False

    def __init__(self, inner: TeacherSignal, labels: Tensor, job: SampledTokenJob, old: Tensor | None,
                 extra: Tensor | None, advantages: Tensor | None = None):
        self.inner, self.labels, self.job, self.old, self.extra = inner, labels, job, old, extra
        self.advantages = advantages
        self.work, self.bounds = inner.work, inner.bounds

    def chunk(self, rows: slice, compute: torch.dtype):
        inner = self.inner.chunk(rows, compute)
        teacher = self.inner.token_log_probs(inner, self.labels[rows]).detach()
        return inner, rows, teacher, self.inner.token_coverage(inner)

    def per_token(self, student_logp: Tensor, chunk, settings: LossSettings) -> Tensor:
        _, rows, teacher, covered = chunk
        s = self.job.settings
        student = student_logp.gather(1, self.labels[rows, None]).squeeze(1)
        with torch.no_grad():
            gap = covered_gap(teacher.to(student) - student.detach(), covered)
            if self.advantages is not None:
                advantage = self.advantages[rows].to(student)
            else:
                advantage = s.kl_coef * gap
                if self.extra is not None:
                    advantage = advantage + self.extra[rows].to(student)
            old = student.detach() if self.old is None else self.old[rows].to(student)
        ratio = torch.exp(student - old)
        clipped = ratio.clamp(1 - s.epsilon, 1 + s.epsilon_high)
        surrogate = torch.minimum(ratio * advantage, clipped * advantage)
        with torch.no_grad():
            stats = self.job.stats
            stats["advantage"] += float(advantage.sum())
            stats["gap"] += float(gap.sum())
            stats["gap_tokens"] += int(covered.sum()) if covered is not None else gap.numel()
            stats["clipped"] += float(((clipped * advantage) < (ratio * advantage)).sum())
            stats["tokens"] += advantage.numel()
        return -surrogate

    def observe(self, into: LossDiagnostics, rows: slice, logits: Tensor, chunk, labels: Tensor | None,
                settings: LossSettings) -> None:
        self.inner.observe(into, rows, logits, chunk[0], labels, settings)

    def observe_batch(self, into: LossDiagnostics) -> None:
        self.inner.observe_batch(into)

    def tally(self, rows: slice, kd: Tensor) -> None:
        self.inner.tally(rows, kd)


def sampled_token_signal(inner: TeacherSignal, job: SampledTokenJob, rows: Tensor, labels: Tensor, width: int,
                         states: Tensor, head, vocab: int, chunk_size: int, old: Tensor | None) -> SampledTokenSignal:
    """The sampled-token signal over the loss rows `rows` (flat indices into ``[B, width]``, in the loss's order) of
    the student's `states` ``[N, F]`` (projected by `head`; None: its logits). With a discount, every token's reward
    is computed first (no gradient: one more projection of the student's rows, and of a live teacher's)."""
    from .chunk_pass import chunk_slices

    s = job.settings
    sequence = torch.div(rows, width, rounding_mode="floor")
    extra = task_advantages(job.rewards, sequence, s.task_weight)
    if s.discount == 0:
        return SampledTokenSignal(inner, labels, job, old, extra)
    gaps = torch.empty(len(labels), dtype=torch.float64, device=labels.device)
    compute = torch.promote_types(states.dtype, torch.float32)
    with torch.no_grad():
        for part in chunk_slices(len(labels), chunk_size, inner.bounds):
            picked = states.index_select(0, rows[part])
            logits = (picked if head is None else head.logits(picked))[:, :vocab].to(compute)
            student = F.log_softmax(logits, -1).gather(1, labels[part, None]).squeeze(1)
            chunk = inner.chunk(part, compute)
            teacher = inner.token_log_probs(chunk, labels[part])
            gaps[part] = covered_gap(teacher.double() - student.double(), inner.token_coverage(chunk))
    advantages = discounted(s.kl_coef * gaps, sequence, s.discount)
    if extra is not None:
        advantages = advantages + extra
    return SampledTokenSignal(inner, labels, job, old, extra, advantages)
