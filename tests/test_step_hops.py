"""A step stays as readable as docs/architecture.md says: its hops (`step_hops.py`), counted on a real step of a live
teacher (off-policy, with the teacher's once-per-step pass) and of the student's own samples (HF generate, the
sampled-token objective), are at most the counts its table "Hops, counted" gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from step_hops import StepHops, report  # tests/ is on sys.path
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
STEPS = {
    "off-policy": {},
    "on-policy, HF generate": dict(lmbda=1.0, on_policy_objective="sampled_token", max_new_tokens=8, temperature=1.0),
}


def documented(step: str) -> tuple[int, int]:
    """``(hops, files)`` of the table's "now" column for `step`."""
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {step} "))
    now = [cell.strip() for cell in row.strip().strip("|").split("|")][-1]
    hops, files = re.fullmatch(r"(\d+) hops over (\d+) files", now).groups()
    return int(hops), int(files)


@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_has_at_most_the_documented_hops(step, tiny_pair, tmp_path):
    hops = StepHops(after=1)
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path), per_device_train_batch_size=4, save_strategy="no", use_cpu=True, max_steps=3,
        teacher_model_name_or_path=tiny_pair["teacher"], **STEPS[step]))
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(16),
                                  processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]),
                                  callbacks=[hops])
    trainer.train()
    assert "loss/fused.py:features_loss" in hops.hops  # the step was traced, loss and all
    assert "trainer.py:DistillationTrainer.get_batch_samples" in hops.hops  # (the Trainer's loop into ours)
    sampler = {hop for hop in hops.hops if hop.startswith("rollout/")}
    if STEPS[step]:  # the student's samples
        assert "rollout/on_policy.py:CompletionSampler.maybe_resample" in sampler
    else:  # an off-policy step does without the sampler (and the teacher runs once for the step)
        assert sampler == set(), report(step, hops)
        assert "teacher/live.py:LiveTeacher.features" in hops.hops  # called by the step pass (a hop), not for_batch
    most_hops, most_files = documented(step)
    assert len(hops.hops) <= most_hops and len(hops.files) <= most_files, report(step, hops)
