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


class Held:
    """A value a batch carries past the Trainer's `_prepare_inputs` untouched: it casts float tensors to the DeepSpeed
    dtype and moves the others (the engine's log-probs of sampled tokens, a task's columns and rewards, teacher
    prompts)."""

    def __init__(self, value):
        self.value = value


class SignalHolder:
    """The rows' `SparseTeacherSignal`, or a future of it. An opaque object on purpose: the Trainer's
    `_prepare_inputs` would cast float tensors to the DeepSpeed dtype (bf16), and it cannot rebuild a NamedTuple
    (transformers 5.24)."""

    def __init__(self, signal: SparseTeacherSignal | Future | None, build=None, error: Exception | None = None):
        self._signal, self._build, self.error = signal, build, error

    @property
    def signal(self) -> SparseTeacherSignal:
        """The signal; waits for it when it is still being fetched (the fetch itself has a timeout). A future's
        result goes through `build` first, on the thread reading it (a served teacher's numpy arrays). A fetch
        that failed (`error`) raises its error here, where the loss reads it."""
        if self.error is not None:
            raise self.error
        if isinstance(self._signal, Future):
            result = self._signal.result()
            self._signal = result if self._build is None else self._build(result)
        return self._signal

    def __getstate__(self):
        """Sequence parallelism sends each batch to every rank of its group (`UlyssesSPDataLoaderAdapter` pickles
        what is not a tensor): a signal still being fetched is waited for first, and a fetch that failed travels as
        its error (raising it here would fail the pickling: in a DataLoader worker's queue that is a lost batch, and
        a hang)."""
        state = dict(self.__dict__)
        if isinstance(self._signal, Future):
            from ..errors import ExternalError

            try:
                state["_signal"] = self.signal
            except ExternalError as error:
                state["_signal"], state["error"] = None, error
            state["_build"] = None
        return state


def pop_signal(inputs: dict, key: str = SIGNAL) -> SparseTeacherSignal | None:
    """Remove the teacher signal (under `key`: one per teacher when several teach) from a batch (the model must not
    see it), on the batch's device; None for a batch without one."""
    holder = inputs.pop(key, None)
    if holder is None:
        return None
    device = inputs["input_ids"].device
    signal = holder.signal
    if getattr(holder, "labels", None) is not None:  # sequence parallelism: this rank's positions only
        signal = shard_signal(holder, signal, inputs["input_ids"].shape[1])
    return SparseTeacherSignal(*(t.to(device, non_blocking=True) for t in signal))


class PositionIdsCollator:
    """Wraps a collator for sequence parallelism: every batch is padded on the right to a multiple of the
    sequence-parallel size (each rank takes an equal share of positions; the pad is masked out and learns nothing),
    gets `position_ids` (the Ulysses loader needs them to shard rows and attention to mask causally), and a teacher
    signal of whole rows remembers their labels, so each rank can take its positions' part (`shard_signal`)."""

    def __init__(self, collator, multiple: int = 1):
        self.collator = collator
        self.multiple = multiple

    def __call__(self, examples):
        batch = self.collator(examples)
        if "position_ids" not in batch:
            rows, width = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(width).expand(rows, width).clone()
        pad_to_multiple(batch, self.multiple, getattr(self.collator, "pad_token_id", None) or 0)
        for value in batch.values():
            if isinstance(value, SignalHolder):
                value.labels = batch["labels"]
        return batch

    def __getattr__(self, name):  # the wrapped collator's attributes (e.g. `padding_free`)
        if name == "collator":  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.collator, name)


def pad_to_multiple(batch: dict, multiple: int, pad_token_id: int) -> None:
    """Pad every ``[rows, width]`` tensor of `batch` on the right to a width that is a multiple of `multiple`:
    `input_ids` with `pad_token_id`, `labels` with -100 (no loss), `position_ids` counting on, the rest (attention
    and completion masks) with 0."""
    width = batch["input_ids"].shape[1]
    extra = -width % multiple
    if not extra:
        return
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == width):
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype)
            batch[key] = torch.cat([value, tail], dim=1)
            continue
        fill = pad_token_id if key == "input_ids" else -100 if key == "labels" else 0
        batch[key] = torch.nn.functional.pad(value, (0, extra), value=fill)


def shard_signal(holder: SignalHolder, signal, local_width: int, rank: int | None = None):
    """This rank's part of `signal`, computed for the whole rows of `holder.labels` ``[B, T]``: the loss tokens of
    its shard of positions, in the same (row, position) order. The signal as it is for a holder of unsplit rows."""
    labels = getattr(holder, "labels", None)
    if labels is None or labels.shape[1] == local_width:
        return signal
    if rank is None:  # this rank's place in its sequence-parallel group
        from ..model.sharded_attention import sp_group_and_rank

        _, _, rank = sp_group_and_rank()
    mask = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False)  # the loader's shift_labels
    index = torch.full(mask.shape, -1, dtype=torch.long)
    index[mask] = torch.arange(int(mask.sum()))
    start = rank * local_width
    pick = index[:, start:start + local_width]
    pick = pick[pick >= 0].to(signal[0].device)
    return type(signal)(*(t.index_select(0, pick) for t in signal))
