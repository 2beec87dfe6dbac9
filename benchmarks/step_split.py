"""Where an optimizer step's time goes, for `trainer_worker.py` (``spec["split"]``): wall-clock timers wrapped around
the trainers' own methods, summed per step, and a plain teacher forward timed after training.

Parts (seconds per optimizer step, means over the timed steps; each part excludes the parts listed inside it):

* ``teacher``: ours, the once-per-step teacher pass (`teacher.before_step`: its ZeRO-3 gathers and forward, with
  the step's data fetch); GKD, the teacher's forward (full logits).
* ``loss``: ours, the fused loss (`loss.fused.features_loss`, which also computes the lm_head's gradients);
  GKD, `generalized_jsd_loss` (its backward runs in ``backward``).
* ``student_forward``: the rest of `compute_loss`: the student's body forward (ours: inside it the loss).
* ``backward``: `accelerator.backward`, in which ZeRO-2 reduces the gradients (`overlap_comm` off).
* ``optimizer``: the rest of the step: the optimizer, ZeRO-2's all-gather of the updated parameters, clipping.
* ``teacher_compute``: the same teacher forward over the step's rows by a plain copy of the teacher (no ZeRO), timed
  after training; ``teacher`` minus this is the gathering (``teacher_gather``) for a partitioned teacher.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

PARTS = ("teacher", "teacher_gather", "teacher_compute", "student_forward", "loss", "backward", "optimizer")


class Split:
    """Cumulative seconds per timer, snapshotted at every optimizer step's end."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.snapshots: list[dict[str, float]] = []

    def wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start

        setattr(owner, name, timed)

    def snapshot(self) -> None:
        self.snapshots.append(dict(self.totals))

    def per_step(self, warmup: int, step_seconds: float) -> dict[str, float]:
        """Exclusive seconds per step over the steps after `warmup` (`step_seconds`: their mean wall time)."""
        first, last = self.snapshots[warmup - 1], self.snapshots[-1]
        steps = len(self.snapshots) - warmup
        spent = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / steps for k in last}
        inner = spent.get("loss", 0.0) + spent.get("teacher_in_loss", 0.0)
        return {
            "teacher": spent.get("teacher", 0.0) + spent.get("teacher_in_loss", 0.0),
            "loss": spent.get("loss", 0.0),
            "student_forward": spent.get("compute_loss", 0.0) - inner,
            "backward": spent.get("backward", 0.0),
            "optimizer": step_seconds - spent.get("teacher", 0.0) - spent.get("training_step", 0.0),
            "step": step_seconds,
        }


def instrument_ours(trainer) -> Split:
    split = Split()
    split.wrap(trainer.teacher, "before_step", "teacher")
    split.wrap(trainer, "training_step", "training_step")
    split.wrap(trainer, "compute_loss", "compute_loss")
    split.wrap(sys.modules[type(trainer).__module__], "features_loss", "loss")  # the trainer's name for it
    split.wrap(trainer.accelerator, "backward", "backward")
    return split


def instrument_gkd(trainer) -> Split:
    split = Split()
    split.wrap(trainer, "training_step", "training_step")
    split.wrap(trainer, "compute_loss", "compute_loss")
    split.wrap(trainer.teacher_model, "forward", "teacher_in_loss")
    split.wrap(trainer, "generalized_jsd_loss", "loss")
    split.wrap(trainer.accelerator, "backward", "backward")
    return split


def teacher_compute_seconds(spec: dict, rows: int, with_head: bool) -> float:
    """A plain (not partitioned) copy of the teacher over `rows` rows of ``spec["seq_len"]`` tokens, one at a time:
    the best of two. ``with_head``: through the lm_head (GKD's full logits), else the last hidden states (ours)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # after a ZeRO-3 student, from_pretrained would partition the copy (zero.Init)
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=dtype).eval()
    ids = torch.randint(4, spec["vocab_size"], (1, spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    body = model if with_head else model.model
    best = float("inf")
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            for _ in range(rows):
                body(input_ids=ids)
            best = min(best, time.perf_counter() - start)
    del model
    return best
