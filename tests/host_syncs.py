"""Counting, on a CPU, the operations of a training step that would make a GPU wait for the host (issue 55).

On CUDA a kernel launch returns at once; the host waits only when it needs a value back. These are counted:

* a tensor's value read on the host: ``.item()``, ``bool()``, ``float()``, ``int()`` (all dispatch
  ``aten::_local_scalar_dense``);
* a shape that depends on the data: ``nonzero`` (also inside boolean-mask indexing), ``masked_select``, ``unique``;
* a copy to the host: ``.cpu()``, ``.tolist()``, ``.numpy()`` (invisible to the profiler on a CPU, where the tensor
  is already there: counted at the Python call), except of the tensors the DataLoader's collate function made, and
  inside it: those are the host's by construction (the batch goes to the device after it, as copies).

The first two come from `torch.profiler`'s events (every dispatch, library code included); the third from a
`TorchFunctionMode`. `SyncCounter` is a Trainer callback: each window runs from one optimizer step's end to the
next, so it holds one whole step (the batch fetched, the teacher run, the loss, backward, the optimizer, the logs).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data._utils import fetch
from transformers import TrainerCallback

DISPATCHED = {
    "aten::_local_scalar_dense": "item",
    "aten::nonzero": "nonzero",
    "aten::masked_select": "masked_select",
    "aten::_unique2": "unique", "aten::unique_dim": "unique", "aten::unique_consecutive": "unique",
    "aten::_unique": "unique",
}  # fmt: skip
HOST_COPIES = {torch.Tensor.cpu: "cpu", torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


class _HostCopies(TorchFunctionMode):
    """Counts the copies to the host, but not of the tensors a DataLoader's fetch (its collate function) made, nor
    inside it: it wraps the fetchers while it is entered."""

    def __init__(self, counts: Counter | None):
        super().__init__()
        self.counts = counts  # None: not counting now
        self.collating = 0
        self.host: set[int] = set()  # ids of live tensors a collate function made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = HOST_COPIES.get(func)
        counting = self.counts is not None and not self.collating
        if name is not None and counting and not (args and id(args[0]) in self.host):
            self.counts[name] += 1
        out = func(*args, **(kwargs or {}))
        if self.collating and isinstance(out, torch.Tensor) and id(out) not in self.host:
            self.host.add(id(out))
            weakref.finalize(out, self.host.discard, id(out))
        return out

    def __enter__(self):
        self._fetchers = {cls: cls.fetch for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher)}
        for cls, original in self._fetchers.items():
            cls.fetch = self._collated(original)
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, original in self._fetchers.items():
            cls.fetch = original
        return super().__exit__(*exc)

    def _collated(self, original):
        def fetch_(fetcher, *args, **kwargs):
            self.collating += 1
            try:
                return original(fetcher, *args, **kwargs)
            finally:
                self.collating -= 1

        return fetch_


class SyncCounter(TrainerCallback):
    """Counts per optimizer step (`steps`: one Counter per whole step seen, the first step's window left out: it
    starts mid-way). The copy counter is entered for the whole of training (a batch may be collated a step ahead);
    a profiler per window."""

    def __init__(self):
        self.steps: list[Counter] = []
        self._copies: _HostCopies | None = None
        self._profiler = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._copies = _HostCopies(None)
        self._copies.__enter__()

    def _start(self):
        self._copies.counts = Counter()
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.__enter__()

    def _stop(self) -> Counter:
        counts, self._copies.counts = self._copies.counts, None
        self._profiler.__exit__(None, None, None)
        for event in self._profiler.events():
            name = DISPATCHED.get(event.name)
            if name is not None:
                counts[name] += 1
        self._profiler = None
        return counts

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None:
            self.steps.append(self._stop())
        if state.global_step < state.max_steps:
            self._start()

    def on_train_end(self, args, state, control, **kwargs):
        if self._profiler is not None:
            self._stop()  # a partial window (after the last step): not a step
        self._copies.__exit__(None, None, None)

    def per_step(self) -> list[int]:
        return [sum(c.values()) for c in self.steps]
