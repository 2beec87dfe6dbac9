"""Everything about the distillation loss that is not a tensor (`LossSettings`), and the chunk size it defaults to."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .divergences import DIVERGENCES, check_divergence

# One chunk's fp32 logits hold about this many elements when ``chunk_size`` is None.
_AUTO_CHUNK_ELEMENTS = 1 << 25


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk so that one chunk of fp32 logits holds about 2^25 elements (128 MiB)."""
    return max(1, _AUTO_CHUNK_ELEMENTS // vocab)


@dataclass(frozen=True)
class LossSettings:
    """Everything about the distillation loss that is not a tensor, validated once.

    ``divergence`` and its ``beta`` (JSD) / ``skew_alpha`` (skew KLs); ``temperature`` for both distributions;
    ``chunk_size`` rows projected at a time (None: `default_chunk_size`); ``vocab_size`` logits compared (None: the
    smaller vocabulary); ``kd_grad`` / ``ce_grad``: whether that term gets a gradient (a term weighted 0 is only
    logged, with no gradient buffers).
    """

    divergence: str = "forward_kl"
    beta: float = 0.5
    skew_alpha: float = 0.1
    temperature: float = 1.0
    chunk_size: int | None = None
    vocab_size: int | None = None
    kd_grad: bool = True
    ce_grad: bool = True

    def __post_init__(self):
        check_divergence(self.divergence, self.beta, self.skew_alpha, self.temperature)
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}.")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}.")

    @classmethod
    def of(cls, args, vocab_size: int | None) -> LossSettings:
        """A run's settings from its `DistillationConfig` as it is now (a callback may change it between steps)."""
        return cls(args.divergence, args.beta, args.skew_alpha, args.temperature, args.loss_chunk_size, vocab_size,
                   kd_grad=args.alpha > 0, ce_grad=args.alpha < 1)  # a term weighted 0: logged only

    def per_token(self, student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
        """This divergence per token: log-probs ``[N, V]`` x2 -> ``[N]``."""
        return DIVERGENCES[self.divergence](student_logp, teacher_logp, self.beta, self.skew_alpha)
