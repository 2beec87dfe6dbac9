"""A teacher that sees more than the student (`teacher_prompt`): the teacher reads its own prompt (a dataset column,
or a template of the row's columns: the golden answer, a teacher-only system prompt) in place of the student's, and
both score the same completion.

`PrivilegedTeacher` wraps a live or served teacher. Each row's teacher prompt is tokenized as the data is prepared
(a string as SFT tokenizes a prompt, a list of messages with the chat template and its generation prompt); for every
batch, its teacher rows are the teacher prompt followed by the student row's completion tokens (the dataset's, or
the student's own samples on-policy). Completion token j sits at ``P_s + j`` in the student's row and ``P_t + j``
in the teacher's, so a loss position t of the student (predicting token t + 1) is ``t − P_s + P_t`` in the
teacher's; both take their loss rows row by row, in position order, so the n rows pair up one to one.
"""

from __future__ import annotations

import torch

from ..data.batch import EXTRAS, add_extras, extras_of, merge_extras, pop_extra
from ..runtime.sequence_parallel import sequence_parallel_size
from .base import TeacherBatch, TeacherSource
from .capabilities import (
    LogitChecked,
    OwnBatch,
    PreparesDataset,
    RoutesRows,
    ScoresSamples,
    StepHooks,
    TrainRows,
    WritesCache,
    columns_of,
    popped,
    routed_rows,
)
from .teacher_prompts import FLAG, check_teacher_prompts, prompt_problem, splits, template_fields, template_values

TEACHER_PROMPT = "teacher_prompt_ids"  # the prepared column: each row's teacher prompt, tokenized


