"""A teacher read from a cache written by `trl-distill cache-teacher`: no teacher model in the job; each batch gets
its rows' top-k from the cache as it is collated, and the loss runs on that sparse signal (`loss.sparse`)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..cache.reader import TeacherCache
from ..data.batch import SIGNAL, SignalHolder, pop_signal, put_signal
from .base import TeacherSource
from .capabilities import OwnBatch, TrainRows
from .rows import SparseRows
from .support import TEACHER_PROMPT_REFUSAL

logger = logging.getLogger(__name__)

ROW = "teacher_cache_row"  # the column added to the prepared train dataset: the row's index in the cache


ON_POLICY_REFUSAL = ("A teacher cache holds the teacher's distribution on the dataset's completions only; on-policy "
                     "(lmbda > 0) and sequence-level (seq_kd) distillation need the live teacher. Drop --teacher_cache "
                     "or set lmbda=0 and seq_kd=False.")


class CachedTeacher(TeacherSource, TrainRows, OwnBatch):
    """The teacher cache at `directory` as the source of each batch's teacher signal."""

    row_column, signal_key = ROW, SIGNAL  # its dataset column and batch key (one per teacher when several teach)
    name = None  # what the run record holds: no teacher model
    refused = {
        "on-policy": ON_POLICY_REFUSAL,
        "sampled-token": ON_POLICY_REFUSAL,  # (on the student's own samples: lmbda 1)
        "teacher-prompt": TEACHER_PROMPT_REFUSAL,
        "packing": "Training from a teacher cache does not support packing / padding_free yet: the cache holds one "
        "row per unpacked example. Set packing=False and padding_free=False.",
        "eval": "Evaluation needs the teacher's distribution on the eval split, which the teacher cache does not hold: "
        "pass no eval_dataset (--eval_strategy no) with teacher_cache.",
        "cross-tokenizer": "A teacher cache holds the teacher's top-k in the student's token ids: a teacher with "
        "another tokenizer needs the live teacher (--teacher_model_name_or_path). Drop --teacher_cache, or drop "
        "teacher_tokenizer_name_or_path and cross_tokenizer.",
    }

    def __init__(self, directory: str):
        self.cache = TeacherCache(directory)

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.row_column,)

    def describe(self) -> str:
        return f"the teacher cache {self.cache.directory}"

    def train_rows(self, dataset):
        """Check the cache fits the prepared train dataset and number its rows (its collator adds their signal)."""
        run = self.context
        if not hasattr(dataset, "add_column") or "labels" not in dataset.column_names:
            raise ValueError("Training from a teacher cache needs a prepared (map-style) train dataset with `labels`, "
                             "as SFT's dataset preparation makes it (not an IterableDataset or skip_prepare_dataset).")
        # (the temperature as the loss reads it: from the run's arguments, live)
        self.cache.check_fits(run.processing_class, run.vocab_size, run.args.temperature,
                              run.plan.teacher_settings.max_length, dataset)
        return dataset.add_column(self.row_column, np.arange(len(dataset), dtype=np.int64))

    def collator(self, base) -> CachedTeacherCollator:
        return CachedTeacherCollator(base, self.cache, self.row_column, self.signal_key)

    def pop_batch(self, inputs: dict):
        return pop_signal(inputs, self.signal_key)

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> SparseRows:
        return SparseRows(extras)


class CachedTeacherCollator:
    """Wraps the trainer's collator: pops each example's cache row and adds the rows' signal to the batch."""

    def __init__(self, collator, cache: TeacherCache, column: str = ROW, key: str = SIGNAL):
        self.collator, self.cache, self.column, self.key = collator, cache, column, key

    def __call__(self, examples: list[dict]) -> dict:
        rows = [int(example[self.column]) for example in examples]
        batch = self.collator([{k: v for k, v in example.items() if k != self.column} for example in examples])
        put_signal(batch, self.key, SignalHolder(self.cache.signal(rows)))
        return batch
