"""trl_distill: knowledge distillation on top of TRL, with a ZeRO-3 teacher beside a ZeRO-2 student."""

from typing import TYPE_CHECKING

from .runtime.build_locks import prepare_op_builds
from .runtime.quiet import quiet_unactionable_warnings

quiet_unactionable_warnings()
prepare_op_builds()  # before any process group starts: DeepSpeed builds its CPU op then

from .config import DistillationConfig  # noqa: E402
from .loss.divergences import LOSS_TYPES, divergence  # noqa: E402
from .loss.fused import chunked_distillation_loss, chunked_divergence  # noqa: E402

if TYPE_CHECKING:
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


def __getattr__(name: str):
    """`DistillationTrainer` is imported on first use: it pulls in `trl.SFTTrainer` and `datasets` (about 1 s), which
    `import trl_distill` (a command line's `--help`, `plan`, `report`) does without."""
    if name == "DistillationTrainer":
        from .trainer import DistillationTrainer

        return DistillationTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "DistillationTrainer"])
