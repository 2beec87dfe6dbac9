"""A teacher with another tokenizer: its columns in the prepared data, its batch, its forward on its own token ids,
and the loss signal over the aligned groups (`trl_distill.cross_tokenizer`'s `data` and `loss`).

`resolve.resolve_teacher` picks this kind by itself when the teacher's tokenizer maps tokens to other ids than the
student's (`cross_tokenizer=None`), or when told (`cross_tokenizer=True`). Every prepared row gets the teacher's
token ids and, per aligned group, the student position and the teacher position that predict it; rows whose
completion cannot be aligned keep their CE and get no KD, counted and logged. The KD term sums the per-group loss
(`CrossTokenizerLoss`) over the groups, through `loss.fused.fused_loss` like every other teacher signal, and is
normalised like the CE (by the completion-token count).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch.nn.utils.rnn import pad_sequence

from ..cross_tokenizer.data import align_example, teacher_prompt_ids
from ..cross_tokenizer.loss import CrossTokenizerLoss, divergence_at_temperature
from ..cross_tokenizer.sampled import align_sampled
from ..cross_tokenizer.vocabulary import shared_vocabulary
from ..data.batch import CrossTokenizerBatch, add_extras, extras_of, pop_extra
from ..loss.diagnostics import LossDiagnostics, observe_groups
from ..loss.divergences import at_temperature
from ..loss.settings import LossSettings
from ..loss.signal import TeacherSignal
from ..runtime.guards import check_teacher_finite
from .base import TeacherBatch
from .capabilities import OwnBatch, PreparesDataset, RoutesRows, StudentTokenizer, WritesCache, unrouted
from .live import LiveTeacher
from .privileged import prompt_tokens, teacher_prompt_of
from .settings import TeacherSettings
from .teacher_prompts import check_teacher_prompts, splits

logger = logging.getLogger(__name__)

TEACHER_IDS, TEACHER_PROMPT = "teacher_input_ids", "teacher_prompt_ids"
STUDENT_POSITIONS, TEACHER_POSITIONS = "cross_student_positions", "cross_teacher_positions"
COLUMNS = (TEACHER_IDS, STUDENT_POSITIONS, TEACHER_POSITIONS, TEACHER_PROMPT)
GROUP_LENGTHS = "cross_group_lengths"  # sampled rows only: each group's student and teacher token counts


_REFUSAL = ("A teacher with another tokenizer (cross-tokenizer distillation) does not support {} yet: the teacher "
            "reads its own token ids of the dataset's completions.")


class CrossTokenizerTeacher(LiveTeacher, RoutesRows, PreparesDataset, OwnBatch, StudentTokenizer):
    """A live teacher with another tokenizer: it reads its own token ids of each row, and the loss compares the two
    models on the aligned groups (`cross_tokenizer.loss.CrossTokenizerLoss`). Runs once per micro-batch."""

    columns = COLUMNS
    refused = {
        "packing": _REFUSAL.format("packing / padding_free"),
        WritesCache: "`trl-distill cache-teacher` writes the teacher's top-k in the student's token ids; this teacher "
        "has another tokenizer. Train with it live (cross-tokenizer distillation).",
    }
    routes_own_rows = False  # its own ids come with the whole batch (routed, the loss picks its rows)

    def __init__(self, source, init_kwargs: dict | None, student_tokenizer, teacher_tokenizer,
                 settings: TeacherSettings):
        super().__init__(source, init_kwargs)
        self.student_tokenizer, self.teacher_tokenizer, self.settings = student_tokenizer, teacher_tokenizer, settings
        self.loss = None  # set as it attaches, once the models' vocabularies are known
        self.sampled_rows = {"rows": 0, "unaligned": 0}  # sampled completions scored, and those with no group

    @classmethod
    def refuse(cls, settings: TeacherSettings, *, eval_dataset=None, peft: bool = False) -> None:
        super().refuse(settings, eval_dataset=eval_dataset, peft=peft)
        if settings.seq_kd:
            raise ValueError("A teacher with another tokenizer (cross-tokenizer distillation) does not support seq_kd "
                             "yet: it would sample in its own tokens. Set seq_kd=False (on-policy lmbda > 0 works: "
                             "the student's samples are re-rendered for the teacher).")

    def capability(self, capability):
        """A live teacher's, but no cache: a cache holds the top-k in the student's ids (see `refused`)."""
        return None if capability is WritesCache else super().capability(capability)

    def vocab_config(self, student_config):
        return student_config  # the student's own vocabulary: the teacher's is mapped onto it by bytes

    def attach(self, context) -> None:
        """Build the loss on the shared vocabulary (its collator adds the teacher's ids and the groups). The
        tokenizers differ by design: no id-by-id match is asked (`self.tokenizer` stays None)."""
        super().attach(context)
        self.build_loss(context.vocab_size, self.config.get_text_config().vocab_size,
                        replace(context.plan.loss, vocab_size=context.vocab_size),
                        announce=context.accelerator.is_main_process)

    def collator(self, base) -> CrossTokenizerCollator:
        return CrossTokenizerCollator(base, self.teacher_tokenizer.pad_token_id or 0)

    def before_step(self, batch_samples: list[dict]) -> None:
        """None: the teacher reads its own ids, per micro-batch."""

    def pop_batch(self, inputs: dict):
        return pop_cross_batch(inputs)

    def logit_candidates(self, model_inputs: dict, extras) -> list[tuple[str, object, object, dict]]:
        return [(self.label, self.engine, self.module, teacher_inputs(extras))]  # on its own tokens

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> CrossRows:
        rows = self.teacher_rows(extras, mask, keep)
        check_teacher_finite(rows.states, self.context.accelerator, f"step {self.context.step + 1}")
        return rows

    def build_loss(self, student_vocab: int, teacher_vocab: int, settings: LossSettings, announce: bool = True) -> None:
        if len(self.teacher_tokenizer) > teacher_vocab:
            raise ValueError(f"The teacher's tokenizer has {len(self.teacher_tokenizer)} tokens but the teacher's "
                             f"lm_head only {teacher_vocab} rows: that tokenizer is not the teacher's (set "
                             "teacher_tokenizer_name_or_path to the one it was trained with).")
        vocabulary = shared_vocabulary(self.student_tokenizer, self.teacher_tokenizer, student_vocab, teacher_vocab)
        self.loss = CrossTokenizerLoss(vocabulary, settings, self.settings.matched_weight, self.settings.uld_weight)
        weights = self.loss.weights
        if announce:  # once per run: the main process says it
            logger.warning("trl_distill: the teacher's tokenizer differs from the student's: cross-tokenizer "
                           "distillation on aligned completion text, %d of the teacher's %d ids shared by bytes "
                           "(weights: matched %.3g, ULD %.3g).", vocabulary.size, teacher_vocab, *weights)

    # ---- Data ----

    def route_rows(self, train_dataset, eval_dataset):
        """With `teacher_prompt`: every raw row has a teacher prompt of at least one of the teacher's tokens, checked
        before anything loads."""
        if self.settings.prompt is not None:
            for split, dataset in splits(train_dataset, eval_dataset):
                check_teacher_prompts(self.settings.prompt, dataset, split,
                                      lambda prompt: prompt_tokens(self.teacher_tokenizer, prompt))
        return unrouted(train_dataset)

    def prepare_dataset(self, dataset, name: str):
        """The prepared `dataset` with the teacher's ids and each row's group positions (empty where the row's
        completion cannot be aligned: counted and logged)."""
        if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
            raise ValueError("Cross-tokenizer distillation needs a map-style dataset (not an IterableDataset): every "
                             "row is aligned for the teacher before training.")
        eos = self.student_tokenizer.eos_token
        limit = self.settings.max_length

        def columns(example, index):
            raw = {key: value[: -len(eos)] if key in ("text", "completion") and isinstance(value, str) and eos
                   and value.endswith(eos) else value for key, value in example.items()}  # SFT appended the EOS
            teacher_raw = self.teacher_example(raw, name, index)
            row = align_example(raw, self.student_tokenizer, self.teacher_tokenizer, teacher_raw)
            prepared = example["input_ids"]
            prompt = teacher_prompt_ids(teacher_raw, self.teacher_tokenizer)  # for sampled completions (lmbda > 0)
            bound = None if limit is None else limit + self.prompt_excess(raw, prompt)
            if row is None or row.student_input_ids[: len(prepared)] != list(prepared[: len(row.student_input_ids)]):
                return {TEACHER_IDS: row.teacher_input_ids[:bound] if row else [], STUDENT_POSITIONS: [],
                        TEACHER_POSITIONS: [], TEACHER_PROMPT: prompt}
            teacher_ids = row.teacher_input_ids[:bound]
            pairs = [(s, t) for s, t, g in zip(row.student_positions, row.teacher_positions, row.groups, strict=True)
                     if g.student[1] <= len(prepared) and g.teacher[1] <= len(teacher_ids)]  # both sides whole
            return {TEACHER_IDS: teacher_ids, STUDENT_POSITIONS: [s for s, _ in pairs],
                    TEACHER_POSITIONS: [t for _, t in pairs], TEACHER_PROMPT: prompt}

        dataset = dataset.map(columns, with_indices=True, num_proc=self.settings.dataset_num_proc,
                              desc=f"Aligning {name} for the teacher")
        unaligned = sum(1 for positions in dataset[STUDENT_POSITIONS] if not positions)
        if unaligned and PartialState().is_main_process:
            logger.warning("trl_distill: %d of %d %s rows have no completion text both tokenizers can align; they "
                           "train on CE only.", unaligned, len(dataset), name)
        return dataset

    def prompt_excess(self, raw: dict, teacher_prompt: list[int]) -> int:
        """How many more tokens the teacher's row may hold than `max_length`: with `teacher_prompt`, its excess over
        the teacher's tokens of the row's own prompt, so that a long teacher prompt leaves the completion the
        room it has without one (the teacher reads its whole teacher prompt, as on the student's tokenizer)."""
        if self.settings.prompt is None:
            return 0
        return max(0, len(teacher_prompt) - len(teacher_prompt_ids(raw, self.teacher_tokenizer)))

    def teacher_example(self, raw: dict, split: str, index: int) -> dict:
        """What the teacher renders of row `index`: the row itself, or with `teacher_prompt` (privileged context) its
        teacher prompt in place of its prompt, before the same completion."""
        spec = self.settings.prompt
        if spec is None:
            return raw
        prompt = teacher_prompt_of(spec, raw, split, index)
        shaped = "prompt" in raw and "completion" in raw
        if not shaped or isinstance(prompt, list) != isinstance(raw["prompt"], list):
            raise ValueError(f"teacher_prompt with a teacher of another tokenizer replaces each row's prompt with one "
                             f"of the same kind before the same completion: row {index} of the {split} dataset needs "
                             f"a 'prompt' and a 'completion' column and a teacher prompt that is "
                             f"{'a list of messages' if isinstance(raw.get('prompt'), list) else 'a string'} like its "
                             "prompt.")
        return {**raw, "prompt": prompt}

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """Sampled completions (`batch`) of the prompts of `source` (the collated batch they replace): each row
        re-rendered for the teacher (its own prompt tokens, then its tokens of the completion's text) and aligned
        (`cross_tokenizer.sampled`). A row that does not align trains on CE only."""
        cross = extras_of(source).cross_tokenizer if source is not None else None
        prompts = cross.prompts if cross is not None else None
        if prompts is None:
            raise ValueError("Sampled completions across tokenizers need the teacher's prompt tokens of their rows: "
                             "the batch they replace carries none.")
        eos, limit = self.student_tokenizer.eos_token_id, self.settings.max_length
        examples = []
        for labels, prompt in zip(batch["labels"], prompts, strict=True):
            where = (labels != -100).nonzero().squeeze(1)
            start, completion = (int(where[0]), labels[where].tolist()) if len(where) else (len(labels), [])
            teacher_ids, groups = align_sampled(completion, bool(completion) and completion[-1] == eos,
                                                self.student_tokenizer, self.teacher_tokenizer) if prompt else ([], [])
            bound = limit + (len(prompt) if self.settings.prompt is not None else 0) if limit else None
            ids = (list(prompt) + teacher_ids)[:bound]  # (a teacher prompt leaves the sample max_length tokens)
            kept = [g for g in groups if start + g.student[0] > 0 and len(prompt) + g.teacher[0] > 0
                    and len(prompt) + g.teacher[1] <= len(ids)]
            examples.append({TEACHER_IDS: ids, STUDENT_POSITIONS: [start + g.student[0] - 1 for g in kept],
                             TEACHER_POSITIONS: [len(prompt) + g.teacher[0] - 1 for g in kept], TEACHER_PROMPT: prompt,
                             GROUP_LENGTHS: [(g.student[1] - g.student[0], g.teacher[1] - g.teacher[0]) for g in kept]})
        self.sampled_rows["rows"] += len(examples)
        self.sampled_rows["unaligned"] += sum(not e[STUDENT_POSITIONS] for e in examples)
        device = batch["input_ids"].device
        add_extras(batch, cross_tokenizer=cross_batch(examples, self.teacher_tokenizer.pad_token_id or 0).to(device))

    def release(self) -> None:
        super().release()
        rows, unaligned = self.sampled_rows.values()
        if unaligned and PartialState().is_main_process:
            logger.warning("trl_distill: %d of %d sampled completions have no text both tokenizers can align; they "
                           "trained on CE only.", unaligned, rows)
        self.sampled_rows = dict.fromkeys(self.sampled_rows, 0)

    # ---- The loss ----

    def teacher_rows(self, batch: tuple, mask: torch.Tensor, keep: torch.Tensor) -> CrossRows:
        """Run the teacher on its own ids (every rank: ZeRO-3 gathers are collective) and lay its states at the
        groups onto the loss's rows (`mask` ``[B, K]`` over the positions `keep`, row-major)."""
        groups, lengths = batch[2], batch[4] if len(batch) > 4 else None
        rows, s_pos, t_pos = (column.contiguous() for column in groups.reshape(-1, 3).unbind(1))
        column = torch.searchsorted(keep, s_pos).clamp(max=max(keep.numel() - 1, 0))
        flat = rows * keep.numel() + column
        # a group counts only where the student has a loss token at its position (never a neighbour's row)
        valid = (keep[column] == s_pos) & mask.flatten()[flat] if keep.numel() else torch.zeros_like(s_pos, dtype=bool)
        rows, s_pos, t_pos, flat = rows[valid], s_pos[valid], t_pos[valid], flat[valid]
        # the sampled-token objective reads the student's samples (their groups' token counts come with them); an
        # eval batch of the dataset's completions is scored by the divergence
        sampled_token = self.context.plan.on_policy.objective == "sampled_token" and lengths is not None
        spans = lengths[valid] if sampled_token else None
        reach = torch.cat([t_pos, *([] if spans is None else [group_spread(t_pos, spans[:, 1])])])
        keep_t = torch.unique(reach)  # each group's first position; with the sampled tokens, all of its positions
        features = self.features(teacher_inputs(batch), keep_t)
        states = features.states[rows, torch.searchsorted(keep_t, t_pos)]
        index = (mask.flatten().cumsum(0) - 1)[flat]
        n = int(mask.sum())
        laid = states.new_zeros(n, states.shape[-1]).index_copy_(0, index, states)
        is_group = torch.zeros(n, dtype=torch.bool, device=laid.device).index_fill_(0, index, True)
        teacher_ids = batch[0]  # the teacher's own next token after each group's position
        own = teacher_ids[rows, (t_pos + 1).clamp(max=teacher_ids.shape[1] - 1)]
        teacher_labels = torch.full((n,), -100, dtype=torch.long, device=laid.device).index_copy_(0, index, own)
        shares = torch.tensor([index.numel(), n, torch.unique(rows).numel(), int(mask.any(1).sum())],
                              dtype=torch.float64)  # aligned groups of loss tokens, aligned rows of rows
        token_logp = None
        if spans is not None:
            token_logp = group_token_log_probs(teacher_ids, features, keep_t, rows, t_pos, spans[:, 1])
            token_logp = spread_onto_rows(token_logp / spans[:, 0], rows, s_pos, spans[:, 0], mask, keep)
        return CrossRows(laid, is_group, features.head, self.loss, teacher_labels, shares, token_logp)


def group_spread(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``starts[g] + k`` for every ``k < counts[g]``, group by group: the positions a group's tokens are read at."""
    owner = torch.arange(len(starts), device=starts.device).repeat_interleave(counts)
    first = (counts.cumsum(0) - counts).repeat_interleave(counts)
    return starts[owner] + torch.arange(len(owner), device=starts.device) - first


def group_token_log_probs(teacher_ids: torch.Tensor, features, keep_t: torch.Tensor, rows: torch.Tensor,
                          t_pos: torch.Tensor, counts: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Per group ``[G]`` (float32): the teacher's log-prob of the group's own teacher tokens, summed (the group's text,
    read after its own prompt and the text before it), from its states at the positions `keep_t`."""
    owner = torch.arange(len(rows), device=rows.device).repeat_interleave(counts)
    positions = group_spread(t_pos, counts)
    targets = teacher_ids[rows[owner], positions + 1]
    states = features.states[rows[owner], torch.searchsorted(keep_t, positions)]
    logp = torch.empty(len(owner), dtype=torch.float32, device=states.device)
    for start in range(0, len(owner), chunk):
        part = states[start:start + chunk]
        logits = part if features.head is None else features.head.logits(part)
        picked = targets[start:start + chunk, None].to(logits.device)
        logp[start:start + chunk] = F.log_softmax(logits.float(), -1).gather(1, picked).squeeze(1)
    return logp.new_zeros(len(rows)).index_add_(0, owner.to(logp.device), logp)


def spread_onto_rows(per_token: torch.Tensor, rows: torch.Tensor, s_pos: torch.Tensor, counts: torch.Tensor,
                     mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``per_token[g]`` on each loss row that predicts one of group g's student tokens (`mask` ``[B, K]`` over the
    positions `keep`, row-major); NaN on a loss row no group covers (no teacher log-prob of its token)."""
    owner = torch.arange(len(rows), device=rows.device).repeat_interleave(counts)
    positions = group_spread(s_pos, counts)
    column = torch.searchsorted(keep, positions).clamp(max=max(keep.numel() - 1, 0))
    flat = rows[owner] * keep.numel() + column
    inside = (keep[column] == positions) & mask.flatten()[flat]
    index = (mask.flatten().cumsum(0) - 1)[flat[inside]]
    out = torch.full((int(mask.sum()),), float("nan"), dtype=per_token.dtype, device=per_token.device)
    return out.index_copy_(0, index.to(out.device), per_token[owner[inside].to(out.device)])


class CrossTokenizerCollator:
    """Wraps the trainer's collator: the teacher's ids, right-padded, and the batch's groups as ``[G, 3]`` (row,
    student position, teacher position), in the batch's extras (`cross_tokenizer`), which the model never sees."""

    def __init__(self, collator, pad_id: int):
        self.collator, self.pad_id = collator, pad_id

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator([{k: v for k, v in ex.items() if k not in COLUMNS} for ex in examples])
        add_extras(batch, cross_tokenizer=cross_batch(examples, self.pad_id))
        return batch


def cross_batch(examples: list[dict], pad_id: int) -> CrossTokenizerBatch:
    """``(teacher ids [B, L], their mask, groups [G, 3] (row, student position, teacher position), the teacher's
    prompt tokens per row, each group's token counts [G, 2] (student, teacher) or None)``: what the cross-tokenizer
    teacher reads of a batch (the counts come with sampled rows, for the sampled-token objective)."""
    ids = [torch.tensor(ex[TEACHER_IDS] or [pad_id], dtype=torch.long) for ex in examples]
    teacher_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)
    teacher_mask = pad_sequence([torch.ones_like(i) for i in ids], batch_first=True, padding_value=0)
    groups = [(b, s, t) for b, ex in enumerate(examples)
              for s, t in zip(ex[STUDENT_POSITIONS], ex[TEACHER_POSITIONS], strict=True)]
    prompts = [list(ex.get(TEACHER_PROMPT) or []) for ex in examples]
    lengths = None
    if all(GROUP_LENGTHS in ex for ex in examples):
        lengths = torch.tensor([n for ex in examples for n in ex[GROUP_LENGTHS]], dtype=torch.long).reshape(-1, 2)
    groups = torch.tensor(groups, dtype=torch.long).reshape(-1, 3)
    return CrossTokenizerBatch(teacher_ids, teacher_mask, groups, prompts, lengths)


class CrossRows(TeacherBatch):
    """The teacher's last hidden states (or own logits, on the exact path) laid onto the loss's rows; zeros, and
    ``is_group`` False, on rows no group starts at (a `base.TeacherBatch`)."""

    def __init__(self, states: torch.Tensor, is_group: torch.Tensor, head, loss: CrossTokenizerLoss,
                 teacher_labels: torch.Tensor, shares: torch.Tensor, token_logp: torch.Tensor | None = None):
        self.states, self.is_group, self.head, self.loss = states, is_group, head, loss
        self.teacher_labels, self.shares, self.token_logp = teacher_labels, shares, token_logp

    def signal(self, rows: torch.Tensor | None, n: int, settings: LossSettings,
               picks: torch.Tensor | None = None) -> CrossTokenizerSignal:
        """Over the `n` loss rows, or, with `picks`, over those of them only (a routed teacher's rows: its aligned
        share of their tokens; the row shares are left out)."""
        if self.states.shape[0] != n:
            raise RuntimeError(f"The teacher has {self.states.shape[0]} loss rows, the student {n}.")
        if picks is None:
            return CrossTokenizerSignal(self, self.loss, settings.temperature)
        is_group = self.is_group[picks]
        shares = torch.tensor([int(is_group.sum()), picks.numel(), 0, 0], dtype=torch.float64)
        token_logp = None if self.token_logp is None else self.token_logp[picks]
        own = CrossRows(self.states[picks], is_group, self.head, self.loss, self.teacher_labels[picks], shares,
                        token_logp)
        return CrossTokenizerSignal(own, self.loss, settings.temperature)


class CrossTokenizerSignal(TeacherSignal):
    """The teacher side of `losses.fused_loss` across tokenizers: per chunk of rows, the teacher's logits at the
    temperature, and the per-group loss against the student's log-probs (0 on rows that start no group)."""

    closed_form = False

    def __init__(self, rows: CrossRows, loss: CrossTokenizerLoss, temperature: float):
        self.rows, self.loss, self.temperature = rows, loss, temperature

    def chunk(self, rows: slice, compute: torch.dtype):
        states = self.rows.states[rows]
        logits = states if self.rows.head is None else self.rows.head.logits(states)
        token_logp = None if self.rows.token_logp is None else self.rows.token_logp[rows]
        return self.rows.is_group[rows], at_temperature(logits.detach().to(compute), self.temperature), token_logp

    def token_log_probs(self, chunk, labels: torch.Tensor) -> torch.Tensor:
        """The teacher's log-prob of each sampled student token: its aligned group's (the group's teacher tokens
        summed), shared equally by the group's student tokens; NaN where no group covers the token."""
        if chunk[2] is None:
            raise RuntimeError("The cross-tokenizer teacher computed no sampled-token log-probs for this batch.")
        return chunk[2]

    def token_coverage(self, chunk) -> torch.Tensor | None:
        """The sampled tokens an aligned group covers (the others have no teacher log-prob)."""
        return None if chunk[2] is None else ~torch.isnan(chunk[2])

    def per_token(self, student_logp: torch.Tensor, chunk, settings: LossSettings) -> torch.Tensor:
        is_group, teacher_scaled, _ = chunk
        matched, uld = divergence_at_temperature(student_logp, teacher_scaled, self.loss.vocabulary, settings)
        return torch.where(is_group, self.loss.combine(matched, uld), 0.0)

    def observe(self, into: LossDiagnostics, rows: slice, logits: torch.Tensor, chunk, labels, settings) -> None:
        is_group, teacher_scaled, _ = chunk
        observe_groups(into, logits, teacher_scaled, is_group, self.rows.teacher_labels[rows], self.loss.vocabulary,
                       self.temperature)

    def observe_batch(self, into: LossDiagnostics) -> None:
        groups, tokens, aligned_rows, rows = self.rows.shares.tolist()
        into.add("aligned_token_share", torch.tensor(groups), tokens)
        into.add("aligned_row_share", torch.tensor(aligned_rows), rows)


def pop_cross_batch(inputs: dict) -> CrossTokenizerBatch | None:
    """Remove the teacher's ids and the groups from a batch (the student must not see them), on the batch's device;
    None without."""
    batch = pop_extra(inputs, "cross_tokenizer")
    return None if batch is None else batch.to(inputs["input_ids"].device)


def teacher_inputs(batch: tuple) -> dict:
    """The teacher's own model inputs from a popped cross-tokenizer batch."""
    return {"input_ids": batch[0], "attention_mask": batch[1]}
