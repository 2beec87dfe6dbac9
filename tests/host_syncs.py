"""Counting, on a CPU, the operations of a training step that would make a GPU wait for the host (issue 55).

On CUDA a kernel launch returns at once; the host waits only when it needs a value back. These are counted:

* a tensor's value read on the host: ``.item()``, ``bool()``, ``float()``, ``int()`` (all dispatch
  ``aten::_local_scalar_dense``);
* a shape that depends on the data: ``nonzero`` (also inside boolean-mask indexing), ``masked_select``, ``unique``;
* a copy to the host: ``.cpu()``, ``.tolist()``, ``.numpy()`` (invisible to the profiler on a CPU, where the tensor
  is already there: counted at the Python call), except inside the DataLoader's collate function, whose tensors are
  the host's by construction (the batch goes to the device after it).

The first two come from `torch.profiler`'s events (every dispatch, library code included); the third from a
`TorchFunctionMode`. `SyncCounter` is a Trainer callback: each window runs from one optimizer step's end to the
next, so it holds one whole step (the batch fetched, the teacher run, the loss, backward, the optimizer, the logs).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

DISPATCHED = {
    "aten::_local_scalar_dense": "item",
    "aten::nonzero": "nonzero",
    "aten::masked_select": "masked_select",
    "aten::_unique2": "unique", "aten::unique_dim": "unique", "aten::unique_consecutive": "unique",
    "aten::_unique": "unique",
}  # fmt: skip
HOST_COPIES = {torch.Tensor.cpu: "cpu", torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


def _collating() -> bool:
    """Whether the caller runs inside a DataLoader's fetch (its collate function)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("torch", "utils", "data", "_utils", "fetch.py")):
            return True
        frame = frame.f_back
    return False


class _HostCopies(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = HOST_COPIES.get(func)
        if name is not None and not _collating():
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter(TrainerCallback):
    """Counts per optimizer step (`steps`: one Counter per whole step seen, the first step's window left out: it
    starts mid-way)."""

    def __init__(self):
        self.steps: list[Counter] = []
        self._open = None

    def _start(self):
        counts = Counter()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
        mode = _HostCopies(counts)
        mode.__enter__()
        self._open = (profiler, mode, counts)

    def _stop(self) -> Counter:
        profiler, mode, counts = self._open
        mode.__exit__(None, None, None)
        profiler.__exit__(None, None, None)
        for event in profiler.events():
            name = DISPATCHED.get(event.name)
            if name is not None:
                counts[name] += 1
        self._open = None
        return counts

    def on_step_end(self, args, state, control, **kwargs):
        if self._open is not None:
            self.steps.append(self._stop())
        if state.global_step < state.max_steps:
            self._start()

    def on_train_end(self, args, state, control, **kwargs):
        if self._open is not None:
            self._stop()  # a partial window (after the last step): not a step

    def per_step(self) -> list[int]:
        return [sum(c.values()) for c in self.steps]
