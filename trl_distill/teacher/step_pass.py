"""The teacher once per optimizer step: one forward over every micro-batch of the step, not one per micro-batch.

The Trainer fetches all micro-batches of an optimizer step before it trains on the first
(`Trainer.get_batch_samples`). `TeacherStepPass` then runs the frozen teacher over their rows together (right-padded
to one length, at most `teacher_batch_size` rows per forward), so a ZeRO-3 teacher gathers each layer once per step
instead of once per micro-batch. Until each micro-batch's turn it keeps only what that micro-batch's loss reads: the
teacher's last hidden states (or, on the exact path, its own logits) at the micro-batch's loss tokens. The teacher's
lm_head is gathered once, after the forward, and held until the step's last micro-batch has its loss.

Right padding changes no value a loss token sees: attention is causal, so no position attends to the padding after
it, and the attention mask, where there is one, masks it too. Steps whose completions are sampled (`lmbda`,
`seq_kd`: the teacher must see the sampled rows), batches that are not plain ``[rows, length]`` token tensors
(padding-free batches carry sequence boundaries), the 'self' teacher and the teacher cache keep the per-micro-batch
path.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque

import torch
import torch.nn.functional as F

from ..data.batch import loss_tokens
from ..data.loss_layout import step_layout
from ..model.fused_forward import gathered
from ..rollout.sampling import DATASET, completion_source
from ..runtime.guards import check_teacher_finite
from .rows import DenseRows

logger = logging.getLogger(__name__)

LABEL_KEYS = ("labels", "shift_labels")
# Model inputs that are one value per token and can be right-padded: what the step pass batches
ROW_INPUTS = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0, "position_ids": None}


def plain_rows(batch_samples: list[dict], same_width: bool = False) -> str | None:
    """None when every micro-batch holds the same plain ``[rows, length]`` token tensors (and labels); else why not.
    `same_width` (sequence parallelism): right padding would land inside the split sequence, so every micro-batch
    must have the same length."""
    keys = set(batch_samples[0])
    extra = sorted(keys - set(ROW_INPUTS) - set(LABEL_KEYS))
    if extra or "input_ids" not in keys or not keys & set(LABEL_KEYS):
        return f"the batches carry {', '.join(extra) or 'no input_ids/labels'}"
    for batch in batch_samples:
        shape = batch["input_ids"].shape
        if set(batch) != keys or any(not isinstance(v, torch.Tensor) or v.shape != shape for v in batch.values()):
            return "the micro-batches' tensors differ in keys or shape"
    if same_width and len({b["input_ids"].shape[1] for b in batch_samples}) > 1:
        return "under sequence parallelism its micro-batches differ in length (pad every row to max_length)"
    return None


def right_padded(batches: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """The model inputs of all `batches`, right-padded to the longest and stacked row-wise. Position ids go on
    counting into the padding; input ids get `pad_id`; masks and token types 0."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for key, fill in ROW_INPUTS.items():
        if key not in batches[0]:
            continue
        parts = []
        for batch in batches:
            value = batch[key]
            extra = width - value.shape[1]
            if extra and key == "position_ids":
                value = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1, device=value.device)], 1)
            elif extra:
                value = F.pad(value, (0, extra), value=pad_id if fill is None else fill)
            parts.append(value)
        out[key] = torch.cat(parts)
    return out


