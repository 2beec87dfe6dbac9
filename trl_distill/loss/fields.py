"""The `DistillationConfig` fields of the loss: ``alpha * KD + (1 - alpha) * CE`` and how KD is taken."""

from __future__ import annotations

from dataclasses import dataclass, field

from .divergences import LOSS_TYPES


@dataclass
class LossFields:
    """The divergence, its temperature and weights, which tokens count, and the chunk the lm_heads project at once."""

    divergence: str = field(
        default="forward_kl",
        metadata={
            "help": "Divergence between teacher (p) and student (q) distributions.",
            "choices": list(LOSS_TYPES),
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Softmax temperature applied to both the teacher's and the student's logits in the KD term."},
    )
    alpha: float = field(
        default=0.5,
        metadata={"help": "Weight of the KD term: loss = alpha * KD + (1 - alpha) * CE. 1.0 is pure distillation."},
    )
    beta: float = field(
        default=0.5,
        metadata={"help": "Teacher weight in the mixture of the generalized JSD (`divergence='jsd'`), in [0, 1]."},
    )
    skew_alpha: float = field(
        default=0.1,
        metadata={"help": "Skew of `skew_forward_kl` / `skew_reverse_kl` (DistiLLM), in [0, 1]."},
    )
    kd_temperature_scaling: bool = field(
        default=True,
        metadata={"help": "Multiply the KD term by temperature**2 (Hinton et al.), keeping its gradient scale."},
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens projected through the lm_heads at a time in the chunked loss. None picks a "
            "size from the vocabulary so one chunk of fp32 logits stays near 128 MiB."
        },
    )
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Compute KD and CE on assistant tokens only (conversational `messages` datasets). Unset: on when "
            "the chat template has generation markers or TRL can add them, off (with a warning) otherwise."
        },
    )
