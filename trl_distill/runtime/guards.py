"""The guards of a running distillation, each one clear stop or warning with its threshold a config field:

- a non-finite student loss stops every rank before its backward (the last complete checkpoint is kept);
- on-policy collapse (the student's samples repeat themselves, or its entropy on them vanishes, for
  ``collapse_patience`` logging steps in a row) stops with the numbers;
- a teacher whose cross-entropy on the dataset's rows is worse than the student's before training, at the first
  step, is a warning
  (a wrong teacher, or data it was not trained for).

What a step finds not finite (the teacher's outputs, `check_teacher_finite`; the collator's loss-token indices) waits
on the device in the run's `StepFlags` until the non-finite guard reads it all at once, before the step's last
backward.

Before any of them, a float setting that is NaN (or inf where it bounds nothing) is refused as the config is built
(`check_finite_settings`), so that a non-finite loss is not the first sign of it.
"""

from __future__ import annotations

import logging
import math

import torch

from ..errors import ExternalError
from .context import RunContext
from .validation import teacher_not_finite

logger = logging.getLogger("trl_distill")


class TrainingStopped(ExternalError):
    """A guard stopped the run (a non-finite loss, a collapsed on-policy student); the message has the numbers."""


# Float settings where inf means "no bound" (a timeout, a clip, a margin); every other one must be finite
UNBOUNDED = ("teacher_server_timeout", "vllm_server_timeout", "vllm_importance_sampling_clip_max", "max_grad_norm",
             "teacher_ce_margin")


def check_finite_settings(args) -> None:
    """Every float setting (ours and the Trainer's) a number, as the config is built: a NaN (or an inf, where it
    bounds nothing) would only show later as a loss that is not finite, with the guard's advice for a diverging run
    (lower the learning rate) instead of the setting's name."""
    from dataclasses import fields

    for item in fields(args):
        value = getattr(args, item.name, None)
        if not isinstance(value, float) or math.isfinite(value) or value == math.inf and item.name in UNBOUNDED:
            continue
        default = "unset" if item.default is None else f"{item.default}"
        raise ValueError(f"{item.name} must be a finite number, got {value}: pass a number, or leave it at its "
                         f"default ({default}).")


def check_guard_args(args) -> None:
    """One clear error for guard settings that cannot work, before anything loads (`run_plan.resolve`)."""
    if not 0 <= args.collapse_max_repetition <= 1:
        raise ValueError(f"collapse_max_repetition must be in [0, 1] (1 turns the guard off), got "
                         f"{args.collapse_max_repetition}.")
    if args.collapse_min_entropy < 0 or args.collapse_patience < 1:
        raise ValueError(f"collapse_min_entropy must be >= 0 (0 turns the guard off) and collapse_patience >= 1, got "
                         f"{args.collapse_min_entropy} and {args.collapse_patience}.")


class StepFlags:
    """What one optimizer step found not finite, kept on the device until `Guards.check_step` reads it all at once
    (a GPU waits for the host once per step, not once per check): the teacher's outputs, the student's losses."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.teacher_bad: torch.Tensor | None = None
        self.where: str | None = None
        self.losses: list[torch.Tensor] = []
        self.layout_bad: torch.Tensor | None = None

    def layout(self, bad: torch.Tensor) -> None:
        """The collator's loss-token indices did not match the labels the step trains on (`data.loss_layout`)."""
        self.layout_bad = bad

    def teacher(self, bad: torch.Tensor, where: str) -> None:
        self.teacher_bad = bad if self.teacher_bad is None else torch.maximum(self.teacher_bad, bad)
        self.where = self.where or where


def check_teacher_finite(teacher_hidden: torch.Tensor, accelerator, where: str, deferred=None) -> None:
    """Stop every rank together, with one message, when the teacher's hidden states hold NaN or inf on any rank
    (one scalar all-reduce per call; a lone failing rank would leave the others waiting in a collective). `where`
    names the place in the run: ``"step 3"``, ``"cache row 128"``. With `deferred` (a `StepFlags`, in training) the
    flag stays on the device and is read with the step's other checks, before its last backward (`Guards`)."""
    bad = (~torch.isfinite(teacher_hidden)).any().to(torch.float32).reshape(1)
    if deferred is not None:
        deferred.teacher(bad, where)
        return
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    if bad.item() > 0:
        raise teacher_not_finite(where, int(bad.item()))