class TeacherStepPass:
    """Runs a `DistillationTrainer`'s live `teacher` once per optimizer step and hands each micro-batch its rows
    (`rows.DenseRows` at its loss tokens, in the (row, position) order `loss.fused.select_loss_rows` picks)."""

    def __init__(self, context, teacher):
        self.context, self.teacher = context, teacher
        self.queue: deque[tuple[torch.Tensor, DenseRows]] = deque()
        self._held = contextlib.ExitStack()  # the teacher's lm_head, gathered for the step
        self._told = False

    def before_step(self, batch_samples: list[dict]) -> None:
        """The teacher over the step's micro-batches ahead of their losses (`run`), when it `applies` to them."""
        if self.applies(batch_samples):
            self.run(batch_samples)

    def applies(self, batch_samples: list[dict]) -> bool:
        """Whether this step's teacher runs ahead. The same on every rank: the teacher's collectives must match."""
        run = self.context
        if not (run.plan.teacher_settings.step_pass and batch_samples):
            return False
        on_policy = run.plan.on_policy
        if on_policy.samples and completion_source(on_policy.lmbda, on_policy.seq_kd, on_policy.seed,
                                                   run.step) != DATASET:
            return False  # sampled completions: the teacher runs on them, micro-batch by micro-batch
        why = plain_rows(batch_samples, same_width=run.plan.parallelism.sequence_parallel_size > 1)
        if why is not None and not self._told and run.accelerator.is_main_process:
            logger.warning("trl_distill: the teacher runs once per micro-batch, not once per optimizer step: %s "
                           "(padding-free or custom inputs), which are not plain [rows, length] tensors.", why)
        self._told = self._told or why is not None
        return why is None

    @torch.no_grad()
    def run(self, batch_samples: list[dict]) -> None:
        """The teacher over every micro-batch of the step; queues each micro-batch's `DenseRows`. Collective."""
        self.release()
        run = self.context
        batches = [run.prepare_inputs(b) for b in batch_samples]
        masks = [loss_tokens(b)[1] for b in batches]
        if not run.logit_paths.settled:  # which path each model's logits take: settled before the first forward
            first = {k: v for k, v in batches[0].items() if k not in LABEL_KEYS}
            run.logit_paths.settle(run.wrapped, first, masks[0][:, masks[0].any(0)])
        tokenizer = run.tokenizer
        rows = right_padded(batches, getattr(tokenizer, "pad_token_id", None) or 0)
        # where the loss tokens are: measured with the step's batches (one host read), else here (one read)
        layout = run.layouts.step(batches) if run.layouts is not None else None
        layout = layout if layout is not None else step_layout(masks)
        positions, width = layout.keep, layout.keep.numel()  # every position with a loss token in some row
        total = rows["input_ids"].shape[0]
        size = min(run.plan.teacher_settings.batch_size or total, total)
        picked, head = [], None
        for start in range(0, size * self._forward_count(math.ceil(total / size)), size):
            stop = min(start + size, total)
            if start >= total:  # this rank has run out of rows; its peers' gathers still need it: one idle row
                self.teacher.features({k: v[:1] for k, v in rows.items()}, positions[:0])
                continue
            features = self.teacher.features({k: v[start:stop] for k, v in rows.items()}, positions)
            # its rows' loss tokens, (row, position) order, from their [rows, P] grid
            wanted = layout.rows[layout.row_bounds[start] : layout.row_bounds[stop]] - start * width
            picked.append(features.states.flatten(0, 1).index_select(0, wanted))  # [n, F]
            head = features.head
        states = torch.cat(picked)
        check_teacher_finite(states, run.accelerator, f"step {run.step + 1}", run.deferred)
        for batch, part in zip(batches, states.split(layout.counts), strict=True):
            self.queue.append((batch["input_ids"], DenseRows(part, head, selected=True)))
        if head is not None:  # gathered once for the whole step (a no-op for a head that is not partitioned)
            self._held.enter_context(gathered(*head.params))

    def _forward_count(self, mine: int) -> int:
        """Forwards every rank runs: the most any rank needs (a partitioned teacher's gathers are collective)."""
        run = self.context
        if run.num_processes == 1 or run.plan.teacher_settings.batch_size is None:
            return mine  # one forward per step on every rank
        counts = run.accelerator.gather(torch.tensor([mine], device=run.device))
        return int(counts.max())

    def take(self, inputs: dict) -> DenseRows | None:
        """This micro-batch's teacher rows, computed ahead; None when the step ran no pass (the live path)."""
        if not self.queue:
            return None
        ids, rows = self.queue.popleft()
        given = inputs["input_ids"]
        same = given is ids or (given.shape == ids.shape and given.device == ids.device and  # no read of the device
                                given.stride() == ids.stride() and given.data_ptr() == ids.data_ptr())
        if not same and (ids.shape != given.shape or not torch.equal(ids, given.to(ids.device))):
            self.release()
            raise RuntimeError(
                "The teacher's rows computed ahead for this optimizer step "
                "do not belong to the micro-batch being trained: the training loop does not train on the "
                "micro-batches `get_batch_samples` returned, in order. Set teacher_step_pass=False "
                "(--teacher_step_pass false) to run the teacher per micro-batch."
            )
        return rows

    @property
    def idle(self) -> bool:
        """Whether no micro-batch of this step waits for its rows (the step's last loss is done, or none ran)."""
        return not self.queue

    def after_loss(self) -> None:
        """Called after each micro-batch's loss: the step's last one releases the held lm_head."""
        if not self.queue:
            self._release_head()

    def release(self) -> None:
        """Drop anything computed ahead and release the held lm_head (the end of training, a new step)."""
        self.queue.clear()
        self._release_head()

    def _release_head(self) -> None:
        self._held.close()
        self._held = contextlib.ExitStack()
