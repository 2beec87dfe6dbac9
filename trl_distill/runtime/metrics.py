"""`kd_loss` (the sampled-token objective's surrogate: `policy_loss`) and `ce_loss` beside the Trainer's `loss`,
reduced exactly like it (summed per optimizer step, averaged over ranks and steps between logs; per sample in
evaluation); the fused loss's diagnostics (`loss.diagnostics`: agreement, KL, CEs, entropies), token means over every
rank's loss tokens since the last log (over the whole set in evaluation); and the callback that starts their count
with training (after a resume, at the checkpoint), checks the teacher at the first step and releases what the teacher
holds at its end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from ..loss.diagnostics import INTERNAL, LossDiagnostics
from ..teacher.capabilities import OwnEngine
from .context import RunContext
from .deepspeed_config import print_engine_configs
from .guards import Guards

if TYPE_CHECKING:
    from ..teacher.base import TeacherSource
    from ..teacher.capabilities import OwnMetrics


class DistillMetrics:
    """The KD and CE terms of one run, from its loss to its logs. Handed the run's context, its guards, and
    `eval_values(name)`: the list a metric's per-sample eval values go to (SFTTrainer averages it as it logs)."""

    def __init__(self, context: RunContext, guards: Guards, eval_values: Callable[[str], list]):
        self.context, self.guards, self.eval_values = context, guards, eval_values
        # the KD term's name in training logs: a divergence is `kd_loss`; the sampled-token objective's policy-gradient
        # surrogate is no divergence, and logs under TRL GRPO's name for it
        self.kd_name = "policy_loss" if context.plan.on_policy.objective == "sampled_token" else "kd_loss"
        self.sums = {self.kd_name: 0.0, "ce_loss": 0.0}  # (several teachers: and each one's part, kd_loss/NAME)
        self.teacher_tokens: dict[str, int] = {}  # routed teachers: each one's loss tokens since the last log
        self.teacher_windows: dict[str, LossDiagnostics] = {}  # several teachers: each one's diagnostics
        self.last_logged_step = 0
        self.window = LossDiagnostics(context.device)  # training: since the last log
        self.evaluated = LossDiagnostics(context.device)  # evaluation: the whole set
        self.first_step = LossDiagnostics(context.device)  # a fresh run's first step, dataset rows only
        self.pending: LossDiagnostics | None = None  # the current micro-batch's, filled by the fused loss
        self.scoring: LossDiagnostics | None = None  # sampled rows scored for the generation eval (`scoring_samples`)
        self.read: tuple[int, list[float]] | None = None  # (step, `totals()` over ranks) read with the guard checks

    def diagnostics(self) -> LossDiagnostics | None:
        """A fresh accumulator for the fused loss of one micro-batch, or None when this one is not measured."""
        self.pending = LossDiagnostics(self.context.device) if self.measured() else None
        return self.pending

    def measured(self) -> bool:
        """Whether the current micro-batch's diagnostics are measured: always in evaluation; in training on every
        step with `distill_metrics_every_step`, else on the steps that are logged (and a fresh run's first, for the
        teacher check), every micro-batch of them."""
        args = self.context.args
        if self.scoring is not None:
            return True
        if not args.log_distill_metrics:
            return False
        if not self.context.training or args.distill_metrics_every_step:
            return True
        step = self.context.step + 1  # the optimizer step this micro-batch belongs to
        return step == 1 and self.last_logged_step == 0 or self.logged(step)

    def logged(self, step: int) -> bool:
        """Whether training logs at the end of optimizer step `step` (an epoch's last step is not known ahead: with
        ``logging_strategy="epoch"`` every step counts)."""
        args, state = self.context.args, self.context.state
        if args.logging_strategy == "epoch":
            return True
        return args.logging_strategy == "steps" and bool(state.logging_steps) and (
            step % state.logging_steps == 0 or args.logging_first_step and step == 1)

    def record(self, kd: torch.Tensor, ce: torch.Tensor, batch_size: int, loss: torch.Tensor,
               on_policy: bool = False, aux: torch.Tensor | None = None, teachers: OwnMetrics | None = None) -> None:
        """After one micro-batch's loss: its terms (`aux`: an MoE student's router load-balancing loss; `teachers`:
        several teachers' own parts, `record_teachers`), its diagnostics (`on_policy`: the student sampled its
        completions) and, in training, the non-finite guard (collective)."""
        self.record_teachers(kd, teachers)
        run, pending, self.pending = self.context, self.pending, None
        if self.scoring is not None:  # the generation eval's samples: their diagnostics only, apart from the loss's
            if pending is not None:
                self.scoring.merge(pending)
            return
        if pending is not None and on_policy:
            pending.copy_as("teacher_ce", "on_policy_teacher_logprob", sign=-1.0)
            pending.copy_as("student_entropy", "on_policy_student_entropy")
        if pending is not None:
            (self.window if run.training else self.evaluated).merge(pending)
            if run.training and not on_policy and self.last_logged_step == 0 and \
                    run.step == 0:  # the teacher check judges it on the data, not on samples
                self.first_step.merge(pending)
        if run.training:
            self.sums[self.kd_name] += kd.detach()
            self.sums["ce_loss"] += ce.detach()
            if aux is not None:
                self.sums["aux_loss"] = self.sums.get("aux_loss", 0.0) + aux.detach()
            # the guards read the step's checks once, before its last backward; a logged step's totals ride along
            logged = run.accelerator.sync_gradients and self.logged(run.step + 1)
            read = self.guards.check_loss(loss, self.totals() if logged else None)
            self.read = (run.step, read) if read is not None else self.read
            return
        # Like `eval_loss`: one value per sample, duplicates of an uneven last batch dropped.
        for name, value in (("kd_loss", kd), ("ce_loss", ce), *([("aux_loss", aux)] if aux is not None else [])):
            values = run.accelerator.gather_for_metrics(value.detach().reshape(1).repeat(batch_size))
            self.eval_values(name).extend(values.tolist())

    def record_teachers(self, kd: torch.Tensor, teachers: OwnMetrics | None) -> None:
        """Several teachers (`teachers`, a teacher's `OwnMetrics`; None without), in training: each one's part of this
        micro-batch's `kd` (its share of the KD sum, so the parts add up to `kd_loss`), routed its loss tokens, and
        its own diagnostics (when measured)."""
        parts = None if teachers is None else teachers.kd_parts()
        if parts is None or not self.context.training:
            return
        for name, measured in (teachers.own_metrics() or {}).items():
            self.teacher_windows.setdefault(name, LossDiagnostics(self.context.device)).merge(measured)
        total = sum(part.to(kd.device) for part, _ in parts.values())
        for name, (part, tokens) in parts.items():
            # (signed: the sampled-token objective's sum may be negative)
            share = torch.where(total != 0, part.to(kd.device) / torch.where(total != 0, total, 1.0),
                                torch.zeros_like(total))
            key = f"{self.kd_name}/{name}"
            self.sums[key] = self.sums.get(key, 0.0) + kd.detach() * share
            if tokens is not None:
                self.teacher_tokens[name] = self.teacher_tokens.get(name, 0) + tokens

    def totals(self) -> torch.Tensor:
        """Everything a training log reports, as sums to add over ranks: each term's sum, each routed teacher's
        tokens, the diagnostics' sums and counts (float64, on the device; `fill_log` reads them back)."""
        device = self.context.device
        parts = [torch.as_tensor(total, device=device, dtype=torch.float64).reshape(1) for total in self.sums.values()]
        parts.append(torch.tensor(list(self.teacher_tokens.values()), dtype=torch.float64, device=device))
        if self.context.args.log_distill_metrics:
            for window in (self.window, *self.teacher_windows.values()):
                parts += [window.sums, window.counts]
        return torch.cat(parts)

    def log_into(self, logs: dict[str, float]) -> None:
        """Add the means since the last log to a training log (collective: every rank logs). The totals were read
        with the step's guard checks (`record`) unless this log comes at a step that was not known to log."""
        run = self.context
        step, values = self.read if self.read is not None else (None, None)
        if step != run.step - 1:
            totals = self.totals()
            if run.num_processes > 1:
                totals = run.accelerator.reduce(totals, reduction="sum")
            values = totals.tolist()  # one read
        self.read = None
        self.fill_log(logs, values)

    def fill_log(self, logs: dict[str, float], values: list[float]) -> None:
        """The log's means from `totals()` summed over ranks; the sums start again."""
        run = self.context
        steps = max(run.step - self.last_logged_step, 1)
        for name, total in zip(self.sums, values, strict=False):
            logs[name] = total / run.num_processes / steps  # the mean over ranks, per step
        self.sums = dict.fromkeys(self.sums, 0.0)
        at = len(self.sums)
        counts = values[at : at + len(self.teacher_tokens)]
        at += len(self.teacher_tokens)
        for name, count in zip(self.teacher_tokens, counts, strict=True):  # each routed teacher's share of tokens
            logs[f"teacher_tokens/{name}"] = count / max(sum(counts), 1.0)
        self.teacher_tokens = dict.fromkeys(self.teacher_tokens, 0)
        self.last_logged_step = run.step
        if run.args.log_distill_metrics:
            width = self.window.sums.numel()
            windows = [(None, self.window), *self.teacher_windows.items()]  # the same names on every rank
            for i, (name, window) in enumerate(windows):
                chunk = values[at + 2 * width * i : at + 2 * width * (i + 1)]
                means = {k: v for k, v in window.means(chunk[:width], chunk[width:]).items() if k not in INTERNAL}
                logs.update(means if name is None else {f"{metric}/{name}": v for metric, v in means.items()})
                window.reset()

    def reduced(self, diagnostics: LossDiagnostics, internal: bool = False) -> dict[str, float]:
        """Token means over every rank (collective)."""
        totals = torch.cat([diagnostics.sums, diagnostics.counts])
        if self.context.num_processes > 1:
            totals = self.context.accelerator.reduce(totals, reduction="sum")
        means = diagnostics.means(*totals.chunk(2))
        return means if internal else {k: v for k, v in means.items() if k not in INTERNAL}

    @contextlib.contextmanager
    def scoring_samples(self):
        """Inside: each loss's diagnostics go into the yielded `LossDiagnostics` (the teacher's CE of sampled rows
        is its NLL of them) and nothing into the logged metrics."""
        self.scoring = LossDiagnostics(self.context.device)
        try:
            yield self.scoring
        finally:
            self.scoring = None

    def start_evaluation(self) -> None:
        self.evaluated.reset()

    def finish_evaluation(self, output):
        """After an evaluation loop (collective): its diagnostics, averaged by SFTTrainer's `log` like `kd_loss`."""
        if self.context.args.log_distill_metrics:
            for name, value in self.reduced(self.evaluated).items():
                self.eval_values(name)[:] = [value]
        return output

    def check_first_step(self, step: int) -> None:
        """At the end of a fresh run's first optimizer step (collective): the teacher-vs-student CE warning."""
        if step == 1 and self.last_logged_step == 0 and self.context.args.log_distill_metrics:
            means = self.reduced(self.first_step, internal=True)  # none on a step of the student's samples only
            self.first_step.reset()
            if self.context.accelerator.is_main_process:
                self.guards.check_teacher(means)
            if not (self.logged(1) or self.context.args.distill_metrics_every_step):
                self.window.reset()  # measured for the check only: the first log is of its own step

    def restart(self, step: int) -> None:
        self.last_logged_step = step
        self.sums = dict.fromkeys(self.sums, 0.0)
        self.teacher_tokens = dict.fromkeys(self.teacher_tokens, 0)
        self.window.reset()
        for window in self.teacher_windows.values():
            window.reset()


class TrainingBounds(TrainerCallback):
    """As `train()` starts: rank 0 prints both engines' DeepSpeed configs (once), and the metrics count from the
    step training starts at. As it ends: the teacher releases what it holds (computed or requested ahead)."""

    def __init__(self, context: RunContext, teacher: TeacherSource, metrics: DistillMetrics):
        self.context, self.teacher, self.metrics = context, teacher, metrics
        self.configs_printed = False

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.configs_printed and self.context.accelerator.is_main_process:
            engine = self.teacher.capability(OwnEngine)  # what was filled into the teacher's DeepSpeed config
            print_engine_configs(self.context.accelerator, [] if engine is None else engine.config_notes)
        self.configs_printed = True
        self.metrics.restart(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.metrics.check_first_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.teacher.release()
