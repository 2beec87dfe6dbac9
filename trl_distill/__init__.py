"""trl_distill: knowledge distillation on top of TRL, with a ZeRO-3 teacher beside a ZeRO-2 student."""

from ._quiet import quiet_unactionable_warnings

quiet_unactionable_warnings()

from .config import DistillationConfig  # noqa: E402
from .losses import LOSS_TYPES, chunked_distillation_loss, chunked_divergence, divergence  # noqa: E402
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
