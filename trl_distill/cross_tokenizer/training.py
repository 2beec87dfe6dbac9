"""A teacher with another tokenizer inside `DistillationTrainer`: its columns in the prepared data, its batch, its
forward on its own token ids, and the loss signal over the aligned groups (`data`, `loss`).

The trainer switches to this mode by itself when the teacher's tokenizer maps tokens to other ids than the
student's (`cross_tokenizer=None`), or when told (`cross_tokenizer=True`). Every prepared row gets the teacher's
token ids and, per aligned group, the student position and the teacher position that predict it; rows whose
completion cannot be aligned keep their CE and get no KD, counted and logged. The KD term sums the per-group loss
(`loss.CrossTokenizerLoss`) over the groups, through `losses.fused_loss` like every other teacher signal, and is
normalised like the CE (by the completion-token count).
"""

from __future__ import annotations

import logging
import os

import torch
from accelerate import PartialState
from torch.nn.utils.rnn import pad_sequence

from ..divergences import at_temperature
from ..losses import LossSettings
from .data import align_example
from .loss import CrossTokenizerLoss, divergence_at_temperature
from .vocabulary import shared_vocabulary

logger = logging.getLogger(__name__)

TEACHER_IDS = "teacher_input_ids"
STUDENT_POSITIONS, TEACHER_POSITIONS = "cross_student_positions", "cross_teacher_positions"
COLUMNS = (TEACHER_IDS, STUDENT_POSITIONS, TEACHER_POSITIONS)
_BATCH = "cross_tokenizer_batch"


def load_teacher_tokenizer(args, teacher):
    """The teacher's tokenizer: `teacher_tokenizer_name_or_path`, else the one saved with the teacher; None when
    there is none to load (a model object without a tokenizer path)."""
    from transformers import AutoTokenizer

    path = args.teacher_tokenizer_name_or_path
    if path is None and isinstance(teacher.source, str | os.PathLike):
        try:
            return AutoTokenizer.from_pretrained(teacher.source)
        except (OSError, ValueError):
            return None
    return None if path is None else AutoTokenizer.from_pretrained(path)


def wants_cross_tokenizer(args, student_tokenizer, teacher_tokenizer) -> bool:
    """Whether to distil across tokenizers: as `args.cross_tokenizer` says, else when their vocabularies differ."""
    if args.cross_tokenizer is not None:
        if args.cross_tokenizer and teacher_tokenizer is None:
            raise ValueError("cross_tokenizer=True needs the teacher's tokenizer: set teacher_tokenizer_name_or_path.")
        return args.cross_tokenizer
    return teacher_tokenizer is not None and student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab()


class CrossTokenizer:
    """The cross-tokenizer mode of one trainer."""

    def __init__(self, student_tokenizer, teacher_tokenizer, args):
        self.student_tokenizer, self.teacher_tokenizer, self.args = student_tokenizer, teacher_tokenizer, args
        self.loss = None  # set by `build_loss`, once the models' vocabularies are known
        for name, on in (("teacher_cache", args.teacher_cache), ("lmbda > 0 / seq_kd", args.lmbda > 0 or args.seq_kd),
                         ("packing / padding_free", args.packing or args.padding_free)):
            if on:
                raise ValueError(f"A teacher with another tokenizer (cross-tokenizer distillation) does not support "
                                 f"{name} yet: the teacher reads its own token ids of the dataset's completions.")

    def build_loss(self, student_vocab: int, teacher_vocab: int, settings: LossSettings, announce: bool = True) -> None:
        if len(self.teacher_tokenizer) > teacher_vocab:
            raise ValueError(f"The teacher's tokenizer has {len(self.teacher_tokenizer)} tokens but the teacher's "
                             f"lm_head only {teacher_vocab} rows: that tokenizer is not the teacher's (set "
                             "teacher_tokenizer_name_or_path to the one it was trained with).")
        vocabulary = shared_vocabulary(self.student_tokenizer, self.teacher_tokenizer, student_vocab, teacher_vocab)
        self.loss = CrossTokenizerLoss(vocabulary, settings, self.args.cross_tokenizer_matched_weight,
                                       self.args.cross_tokenizer_uld_weight)
        weights = self.loss.weights
        if announce:  # once per run: the main process says it
            logger.warning("trl_distill: the teacher's tokenizer differs from the student's: cross-tokenizer "
                           "distillation on aligned completion text, %d of the teacher's %d ids shared by bytes "
                           "(weights: matched %.3g, ULD %.3g).", vocabulary.size, teacher_vocab, *weights)

    # ---- Data ----

    def add_columns(self, dataset, name: str):
        """The prepared `dataset` with the teacher's ids and each row's group positions (empty where the row's
        completion cannot be aligned: counted and logged)."""
        if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
            raise ValueError("Cross-tokenizer distillation needs a map-style dataset (not an IterableDataset): every "
                             "row is aligned for the teacher before training.")
        eos = self.student_tokenizer.eos_token
        limit = self.args.max_length

        def columns(example):
            raw = {key: value[: -len(eos)] if key in ("text", "completion") and isinstance(value, str) and eos
                   and value.endswith(eos) else value for key, value in example.items()}  # SFT appended the EOS
            row, prepared = align_example(raw, self.student_tokenizer, self.teacher_tokenizer), example["input_ids"]
            if row is None or row.student_input_ids[: len(prepared)] != list(prepared[: len(row.student_input_ids)]):
                return {TEACHER_IDS: row.teacher_input_ids[:limit] if row else [], STUDENT_POSITIONS: [],
                        TEACHER_POSITIONS: []}
            teacher_ids = row.teacher_input_ids[:limit]
            pairs = [(s, t) for s, t, g in zip(row.student_positions, row.teacher_positions, row.groups, strict=True)
                     if g.student[1] <= len(prepared) and g.teacher[1] <= len(teacher_ids)]  # both sides whole
            return {TEACHER_IDS: teacher_ids, STUDENT_POSITIONS: [s for s, _ in pairs],
                    TEACHER_POSITIONS: [t for _, t in pairs]}

        dataset = dataset.map(columns, num_proc=self.args.dataset_num_proc, desc=f"Aligning {name} for the teacher")
        unaligned = sum(1 for positions in dataset[STUDENT_POSITIONS] if not positions)
        if unaligned and PartialState().is_main_process:
            logger.warning("trl_distill: %d of %d %s rows have no completion text both tokenizers can align; they "
                           "train on CE only.", unaligned, len(dataset), name)
        return dataset

    def collator(self, collator):
        return CrossTokenizerCollator(collator, self.teacher_tokenizer.pad_token_id or 0)

    # ---- The loss ----

    def teacher_rows(self, teacher, batch: tuple, mask: torch.Tensor, keep: torch.Tensor) -> CrossRows:
        """Run the teacher on its own ids (every rank: ZeRO-3 gathers are collective) and lay its states at the
        groups onto the loss's rows (`mask` ``[B, K]`` over the positions `keep`, row-major)."""
        groups = batch[2]
        rows, s_pos, t_pos = (column.contiguous() for column in groups.reshape(-1, 3).unbind(1))
        column = torch.searchsorted(keep, s_pos).clamp(max=max(keep.numel() - 1, 0))
        flat = rows * keep.numel() + column
        # a group counts only where the student has a loss token at its position (never a neighbour's row)
        valid = (keep[column] == s_pos) & mask.flatten()[flat] if keep.numel() else torch.zeros_like(s_pos, dtype=bool)
        rows, t_pos, flat = rows[valid], t_pos[valid], flat[valid]
        keep_t = torch.unique(t_pos)
        features = teacher.features(teacher_inputs(batch), keep_t)
        states = features.states[rows, torch.searchsorted(keep_t, t_pos)]
        index = (mask.flatten().cumsum(0) - 1)[flat]
        n = int(mask.sum())
        laid = states.new_zeros(n, states.shape[-1]).index_copy_(0, index, states)
        is_group = torch.zeros(n, dtype=torch.bool, device=laid.device).index_fill_(0, index, True)
        return CrossRows(laid, is_group, features.head)

    def signal(self, rows: CrossRows, settings: LossSettings) -> CrossTokenizerSignal:
        return CrossTokenizerSignal(rows, self.loss, settings.temperature)


