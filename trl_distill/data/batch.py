"""What a collated batch carries besides the model's inputs: its loss tokens (`loss_tokens`), and a sparse teacher
signal, from the collator that fetched it to `compute_loss` that uses it.

The teacher cache reads its rows' signal in the collator; a served teacher's collator sends a request and leaves a
future in the batch, so the answer arrives while the student computes earlier micro-batches. Either way the batch
holds a `SignalHolder` under `SIGNAL`, and the loss calls `pop_signal`.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ..loss.sparse import SparseTeacherSignal

SIGNAL = "teacher_signal"  # the batch key


def loss_tokens(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, mask)`` ``[B, T']``: the token each position predicts (the shifted labels) and where it is a loss
    token. Position t predicts ``target[:, t]``. The one definition training, the step pass and the caches use."""
    target = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
    return target, target != -100


class SignalHolder:
    """The rows' `SparseTeacherSignal`, or a future of it. An opaque object on purpose: the Trainer's
    `_prepare_inputs` would cast float tensors to the DeepSpeed dtype (bf16), and it cannot rebuild a NamedTuple
    (transformers 5.24)."""

    def __init__(self, signal: SparseTeacherSignal | Future, build=None):
        self._signal, self._build = signal, build

    @property
    def signal(self) -> SparseTeacherSignal:
        """The signal; waits for it when it is still being fetched (the fetch itself has a timeout). A future's
        result goes through `build` first, on the thread reading it (a served teacher's numpy arrays)."""
        if isinstance(self._signal, Future):
            result = self._signal.result()
            self._signal = result if self._build is None else self._build(result)
        return self._signal


def pop_signal(inputs: dict, key: str = SIGNAL) -> SparseTeacherSignal | None:
    """Remove the teacher signal (under `key`: one per teacher when several teach) from a batch (the model must not
    see it), on the batch's device; None for a batch without one."""
    holder = inputs.pop(key, None)
    if holder is None:
        return None
    device = inputs["input_ids"].device
    return SparseTeacherSignal(*(t.to(device, non_blocking=True) for t in holder.signal))