class Guards:
    """The three guards of one run (handed its `context.RunContext`, not the trainer)."""

    def __init__(self, context: RunContext):
        self.context = context
        self.collapsed_logs = 0  # consecutive logging steps past a collapse bound

    def check_loss(self, loss: torch.Tensor, totals: torch.Tensor | None = None) -> list[float] | None:
        """After each micro-batch's loss in training: keep it; at the optimizer step's last micro-batch, before its
        backward (so before the optimizer), read the step's checks at once (`check_step`), and `totals` with them."""
        self.context.deferred.losses.append(loss.detach().reshape(1))
        return self.check_step(totals) if self.context.accelerator.sync_gradients else None

    def check_step(self, totals: torch.Tensor | None = None) -> list[float] | None:
        """Stop every rank when, on any rank, the teacher's outputs or (with `stop_on_nonfinite_loss`) the student's
        loss were not finite in this step: one all-reduce and one read of the device (collective). `totals` (a
        logged step's metrics) are summed over ranks in the same all-reduce and returned, read."""
        run, flags = self.context, self.context.deferred
        losses = torch.cat(flags.losses) if flags.losses and run.plan.guards.stop_on_nonfinite_loss else None
        teacher_bad, where, layout_bad = flags.teacher_bad, flags.where, flags.layout_bad
        flags.clear()
        if losses is None and teacher_bad is None and totals is None and layout_bad is None:
            return None
        device = next(t.device for t in (losses, teacher_bad, totals, layout_bad) if t is not None)
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        bad_losses = zero if losses is None else (~torch.isfinite(losses)).double()
        summed = torch.cat([*(zero if flag is None else flag.to(device, torch.float64) for flag in (layout_bad,
                                                                                                     teacher_bad)),
                            bad_losses.amax().reshape(1), *([] if totals is None else [totals.to(torch.float64)])])
        if run.num_processes > 1:
            summed = run.accelerator.reduce(summed, reduction="sum")
        first_bad = zero if losses is None else losses[bad_losses.argmax()].reshape(1).double()
        layout_ranks, teacher_ranks, loss_ranks, value, *read = torch.cat(
            [summed[:3], first_bad, summed[3:]]).tolist()  # the step's one read
        if layout_ranks > 0:
            raise RuntimeError(
                f"At step {run.step + 1} the loss-token indices the collator found (on the host) do not match the "
                "labels being trained on: something changed the batch's labels after the collator. Please report it "
                "with your data collator and callbacks.")
        if teacher_ranks > 0:
            raise teacher_not_finite(where, int(teacher_ranks))
        if loss_ranks > 0:
            raise TrainingStopped(
                f"The student's loss is not finite ({value:g} on rank {run.args.process_index}; "
                f"not finite on {int(loss_ranks)} of {run.num_processes} ranks) at step "
                f"{run.step + 1}; nothing of this step was applied. Lower the learning "
                "rate (or add warmup / max_grad_norm), check the data, and resume from the last complete checkpoint; "
                "stop_on_nonfinite_loss=False trains on.")
        return read if totals is not None else None

    def check_collapse(self, logs: dict[str, float]) -> None:
        """After a training log (the same numbers on every rank): stop after `collapse_patience` collapsed logs."""
        bounds = self.context.plan.guards
        repetition = logs.get("generated_repetition_rate")
        entropy = logs.get("on_policy_student_entropy")
        if repetition is None and entropy is None:
            return
        repeats = repetition is not None and bounds.collapse_max_repetition < 1 and \
            repetition > bounds.collapse_max_repetition
        flat = entropy is not None and entropy < bounds.collapse_min_entropy
        self.collapsed_logs = self.collapsed_logs + 1 if repeats or flat else 0
        if self.collapsed_logs >= bounds.collapse_patience:
            raise TrainingStopped(
                f"On-policy collapse: for {self.collapsed_logs} logging steps in a row up to step "
                f"{self.context.step} the student's samples "
                + (f"repeat themselves (generated_repetition_rate {repetition:.3f} > collapse_max_repetition "
                   f"{bounds.collapse_max_repetition})" if repeats else
                   f"have entropy {entropy:.4f} < collapse_min_entropy {bounds.collapse_min_entropy}")
                + ". Lower the learning rate or lmbda, raise generation_temperature, or start from an SFT-trained "
                "student; the last complete checkpoint is kept.")

    def check_teacher(self, means: dict[str, float]) -> None:
        """At the first step of a fresh run (rank 0): warn when the teacher's CE on that step's dataset rows (not the
        student's own samples, which it rates highly) is worse than the student's, before it trained."""
        teacher, student = means.get("teacher_ce"), means.get("student_ce")
        margin = self.context.plan.guards.teacher_ce_margin
        if teacher is None or student is None or not math.isfinite(teacher) or self.context.args.alpha == 0:
            return  # (alpha 0: the teacher is only logged, e.g. an SFT-only run that names the student itself)
        if teacher > student + margin:
            logger.warning(
                "trl_distill: at the first step the teacher's cross-entropy on the training data is %.4f, the "
                "student's before training %.4f: the teacher predicts this data worse than the student it teaches. A "
                "wrong teacher, or data it was not trained for? (teacher_ce_margin=%g)", teacher, student,
                margin)
