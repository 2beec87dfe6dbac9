"""The six token-level divergences between a teacher distribution p and a student distribution q, as formulas.

All take fp32 (or fp64) log-probabilities ``[N, V]`` (``log_softmax(logits / T)``) and return ``[N]``. `DIVERGENCES`
is the table the losses dispatch on, one signature for all: ``(student_logp, teacher_logp, beta, skew_alpha)``.
`divergence` is the plain loss from full logits; the chunked one from hidden states is in `trl_distill.loss.fused`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DIVERGENCES",
    "LOSS_TYPES",
    "at_temperature",
    "check_divergence",
    "divergence",
    "forward_kl",
    "jsd",
    "normalise_sum",
    "per_token_divergence",
    "reverse_kl",
    "skew_forward_kl",
    "skew_reverse_kl",
    "tvd",
]


# ----------------------------------------------------------------------------------------------------
# Per-token divergences: log-probs [N, V] -> [N]
# ----------------------------------------------------------------------------------------------------
def _kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a ‖ b) = Σ_v a·(log a − log b). ``[N, V]`` x2 -> ``[N]``."""
    return (logp_a.exp() * (logp_a - logp_b)).sum(-1)


def _log_mixture(logp_a: Tensor, logp_b: Tensor, weight_a: float) -> Tensor:
    """log(w·a + (1−w)·b), computed stably with logaddexp. ``[N, V]`` x2 -> ``[N, V]``."""
    if weight_a == 0.0:
        return logp_b
    if weight_a == 1.0:
        return logp_a
    return torch.logaddexp(logp_a + math.log(weight_a), logp_b + math.log1p(-weight_a))


def forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(p ‖ q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(teacher_logp, student_logp)


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(q ‖ p). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(student_logp, teacher_logp)


def jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float = 0.5) -> Tensor:
    """Generalized JSD_β = β·KL(p ‖ m) + (1−β)·KL(q ‖ m) with m = β·p + (1−β)·q. ``[N, V]`` x2 -> ``[N]``.

    As in TRL's ``GKDTrainer.generalized_jsd_loss``, the endpoints are special-cased: β == 0 returns the
    forward KL(p ‖ q) and β == 1 the reverse KL(q ‖ p) (the literal formula would give 0 there).
    """
    if beta == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    log_m = _log_mixture(teacher_logp, student_logp, beta)
    return beta * _kl(teacher_logp, log_m) + (1.0 - beta) * _kl(student_logp, log_m)


def skew_forward_kl(student_logp: Tensor, teacher_logp: Tensor, alpha: float = 0.1) -> Tensor:
    """DistiLLM skew KL(p ‖ α·p + (1−α)·q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(teacher_logp, _log_mixture(teacher_logp, student_logp, alpha))


def skew_reverse_kl(student_logp: Tensor, teacher_logp: Tensor, alpha: float = 0.1) -> Tensor:
    """DistiLLM skew KL(q ‖ (1−α)·p + α·q). ``[N, V]`` x2 -> ``[N]``."""
    return _kl(student_logp, _log_mixture(student_logp, teacher_logp, alpha))


def tvd(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Total variation ½·Σ_v |p − q|. ``[N, V]`` x2 -> ``[N]``."""
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(-1)


# One signature for the table: (student log-probs, teacher log-probs, beta, skew_alpha) -> [N]
PerTokenDivergence = Callable[[Tensor, Tensor, float, float], Tensor]
DIVERGENCES: dict[str, PerTokenDivergence] = {
    "forward_kl": lambda s, t, beta, skew: forward_kl(s, t),
    "reverse_kl": lambda s, t, beta, skew: reverse_kl(s, t),
    "jsd": lambda s, t, beta, skew: jsd(s, t, beta),
    "skew_forward_kl": lambda s, t, beta, skew: skew_forward_kl(s, t, skew),
    "skew_reverse_kl": lambda s, t, beta, skew: skew_reverse_kl(s, t, skew),
    "tvd": lambda s, t, beta, skew: tvd(s, t),
}
LOSS_TYPES = tuple(DIVERGENCES)


def per_token_divergence(
    student_logp: Tensor, teacher_logp: Tensor, loss_type: str, *, beta: float = 0.5, skew_alpha: float = 0.1
) -> Tensor:
    """The per-token divergence named ``loss_type``. Log-probs ``[N, V]`` x2 -> ``[N]``."""
    check_divergence(loss_type, beta, skew_alpha, 1.0)
    return DIVERGENCES[loss_type](student_logp, teacher_logp, beta, skew_alpha)


def check_divergence(loss_type: str, beta: float, skew_alpha: float, temperature: float) -> None:
    """One clear error for an unknown divergence or a parameter out of range."""
    if loss_type not in DIVERGENCES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; valid choices are {', '.join(LOSS_TYPES)}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    if not 0.0 <= skew_alpha <= 1.0:
        raise ValueError(f"skew_alpha must be in [0, 1], got {skew_alpha}.")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")


def at_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``logits / T``; the identical tensor at T == 1 (saves a full-size copy and its backward pass)."""
    return logits if temperature == 1.0 else logits / temperature


# ----------------------------------------------------------------------------------------------------
# Logits -> loss
# ----------------------------------------------------------------------------------------------------
def normalise_sum(total: Tensor, num_rows: int, num_items_in_batch: int | Tensor | None) -> Tensor:
    """Sum -> per-item loss: divide by ``num_items_in_batch`` if given, else by the row count (both >= 1)."""
    if num_items_in_batch is None:
        return total / max(num_rows, 1)
    if isinstance(num_items_in_batch, Tensor):
        return total / num_items_in_batch.to(total.device).clamp_min(1)
    return total / max(num_items_in_batch, 1)


def divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    loss_type: str,
    *,
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
) -> Tensor:
    """Scalar loss from student/teacher logits ``[..., V]`` and an optional bool ``mask [...]`` (True = loss).

    Returns Σ over unmasked tokens / ``num_items_in_batch`` if given, else the mean over unmasked tokens.
    Computed in ``promote_types(dtype, float32)``; ``teacher_logits`` are not detached; no T² scaling.
    """
    check_divergence(loss_type, beta, skew_alpha, temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} "
            "must have the same shape; slice both to the shared vocabulary first."
        )
    vocab = student_logits.shape[-1]
    if mask is not None:
        student_logits, teacher_logits = student_logits[mask], teacher_logits[mask]
    s = student_logits.reshape(-1, vocab)
    t = teacher_logits.reshape(-1, vocab)
    dtype = torch.promote_types(s.dtype, torch.float32)
    s_logp = F.log_softmax(at_temperature(s.to(dtype), temperature), dim=-1)
    t_logp = F.log_softmax(at_temperature(t.to(dtype), temperature), dim=-1)
    per_token = per_token_divergence(s_logp, t_logp, loss_type, beta=beta, skew_alpha=skew_alpha)
    return normalise_sum(per_token.sum(), s.shape[0], num_items_in_batch)
