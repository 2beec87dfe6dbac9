"""trl_distill: knowledge distillation on top of TRL, with a ZeRO-3 teacher beside a ZeRO-2 student."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import DistillationConfig
    from .loss.divergences import LOSS_TYPES, divergence
    from .loss.fused import chunked_distillation_loss, chunked_divergence
    from .trainer import DistillationTrainer

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use: `import trl_distill.config` (a command
# line's `--help`, `plan`, `report`) loads no more of the package than it needs
PUBLIC = {
    "LOSS_TYPES": "loss.divergences",
    "DistillationConfig": "config",
    "DistillationTrainer": "trainer",
    "chunked_distillation_loss": "loss.fused",
    "chunked_divergence": "loss.fused",
    "divergence": "loss.divergences",
}

__all__ = [
    "LOSS_TYPES",
    "DistillationConfig",
    "DistillationTrainer",
    "chunked_distillation_loss",
    "chunked_divergence",
    "divergence",
]


def __getattr__(name: str):
    """The public name `name`, from its module (`DistillationTrainer` pulls in `trl.SFTTrainer` and `datasets`)."""
    if name in PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
