"""Where a batch's loss tokens are, found without making the device wait.

The loss projects only the positions that carry a loss token, so it needs their indices; a mask's indices
(``nonzero``, boolean-mask indexing) make a GPU wait for the host, once per call. The collator makes its labels on
the host, and the batch carries that host tensor to the step (`LossTokensCollator`, `loss_layout`), which finds the
indices there (numpy) and sends them up without waiting. A batch that comes without them (a stream, whose batches
accelerate dispatches; labels changed on the way: sequence parallelism's shards) is measured on the device, every
micro-batch of a step at once: the sizes in one read, the indices at those sizes with `torch.nonzero_static`.
`LayoutMemo` holds a step's layouts until each micro-batch's loss takes its own (issue 55: no more host
synchronisations per step than TRL's GKD). Indices from the host are checked on the device against the labels
they were found from, the check read with the step's guards (`runtime.guards`): a mismatch stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .batch import add_extras, loss_tokens, pop_extra


@dataclass(frozen=True)
class LossLayout:
    """One micro-batch's loss tokens, of its mask ``[B, T]`` (position t predicts target t)."""

    keep: Tensor
    """``[K]`` int64: the positions with a loss token in some row, ascending."""
    rows: Tensor
    """``[N]`` int64: the loss tokens' row-major indices in the kept ``[B, K]`` grid ((row, position) order)."""

    @property
    def count(self) -> int:
        """N, known on the host (a shape)."""
        return self.rows.numel()


@dataclass(frozen=True)
class StepLayout:
    """The micro-batches of one optimizer step, side by side (right-padded to the widest): what a teacher that runs
    once per step over all of their rows needs besides each one's own `LossLayout`."""

    micro: list[LossLayout]
    keep: Tensor
    """``[P]``: the positions with a loss token in any row of any micro-batch."""
    rows: Tensor
    """``[N_1 + ... + N_m]``: every loss token's row-major index in the ``[R, P]`` grid of all the step's rows."""
    row_bounds: list[int]
    """``R + 1`` host ints: row r's loss tokens are ``rows[row_bounds[r]:row_bounds[r + 1]]``."""

    @property
    def counts(self) -> list[int]:
        return [layout.count for layout in self.micro]


def step_layout(masks: list[Tensor]) -> StepLayout:
    """The layouts of the loss-token masks ``[B_i, T_i]`` of one step's micro-batches, with one host read."""
    anys = [m.any(0) for m in masks]
    width = max(m.shape[1] for m in masks)
    union = torch.stack([F.pad(a, (0, width - a.numel())) for a in anys]).any(0)
    sizes = torch.cat([torch.stack([a.sum() for a in anys]), torch.cat([m.sum(1) for m in masks]),
                       union.sum().reshape(1)]).tolist()  # the one read
    kept, per_row, positions = sizes[: len(masks)], sizes[len(masks) : -1], sizes[-1]
    union_keep = torch.nonzero_static(union, size=positions).squeeze(1)
    union_rank = union.cumsum(0) - 1  # position t's index among the union's positions
    micro, step_rows, first_row = [], [], 0
    for mask, any_row, k in zip(masks, anys, kept, strict=True):
        batch, length = mask.shape
        count = sum(per_row[first_row : first_row + batch])
        flat = torch.nonzero_static(mask.reshape(-1), size=count).squeeze(1)  # into [B * T]
        row, position = flat // length, flat % length
        keep = torch.nonzero_static(any_row, size=k).squeeze(1)
        micro.append(LossLayout(keep, row * k + (any_row.cumsum(0) - 1)[position]))
        step_rows.append((row + first_row) * positions + union_rank[position])
        first_row += batch
    bounds = [0]
    for n in per_row:
        bounds.append(bounds[-1] + n)
    return StepLayout(micro, union_keep, torch.cat(step_rows), bounds)


@dataclass(frozen=True)
class HostLayout:
    """A micro-batch's loss tokens found on the host (numpy)."""

    shape: tuple[int, int]
    """``[B, T]`` of the loss-token mask."""
    keep: np.ndarray
    flat: np.ndarray
    """The loss tokens' row-major indices in ``[B * T]``."""

    @classmethod
    def of(cls, key: str, labels: Tensor) -> HostLayout:
        """From a batch's host `labels` under `key` ("labels": shifted here, as `loss_tokens` does)."""
        values = labels.numpy()
        mask = (values[:, 1:] if key == "labels" else values) != -100
        return cls(mask.shape, np.flatnonzero(mask.any(0)), np.flatnonzero(mask))


