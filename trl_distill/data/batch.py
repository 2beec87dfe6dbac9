"""What a collated batch carries besides the model's inputs: its loss tokens (`loss_tokens`), and one
`MicroBatchExtras` under `EXTRAS`: what the collators and the sampler add for the loss (a teacher's sparse signal,
the rows' teachers, teacher prompts, the cross-tokenizer teacher's ids, the rollout engine's log-probs, a task's
columns and rewards, the host labels), none of which the model sees.

The teacher cache reads its rows' signal in the collator; a served teacher's collator sends a request and leaves a
future in the batch, so the answer arrives while the student computes earlier micro-batches. Either way the extras
hold a `SignalHolder` under the teacher's key (`put_signal`), and the loss calls `pop_signal`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..loss.sparse import SparseTeacherSignal

SIGNAL = "teacher_signal"  # a teacher's key among the extras' signals (one per teacher when several teach)
EXTRAS = "micro_batch_extras"  # the batch key of the `MicroBatchExtras`: the one key besides the model's inputs


class CrossTokenizerBatch(NamedTuple):
    """What the cross-tokenizer teacher reads of a batch (`teacher.cross_tokenizer.cross_batch`)."""

    teacher_ids: torch.Tensor  # [B, L], right-padded
    teacher_mask: torch.Tensor  # [B, L]
    groups: torch.Tensor  # [G, 3]: (row, student position, teacher position)
    prompts: list[list[int]]  # the teacher's prompt tokens of each row
    group_lengths: torch.Tensor | None  # [G, 2]: each group's student and teacher token counts (sampled rows)

    def to(self, device) -> CrossTokenizerBatch:
        """Its tensors on `device`."""
        return CrossTokenizerBatch(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in self))


@dataclass(frozen=True)
class MicroBatchExtras:
    """Everything a micro-batch carries for the loss besides the model's inputs and labels. A plain object on
    purpose: the Trainer's `_prepare_inputs` and accelerate's loader leave it as it is (no cast to bf16, no move).
    Frozen: `add_extras` and `pop_extra` replace it, so a copy of a batch dict keeps its own extras, as it kept its
    own keys."""

    signals: Mapping[str, SignalHolder] = field(default_factory=dict)  # teacher key -> its rows' sparse signal
    route: torch.Tensor | None = None  # [B] each row's teacher, by its index in the panel
    teacher_prompts: list[torch.Tensor] | None = None  # each row's teacher prompt, tokenized (on the host)
    cross_tokenizer: CrossTokenizerBatch | None = None  # the cross-tokenizer teacher's ids and aligned groups
    rollout_logprobs: torch.Tensor | None = None  # the rollout engine's log-prob of every sampled token, row-major
    task_columns: dict[str, list] | None = None  # the rows' own columns, for the task reward
    task_rewards: torch.Tensor | None = None  # each sampled completion's task reward
    loss_layout: tuple[str, torch.Tensor] | None = None  # (labels key, the host labels) from `LossTokensCollator`

    def empty(self) -> bool:
        """Whether no field is set (no signal, every other field None)."""
        return all(not getattr(self, f.name) if f.name == "signals" else getattr(self, f.name) is None
                   for f in dataclasses.fields(self))


_FIELDS = {f.name for f in dataclasses.fields(MicroBatchExtras)}


def extras_of(batch: dict) -> MicroBatchExtras:
    """The batch's extras (empty ones when it carries none)."""
    return batch.get(EXTRAS) or MicroBatchExtras()


def add_extras(batch: dict, **values) -> None:
    """Set fields of `batch`'s extras (each collator that wraps another adds to the same one)."""
    batch[EXTRAS] = dataclasses.replace(extras_of(batch), **values)


def pop_extra(batch: dict, name: str):
    """Take field `name` off `batch`'s extras (None when unset); the key goes once nothing is left."""
    if name not in _FIELDS:
        raise KeyError(name)
    extras = batch.get(EXTRAS)
    if extras is None:
        return None
    value = getattr(extras, name)
    _keep(batch, dataclasses.replace(extras, **{name: {} if name == "signals" else None}))
    return value


def drop_extras(batch: dict, *names: str) -> dict:
    """A copy of `batch` whose extras lack the fields `names` (`batch` itself keeps them)."""
    out = dict(batch)
    for name in names:
        pop_extra(out, name)
    return out


def merge_extras(batch: dict, extras: MicroBatchExtras | None) -> None:
    """Add the set fields of `extras` (its signals among the batch's) to `batch`'s extras."""
    if extras is None:
        return
    signals = {**extras_of(batch).signals, **extras.signals}
    values = {f: getattr(extras, f) for f in _FIELDS - {"signals"} if getattr(extras, f) is not None}
    add_extras(batch, signals=signals, **values)


def put_signal(batch: dict, key: str, holder: SignalHolder) -> None:
    """Add a teacher's signal (`key`: its own when several teach) to `batch`."""
    add_extras(batch, signals={**extras_of(batch).signals, key: holder})


def take_signal(batch: dict, key: str = SIGNAL) -> SignalHolder | None:
    """Take the teacher `key`'s `SignalHolder` off `batch` (None without)."""
    extras = batch.get(EXTRAS)
    if extras is None or key not in extras.signals:
        return None
    holder = extras.signals[key]
    _keep(batch, dataclasses.replace(extras, signals={k: v for k, v in extras.signals.items() if k != key}))
    return holder


def _keep(batch: dict, extras: MicroBatchExtras) -> None:
    """`extras` as `batch`'s, or no key when they are empty (what the model would otherwise be given)."""
    if extras.empty():
        batch.pop(EXTRAS, None)
    else:
        batch[EXTRAS] = extras


def loss_tokens(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, mask)`` ``[B, T']``: the token each position predicts (the shifted labels) and where it is a loss
    token. Position t predicts ``target[:, t]``. The one definition training, the step pass and the caches use."""
    target = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
    return target, target != -100


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
    holder = take_signal(inputs, key)
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
        for holder in extras_of(batch).signals.values():
            holder.labels = batch["labels"]
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