class CrossTokenizerCollator:
    """Wraps the trainer's collator: the teacher's ids, right-padded, and the batch's groups as ``[G, 3]`` (row,
    student position, teacher position), kept together under one key the model never sees."""

    def __init__(self, collator, pad_id: int):
        self.collator, self.pad_id = collator, pad_id

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator([{k: v for k, v in ex.items() if k not in COLUMNS} for ex in examples])
        ids = [torch.tensor(ex[TEACHER_IDS] or [self.pad_id], dtype=torch.long) for ex in examples]
        teacher_ids = pad_sequence(ids, batch_first=True, padding_value=self.pad_id)
        teacher_mask = pad_sequence([torch.ones_like(i) for i in ids], batch_first=True, padding_value=0)
        groups = [(b, s, t) for b, ex in enumerate(examples)
                  for s, t in zip(ex[STUDENT_POSITIONS], ex[TEACHER_POSITIONS], strict=True)]
        batch[_BATCH] = (teacher_ids, teacher_mask, torch.tensor(groups, dtype=torch.long).reshape(-1, 3))
        return batch


class CrossRows:
    """The teacher's last hidden states (or own logits, on the exact path) laid onto the loss's rows; zeros, and
    ``is_group`` False, on rows no group starts at."""

    def __init__(self, states: torch.Tensor, is_group: torch.Tensor, head):
        self.states, self.is_group, self.head = states, is_group, head


class CrossTokenizerSignal:
    """The teacher side of `losses.fused_loss` across tokenizers: per chunk of rows, the teacher's logits at the
    temperature, and the per-group loss against the student's log-probs (0 on rows that start no group)."""

    closed_form = False

    def __init__(self, rows: CrossRows, loss: CrossTokenizerLoss, temperature: float):
        self.rows, self.loss, self.temperature = rows, loss, temperature

    def chunk(self, rows: slice, compute: torch.dtype):
        states = self.rows.states[rows]
        logits = states if self.rows.head is None else self.rows.head.logits(states)
        return self.rows.is_group[rows], at_temperature(logits.detach().to(compute), self.temperature)

    def per_token(self, student_logp: torch.Tensor, chunk, settings: LossSettings) -> torch.Tensor:
        is_group, teacher_scaled = chunk
        matched, uld = divergence_at_temperature(student_logp, teacher_scaled, self.loss.vocabulary, settings)
        return torch.where(is_group, self.loss.combine(matched, uld), 0.0)


def pop_cross_batch(inputs: dict) -> tuple | None:
    """Remove the teacher's ids and the groups from a batch (the student must not see them); None without."""
    return inputs.pop(_BATCH, None)


def teacher_inputs(batch: tuple) -> dict:
    """The teacher's own model inputs from a popped cross-tokenizer batch."""
    return {"input_ids": batch[0], "attention_mask": batch[1]}
