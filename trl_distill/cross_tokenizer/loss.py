"""The cross-tokenizer divergence of one aligned group: its first token's next-token distributions, student and
teacher, both conditioned on the same text (see `alignment`).

- Matched part: both distributions restricted to the shared vocabulary (`vocabulary`) and renormalised there (a
  log-softmax over the shared columns), then the run's divergence (`divergences`). With identical tokenizers every
  column is shared and this is exactly the same-tokenizer loss.
- The rest: Universal Logit Distillation (Boizard et al., 2024) on the columns that match nothing: each side's
  probabilities there (of the full distribution), sorted in decreasing order, zero-padded to one length, and the
  L1 distance between them. No token identity is needed, only the shape of the two distributions.

TRL's GOLD (trl.experimental.gold, trl 1.16) computes the same ULD term and the same adaptive weights; its matched
part takes the JSD of the restricted probabilities without renormalising them (here: renormalised, so the matched
part is a divergence between distributions and the identical-tokenizer case is exact), and for a group of several
tokens it scales a later position's distribution by the earlier tokens' probabilities (here: the group's first
position, the one both models see after the same text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..loss.divergences import at_temperature, per_token_divergence
from ..loss.settings import LossSettings
from .vocabulary import SharedVocabulary


def uld_distance(student_probs: Tensor, teacher_probs: Tensor) -> Tensor:
    """Σ_j |sort(q)_j − sort(p)_j| per row, both sorted decreasingly and zero-padded to the longer: ``[N]``.

    Past the shorter side's m entries the padded side is 0, so those terms sum to the longer side's mass outside its
    m largest: only the m largest of each side are sorted (a partial sort of the wider vocabulary)."""
    m = min(student_probs.shape[-1], teacher_probs.shape[-1])
    tops = [probs.topk(m, dim=-1).values for probs in (student_probs, teacher_probs)]  # sorted, decreasing
    rest = sum(probs.sum(-1) - top.sum(-1) for probs, top in zip((student_probs, teacher_probs), tops, strict=True)
               if probs.shape[-1] > m)
    return (tops[0] - tops[1]).abs().sum(-1) + rest


def cross_tokenizer_divergence(student_logits: Tensor, teacher_logits: Tensor, vocabulary: SharedVocabulary,
                               settings: LossSettings | None = None) -> tuple[Tensor, Tensor]:
    """``(matched, uld)``, each ``[N]``, for student logits ``[N, V_s]`` and teacher logits ``[N, V_t]`` at the
    same N aligned positions (fp32 or wider); the divergence, its parameters and the temperature from `settings`."""
    settings = settings or LossSettings()
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = at_temperature(student_logits.to(dtype), settings.temperature)
    t = at_temperature(teacher_logits.to(dtype), settings.temperature)
    return divergence_at_temperature(s, t, vocabulary, settings)


def divergence_at_temperature(s: Tensor, t: Tensor, vocabulary: SharedVocabulary,
                              settings: LossSettings) -> tuple[Tensor, Tensor]:
    """`cross_tokenizer_divergence` of logits already divided by the temperature (or of log-probabilities at it:
    both are shift-invariant here)."""
    rows = s.shape[0]
    if vocabulary.size:
        ids = [v.to(s.device) for v in (vocabulary.student, vocabulary.teacher)]
        matched = per_token_divergence(F.log_softmax(s.index_select(1, ids[0]), -1),
                                       F.log_softmax(t.index_select(1, ids[1]), -1), settings.divergence,
                                       beta=settings.beta, skew_alpha=settings.skew_alpha)
    else:
        matched = s.new_zeros(rows)
    only = [v.to(s.device) for v in (vocabulary.student_only, vocabulary.teacher_only)]
    if only[0].numel() or only[1].numel():
        uld = uld_distance(F.softmax(s, -1).index_select(1, only[0]), F.softmax(t, -1).index_select(1, only[1]))
    else:
        uld = s.new_zeros(rows)
    return matched, uld


@dataclass(frozen=True)
class CrossTokenizerLoss:
    """``matched_weight · matched + uld_weight · uld`` per aligned group. Weights None (both): GOLD's adaptive
    choice, the shared fraction of the teacher's vocabulary ``|shared| / V_t`` and the rest, ``1 − that``."""

    vocabulary: SharedVocabulary
    settings: LossSettings = LossSettings()
    matched_weight: float | None = None
    uld_weight: float | None = None

    def __post_init__(self):
        if (self.matched_weight is None) != (self.uld_weight is None):
            raise ValueError("Set both cross-tokenizer weights (matched and ULD) or neither (adaptive).")

    @property
    def weights(self) -> tuple[float, float]:
        if self.matched_weight is not None:
            return self.matched_weight, self.uld_weight
        shared = self.vocabulary.size / (self.vocabulary.size + self.vocabulary.teacher_only.numel())
        return shared, 1.0 - shared

    def __call__(self, student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        """``[N]``: the weighted per-group loss."""
        return self.combine(*cross_tokenizer_divergence(student_logits, teacher_logits, self.vocabulary,
                                                        self.settings))

    def combine(self, matched: Tensor, uld: Tensor) -> Tensor:
        w_matched, w_uld = self.weights
        return w_matched * matched + w_uld * uld
