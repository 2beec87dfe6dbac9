"""trl_distill: knowledge distillation on top of TRL, with a ZeRO-3 teacher beside a ZeRO-2 student."""

from .config import DistillationConfig
from .losses import LOSS_TYPES, chunked_distillation_loss, chunked_divergence, divergence
from .trainer import DistillationTrainer

__version__ = "0.1.0"

__all__ = [
    "LOSS_TYPES",
    "DistillationConfig",
    "DistillationTrainer",
    "chunked_distillation_loss",
    "chunked_divergence",
    "divergence",
]
