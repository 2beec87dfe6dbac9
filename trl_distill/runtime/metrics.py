"""`kd_loss` and `ce_loss` beside the Trainer's `loss`, reduced exactly like it (summed per optimizer step, averaged
over ranks and steps between logs; per sample in evaluation), and the callback that starts their count with
training (after a resume, at the checkpoint) and releases what the teacher holds at its end."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .. import compat
from .deepspeed_config import print_engine_configs


class DistillMetrics:
    """The KD and CE terms of one trainer, from its loss to its logs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.sums = {"kd_loss": 0.0, "ce_loss": 0.0}
        self.last_logged_step = 0

    def record(self, kd: torch.Tensor, ce: torch.Tensor, batch_size: int) -> None:
        trainer = self.trainer
        if trainer.model.training:
            self.sums["kd_loss"] += kd.detach()
            self.sums["ce_loss"] += ce.detach()
            return
        # Like `eval_loss`: one value per sample, duplicates of an uneven last batch dropped.
        for name, value in (("kd_loss", kd), ("ce_loss", ce)):
            values = trainer.accelerator.gather_for_metrics(value.detach().reshape(1).repeat(batch_size))
            compat.eval_metric_values(trainer, name).extend(values.tolist())

    def log_into(self, logs: dict[str, float]) -> None:
        """Add the means since the last log to a training log (collective: every rank logs)."""
        trainer = self.trainer
        steps = max(trainer.state.global_step - self.last_logged_step, 1)
        for name, total in self.sums.items():
            total = torch.as_tensor(total, device=trainer.args.device, dtype=torch.float32)
            logs[name] = trainer.accelerator.gather(total.reshape(1)).mean().item() / steps
            self.sums[name] = 0.0
        self.last_logged_step = trainer.state.global_step

    def restart(self, step: int) -> None:
        self.last_logged_step = step
        self.sums = dict.fromkeys(self.sums, 0.0)


class TrainingBounds(TrainerCallback):
    """As `train()` starts: rank 0 prints both engines' DeepSpeed configs (once), and the metrics count from the
    step training starts at. As it ends: the teacher releases what it holds (computed or requested ahead)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.configs_printed = False

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if not self.configs_printed and trainer.accelerator.is_main_process:
            print_engine_configs(trainer.accelerator, trainer.teacher.config_notes)
        self.configs_printed = True
        trainer.metrics.restart(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.teacher.release()
