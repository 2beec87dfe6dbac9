"""The rollout engine's log-probs inside the loss: how far the trainer's student is from the engine that sampled
(measured on every sampled token), and an optional truncated importance-sampling correction of that gap.

The rows are the loss's selected rows (each a sampled token, in order). For each, the trainer's log-prob of its
token at temperature 1, ``log π_train``, is read off the chunk's logits the loss projects anyway; ``gap`` gets
``log π_train − log π_engine``. With a `cap`, each row's KD and CE are weighted by ``min(π_train / π_engine,
cap)`` (detached: TRL's GRPO ``vllm_importance_sampling_correction``, token level, truncated at
``vllm_importance_sampling_clip_max``), which corrects the loss's expectation for samples drawn from the engine's
distribution instead of the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutCorrection:
    """``engine`` ``[n]``: the engine's log-prob of each selected row's token; ``cap``: the IS weights' truncation
    (None: measure only, the loss unchanged). ``gap`` ``[n]`` is filled as the loss runs."""

    engine: Tensor
    cap: float | None = None
    gap: Tensor = field(init=False)

    def __post_init__(self):
        self.gap = torch.zeros_like(self.engine, dtype=torch.float32)

    def weights(self, rows: slice, trainer_logprob: Tensor) -> Tensor | None:
        """Record the chunk's gaps; its rows' IS weights (None without a cap)."""
        gap = trainer_logprob.detach() - self.engine[rows].to(trainer_logprob)
        self.gap[rows] = gap.to(self.gap)
        return None if self.cap is None else gap.exp().clamp(max=self.cap)