def check_teacher_prompt_args(args) -> None:
    """What `teacher_prompt` cannot combine with, one line each as the config is built."""
    if args.teacher_prompt is None:
        return
    template_fields(args.teacher_prompt)  # a malformed template: one line now, before anything loads
    refusals = [
        (args.packing or args.padding_free, "rows cannot be packed: set packing=False and padding_free=False"),
        (args.teachers is not None, "it takes one teacher (several teachers with their own prompts are not "
                                    "supported yet): pass one with --teacher_model_name_or_path or --teacher_server"),
        (args.seq_kd, "seq_kd would sample from the teacher's prompts: set seq_kd=False"),
        (sequence_parallel_size(args) > 1, "rows are split over ranks under sequence parallelism: set "
                                           "sequence_parallel_size=1"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"teacher_prompt gives the teacher its own prompt in place of each row's, and {why}.")


def teacher_prompt_of(spec: str, row: dict, split: str, index: int):
    """Row `index`'s teacher prompt: its column `spec`, or the template `spec` filled with its columns (the raw rows
    were checked by `teacher_prompts.check_teacher_prompts`; a column SFT's preparation dropped is one line here)."""
    fields = template_fields(spec)
    missing = [name for name in ([spec] if fields is None else fields) if name not in row]
    if missing:
        raise ValueError(f"{FLAG} {spec!r} reads {missing}, which row {index} of the prepared {split} dataset does "
                         f"not have ({', '.join(row)}): use prompt-completion rows that keep it.")
    return row[spec] if fields is None else spec.format(**template_values({name: row[name] for name in fields}))


def as_written(row: dict, eos: str | None) -> dict:
    """A prepared row's values as the dataset holds them: SFT appends the student's EOS text to each `completion` (and
    `text`) string of rows that are not conversations, and a template quoting it would put an end of text in the
    middle of the teacher's prompt (a teacher of another tokenizer reads the row without it too)."""
    return {key: value[: -len(eos)] if key in ("completion", "text") and isinstance(value, str) and eos
            and value.endswith(eos) else value for key, value in row.items()}


def prompt_tokens(tokenizer, prompt) -> list[int]:
    """`prompt` as the teacher reads it before a completion: a string as SFT tokenizes a prompt, a list of messages
    with the chat template and its generation prompt."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return tokenizer(text=prompt)["input_ids"]


def several_stretches(mask) -> bool:
    """Whether a prepared row's completion mask has loss tokens in more than one stretch."""
    mask = list(mask or ())
    return 1 in mask and 0 in mask[mask.index(1):]


def stretched(row: str) -> str:
    return (f"teacher_prompt replaces each row's prompt, so each row's loss must be its one completion to the end; "
            f"{row} has loss tokens in several stretches (a conversation with several assistant turns): use "
            "prompt-completion rows.")


class StreamedPrompts:
    """The teacher prompt ids of a streamed dataset's rows (`IterableDataset.map`, with indices), each checked as it
    is read, as `check_teacher_prompts`, `prepare_dataset` and `train_rows` check a map-style dataset's rows ahead:
    the same one line, naming the row of the stream."""

    def __init__(self, spec: str, tokenizer, split: str):
        self.spec, self.tokenizer, self.split = spec, tokenizer, split
        self.fields = template_fields(spec)
        self.empty_has_tokens = bool(prompt_tokens(tokenizer, ""))

    def __call__(self, row: dict, index: int) -> dict:
        wanted = [self.spec] if self.fields is None else self.fields
        if any(name not in row for name in wanted):  # a column SFT's preparation dropped: one line
            teacher_prompt_of(self.spec, row, f"streamed {self.split}", index)
        mask, row = row.get("completion_mask"), as_written(row, self.tokenizer.eos_token)
        why = prompt_problem(self.spec, self.fields, {name: row[name] for name in wanted}, self.empty_has_tokens)
        ids = None
        if why is None:
            ids = prompt_tokens(self.tokenizer, teacher_prompt_of(self.spec, row, self.split, index))
            if not ids:
                why = ("gives a teacher prompt of no token, so the teacher has none before the completion to predict "
                       "its first token from: give it some text")
        where = f"row {index} of the streamed {self.split} dataset"
        if why is not None:
            raise ValueError(f"{FLAG} {self.spec!r}: {where} {why}.")
        if self.split == "train" and several_stretches(mask):
            raise ValueError(stretched(where))
        return {TEACHER_PROMPT: ids}


class PrivilegedTeacher(TeacherSource, RoutesRows, PreparesDataset, TrainRows, OwnBatch, StepHooks, LogitChecked,
                        ScoresSamples):
    """`inner` (a live or served teacher) reading `spec` (a column name, or a ``{column}`` template) as its prompt.

    It has every capability of `inner` (its engine, its vocabulary...), handed through untouched, but those it
    `changes` (run on the teacher's rows) and those it `withholds`; and it `adds` its own (the teacher prompts)."""

    adds = (RoutesRows, PreparesDataset, TrainRows, OwnBatch)
    changes = (StepHooks, LogitChecked, ScoresSamples)  # (where `inner` has them)
    withholds = (WritesCache,)  # a cache of `inner` would hold its reading of the student's prompts

    def __init__(self, inner: TeacherSource, spec: str, tokenizer):
        self.inner, self.spec, self.tokenizer = inner, spec, tokenizer
        self.refused = inner.refused

    def capability(self, capability):
        if capability in self.withholds:
            return None
        if capability in self.adds:
            return self
        inner = self.inner.capability(capability)
        if capability in self.changes:
            return None if inner is None else self
        return inner

    @property
    def columns(self) -> tuple[str, ...]:
        return (*columns_of(self.inner), TEACHER_PROMPT)

    @property
    def name(self) -> str:
        return f"{self.inner.name} (teacher_prompt {self.spec})"

    def describe(self) -> str:
        return f"{self.inner.describe()} reading teacher_prompt {self.spec!r}"

    # ---- The teacher's prompt of each row ----

    def prompt_of(self, row: dict, split: str, index: int):
        """Row `index`'s teacher prompt, read from the row as the dataset holds it (`as_written`)."""
        return teacher_prompt_of(self.spec, as_written(row, self.tokenizer.eos_token), split, index)

    def route_rows(self, train_dataset, eval_dataset):
        """Every raw row has a teacher prompt of at least one token, checked before anything loads."""
        for split, dataset in splits(train_dataset, eval_dataset):
            check_teacher_prompts(self.spec, dataset, split, lambda prompt: prompt_tokens(self.tokenizer, prompt))
        return routed_rows(self.inner, train_dataset, eval_dataset)

    def prepare_dataset(self, dataset, name: str):
        inner = self.inner.capability(PreparesDataset)
        dataset = dataset if inner is None else inner.prepare_dataset(dataset, name)
        if hasattr(dataset, "map") and not hasattr(dataset, "__len__"):  # a `datasets.IterableDataset` (streaming):
            # each row's as it is read, never the whole stream ahead
            return dataset.map(StreamedPrompts(self.spec, self.tokenizer, name), with_indices=True)
        if not hasattr(dataset, "add_column"):
            return dataset
        ids = [prompt_tokens(self.tokenizer, self.prompt_of(row, name, i)) for i, row in enumerate(dataset)]
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:  # (the raw rows were checked; a prompt whose text tokenizes to nothing)
            raise ValueError(f"{FLAG} {self.spec!r}: the teacher prompt of row {empty[0]} of the prepared {name} "
                             f"dataset ({len(empty)} of {len(ids)} rows) has no token, so the teacher has none before "
                             "the completion to predict its first token from: give it some text.")
        return dataset.add_column(TEACHER_PROMPT, ids)

    def train_rows(self, dataset):
        """Each prepared row's loss must be its whole completion (prompt-completion rows, unpacked). (A stream's rows
        are checked as they are read: `StreamedPrompts`.)"""
        if "completion_mask" in (getattr(dataset, "column_names", None) or ()):
            for i, mask in enumerate(dataset["completion_mask"]):
                if several_stretches(mask):
                    raise ValueError(stretched(f"row {i}"))
        inner = self.inner.capability(TrainRows)
        return dataset if inner is None else inner.train_rows(dataset)

    # ---- Once the trainer exists ----

    def attach(self, context) -> None:
        super().attach(context)
        self.inner.attach(context)

    def collator(self, base):
        """`base`, and each batch's teacher prompts (in place of the inner teacher's own collator: a served teacher
        is asked for its signal of the teacher's rows)."""

        def collate(examples: list[dict]) -> dict:
            prompts = [torch.tensor(example[TEACHER_PROMPT], dtype=torch.long) for example in examples]
            batch = base([{k: v for k, v in example.items() if k != TEACHER_PROMPT} for example in examples])
            add_extras(batch, teacher_prompts=prompts)
            self._score(batch)  # a served teacher's request, on the teacher's rows
            return batch

        return collate

    def _score(self, batch: dict, source: dict | None = None) -> None:
        """The inner teacher's additions (a server's signal) for `batch`'s teacher rows, added to `batch`."""
        scorer = self.inner.capability(ScoresSamples)
        if scorer is None:
            return
        view = teacher_rows(batch, extras_of(batch).teacher_prompts, self._pad_id())
        before = set(view)
        scorer.score_sampled(view, source)
        merge_extras(batch, view.pop(EXTRAS, None))
        for key in set(view) - before:
            batch[key] = view[key]

    def _pad_id(self) -> int:
        return getattr(self.tokenizer, "pad_token_id", None) or 0

    def prepare(self, accelerator, device: torch.device) -> None:
        self.inner.prepare(accelerator, device)

    def logit_candidates(self, model_inputs: dict, extras) -> list:
        inner = self.inner.capability(LogitChecked)
        return inner.logit_candidates(model_inputs, None if extras is None else extras[-1])

    def before_step(self, batch_samples: list[dict]) -> None:
        """None: the inner teacher runs per micro-batch, on the teacher's rows (not the student's, which the step's
        batches hold)."""

    def pop_batch(self, inputs: dict):
        prompts = pop_extra(inputs, "teacher_prompts")
        return prompts, completion_starts(inputs["labels"]), popped(self.inner, inputs)

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> TeacherBatch:
        prompts, starts, own = extras
        view = teacher_rows(model_inputs, prompts, self._pad_id(), starts)
        teacher_mask = torch.zeros_like(view["input_ids"], dtype=torch.bool)
        rows = [keep[mask[b]] - starts[b] + len(prompts[b]) for b in range(mask.shape[0])]
        every = torch.cat(rows)
        low, high = torch.stack(torch.aminmax(every)).tolist() if every.numel() else (0, 0)  # one read of the device
        if low < 0 or high >= teacher_mask.shape[1]:  # a negative one would wrap: the teacher's next token paired
            raise ValueError(f"{FLAG} {self.spec!r}: a row's teacher prompt has no token before its completion "
                             "(the teacher cannot predict the completion's first token): give it some text.")
        for b, positions in enumerate(rows):
            teacher_mask[b, positions.to(teacher_mask.device)] = True
        teacher_keep = teacher_mask.any(0).nonzero().squeeze(1)
        teacher_mask = teacher_mask[:, teacher_keep]
        inputs = {k: v for k, v in view.items() if k != "labels"}
        return ShiftedBatch(self.inner.for_batch(inputs, own, teacher_mask, teacher_keep), teacher_mask)

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """The student's samples of the prompts of `source`: each keeps its row's teacher prompt."""
        add_extras(batch, teacher_prompts=extras_of(source).teacher_prompts)
        self._score(batch, source)

    def after_loss(self) -> None:
        self.inner.capability(StepHooks).after_loss()

    def release(self) -> None:
        self.inner.release()


class ShiftedBatch(TeacherBatch):
    """The inner teacher's batch over its own rows: its loss rows are its `mask`'s, in the student's row order."""

    def __init__(self, inner: TeacherBatch, mask: torch.Tensor):
        self.inner, self.mask = inner, mask

    @property
    def heads(self) -> tuple:
        return self.inner.heads

    def signal(self, rows, n: int, settings, picks=None):
        return self.inner.signal(self.mask.reshape(-1).nonzero().squeeze(1), n, settings)


def completion_starts(labels: torch.Tensor) -> list[int]:
    """Each row's first completion token: its first label (``labels`` ``[B, T]``, unshifted); a row without one: the
    width. (Not one past its first loss position: a completion at position 0, after an empty prompt, is no loss
    target of the student's, yet the teacher must read it.)"""
    has = labels != -100
    return torch.where(has.any(1), has.int().argmax(1), labels.shape[1]).tolist()  # one read of the device


def teacher_rows(batch: dict, prompts: list[torch.Tensor], pad_id: int, starts: list[int] | None = None) -> dict:
    """The teacher's rows of `batch`: each row's teacher prompt, then the row's completion tokens (from its first
    completion token, `starts` or its first label, to its last attended one), right-padded; labels on the
    completion."""
    ids, attention = batch["input_ids"], batch.get("attention_mask")
    if starts is None:
        starts = completion_starts(batch["labels"])
    rows, lengths = [], []
    for b in range(ids.shape[0]):
        end = ids.shape[1] if attention is None else int(attention[b].sum())
        completion = ids[b, starts[b]:end]
        rows.append(torch.cat([prompts[b].to(ids.device), completion]))
        lengths.append(len(prompts[b]))
    width = max(len(r) for r in rows)
    out_ids = torch.full((len(rows), width), pad_id, dtype=ids.dtype, device=ids.device)
    out_mask = torch.zeros_like(out_ids)
    out_labels = torch.full_like(out_ids, -100)
    for b, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        out_ids[b, :len(row)], out_mask[b, :len(row)] = row, 1
        out_labels[b, length:len(row)] = row[length:]
    return {"input_ids": out_ids, "attention_mask": out_mask, "labels": out_labels}