class LossTokensCollator:
    """Wraps the run's collator: each batch whose labels are on the host also carries them (`loss_layout`), to be
    read there as the step starts, after whatever the collators around this one did to them in place."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        if isinstance(batch, dict):
            key = "shift_labels" if "shift_labels" in batch else "labels" if "labels" in batch else None
            labels = batch.get(key)
            if isinstance(labels, Tensor) and labels.device.type == "cpu" and labels.dim() == 2:
                add_extras(batch, loss_layout=(key, labels))
        return batch

    def __getattr__(self, name):  # the wrapped collator's attributes (e.g. `padding_free`)
        if name == "collator":  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.collator, name)


def streamed(*datasets) -> bool:
    """Whether any of `datasets` (a dict of them counts as its values) is iterable, not map-style."""
    from torch.utils.data import IterableDataset

    flat = [d for x in datasets for d in (x.values() if isinstance(x, dict) else [x])]
    return any(isinstance(d, IterableDataset) or type(d).__name__ == "IterableDataset" for d in flat)


def host_step_layout(hosts: list[HostLayout], device) -> StepLayout:
    """`step_layout` of layouts found on the host: the same indices, computed there and sent up without waiting."""
    union = np.unique(np.concatenate([h.keep for h in hosts]))
    micro, step_rows, bounds, first_row = [], [], [0], 0
    for host in hosts:
        batch, length = host.shape
        row, position = host.flat // length, host.flat % length
        rows = row * host.keep.size + np.searchsorted(host.keep, position)
        micro.append(LossLayout(_up(host.keep, device), _up(rows, device)))
        step_rows.append((row + first_row) * union.size + np.searchsorted(union, position))
        bounds += (bounds[-1] + np.cumsum(np.bincount(row, minlength=batch))).tolist()
        first_row += batch
    return StepLayout(micro, _up(union, device), _up(np.concatenate(step_rows), device), bounds)


def _up(values: np.ndarray, device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device, non_blocking=True)


def loss_layout(mask: Tensor) -> LossLayout:
    """One micro-batch's layout (one host read)."""
    return step_layout([mask]).micro[0]


class LayoutMemo:
    """A step's layouts, found together as the step's batches are fetched and taken by each micro-batch's loss.
    A batch is recognised by its ``input_ids`` and ``labels`` tensors themselves (held until taken, so their memory
    cannot be another batch's); any other batch (evaluation, samples drawn this step) is measured when asked."""

    def __init__(self):
        self._step: list[tuple[dict, LossLayout]] = []
        self._union: tuple[list[dict], StepLayout] | None = None

    def measure_step(self, batch_samples: list, prepared, sampled: bool, flags=None) -> None:
        """Where every micro-batch of an optimizer step has its loss tokens, for their losses and the teacher's step
        pass (`start_step`), from the `batch_samples` as fetched (`prepared`: the Trainer's input preparation);
        each one's host labels taken off it. Nothing for a step whose completions the sampler replaces
        (`sampled`)."""
        hosts = [pop_extra(b, "loss_layout") if isinstance(b, dict) else None for b in batch_samples]  # no model sees
        batches = [] if sampled else [prepared(b) for b in batch_samples]
        if batches and all(isinstance(b, dict) and {"labels", "shift_labels"} & set(b) for b in batches):
            self.start_step(batches, [loss_tokens(b)[1] for b in batches], hosts, flags)
        else:
            self.clear()

    def start_step(self, batches: list[dict], masks: list[Tensor], hosts: list | None = None, flags=None) -> None:
        """Measure the step's micro-batches (`masks`: their loss-token masks) at once; forget the last step's. The
        collator's host labels (`hosts`: each batch's `loss_layout`, taken off it) when every batch has them and they
        fit, each checked on the device against its mask into `flags` (a `runtime.guards.StepFlags`); else one
        read of the device."""
        self.clear()
        hosts = [None if h is None else HostLayout.of(*h) for h in hosts or [None] * len(batches)]
        if not batches:
            return
        if all(h is not None and tuple(h.shape) == tuple(m.shape) for h, m in zip(hosts, masks, strict=True)):
            layout = host_step_layout(hosts, masks[0].device)
            if flags is not None:
                flags.layout(_mismatch(masks, layout))
        else:
            layout = step_layout(masks)
        self._step = [(self._key(b), m) for b, m in zip(batches, layout.micro, strict=True)]
        self._union = ([self._key(b) for b in batches], layout)

    def layout(self, inputs: dict, mask: Tensor) -> LossLayout:
        """`inputs`' layout: the step's, when they are one of its micro-batches (taken), else measured now."""
        key = self._key(inputs)
        for i, (known, layout) in enumerate(self._step):
            if self._same(known, key):
                del self._step[i]
                return layout
        return loss_layout(mask)

    def step(self, batches: list[dict]) -> StepLayout | None:
        """The step's layout when `batches` are exactly its micro-batches, in order; else None."""
        if self._union is None or len(batches) != len(self._union[0]):
            return None
        keys, layout = self._union
        return layout if all(self._same(k, self._key(b)) for k, b in zip(keys, batches, strict=True)) else None

    def clear(self) -> None:
        self._step, self._union = [], None

    @staticmethod
    def _key(batch: dict) -> dict:
        return {name: batch.get(name) for name in ("input_ids", "labels", "shift_labels")}

    @staticmethod
    def _same(known: dict, key: dict) -> bool:
        def same(a, b):
            if a is None or b is None:
                return a is b
            return a is b or (a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
                              and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype)

        return all(same(known[name], key[name]) for name in known)


def _mismatch(masks: list[Tensor], layout: StepLayout) -> Tensor:
    """``[1]`` float: 1 where the host's indices are not exactly each mask's loss tokens (on the device, no wait)."""
    bad = torch.zeros(1, device=masks[0].device)
    for mask, micro in zip(masks, layout.micro, strict=True):
        kept = mask[:, micro.keep].reshape(-1)
        wrong = (mask.sum() != micro.count) | (mask.any(0).sum() != micro.keep.numel())
        if micro.count:
            wrong = wrong | ~kept[micro.rows].all()
        bad = torch.maximum(bad, wrong.float().reshape(1))
    return bad
