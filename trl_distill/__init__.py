"""trl_distill: knowledge distillation on top of TRL, with a ZeRO-3 teacher beside a ZeRO-2 student."""

from .runtime.quiet import quiet_unactionable_warnings

quiet_unactionable_warnings()

from .config import DistillationConfig  # noqa: E402
from .loss.divergences import LOSS_TYPES, divergence  # noqa: E402
from .loss.fused import chunked_distillation_loss, chunked_divergence  # noqa: E402
from .trainer import DistillationTrainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LOSS_TYPES",
    "DistillationConfig",
    "DistillationTrainer",
    "chunked_distillation_loss",
    "chunked_divergence",
    "divergence",
]
