"""The guards on injected faults: a student driven to NaN stops before its step is applied (the last complete
checkpoint kept, nothing written after it); a degenerate sampler stops an on-policy run after `collapse_patience`
logging steps, with its numbers; a teacher worse on the dataset's rows than the student before training is one
warning at the first step. And none of them fires on a healthy run."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.rollout import on_policy
from trl_distill.runtime.checkpoints import is_complete
from trl_distill.runtime.guards import TrainingStopped
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings


def make_trainer(tiny_pair, tmp_path, **overrides):
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6,
                                 save_strategy="steps", save_steps=2, use_cpu=True, max_new_tokens=40)
    settings.update(overrides)
    teacher = None if "teacher_model_name_or_path" in settings else tiny_pair["teacher"]
    return DistillationTrainer(tiny_pair["student"], teacher, args=DistillationConfig(**settings),
                               train_dataset=synthetic_prompt_completion(32),
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


class Poison(TrainerCallback):
    """At the end of step `step`, one student weight becomes NaN (as an overflowing update leaves it)."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                self.trainer.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")


def test_a_student_driven_to_nan_stops_before_the_step_and_keeps_the_last_checkpoint(tiny_pair, tmp_path):
    trainer = make_trainer(tiny_pair, tmp_path)
    trainer.add_callback(Poison(trainer, 3))
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert str(stopped.value).startswith("The student's loss is not finite (nan on rank 0; not finite on 1 of 1 "
                                         "ranks) at step 4; nothing of this step was applied.")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and is_complete(out / "checkpoint-2")
    assert list(logged(trainer.state.log_history)) == [1, 2, 3] and trainer.state.global_step == 3
    assert torch.isnan(trainer.model.model.layers[0].mlp.up_proj.weight[0, 0])  # step 4 never ran its optimizer


def test_with_the_guard_off_a_nan_trains_on(tiny_pair, tmp_path):
    trainer = make_trainer(tiny_pair, tmp_path, stop_on_nonfinite_loss=False, save_strategy="no", max_steps=4)
    trainer.add_callback(Poison(trainer, 2))
    trainer.train()
    # (the Trainer's `loss` log filters NaN out by default: logging_nan_inf_filter)
    assert [torch.isnan(torch.tensor(v)).item() for v in logged(trainer.state.log_history, "kd_loss").values()] == \
        [False, False, True, True]


def repeat_one_token(model, batch, generation_kwargs, pad_id, eos_ids, synced_gpus, context=None):
    """A degenerate sampler: every completion is one token, 40 times."""
    prompts = on_policy.prompts_of(batch)
    completions = [torch.full((40,), 37, dtype=prompts[0].dtype) for _ in prompts]
    return on_policy.completion_batch(prompts, completions, pad_id), completions


@pytest.mark.parametrize("bound", ["repetition", "entropy"])
def test_a_collapsed_on_policy_run_stops_after_its_patience_with_the_numbers(tiny_pair, tmp_path, monkeypatch,
                                                                              bound):
    if bound == "repetition":
        monkeypatch.setattr(on_policy, "sample_completions", repeat_one_token)
        overrides = {}
    else:  # the real sampler, and an entropy bound no tiny student stays above
        overrides = {"collapse_min_entropy": 100.0, "max_new_tokens": 6}
    trainer = make_trainer(tiny_pair, tmp_path, lmbda=1.0, save_strategy="no", collapse_patience=2, **overrides)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert message.startswith("On-policy collapse: for 2 logging steps in a row up to step 2 the student's samples ")
    if bound == "repetition":
        assert "repeat themselves (generated_repetition_rate 0.973 > collapse_max_repetition 0.9)" in message
        assert logged(trainer.state.log_history, "generated_repetition_rate")[1] == pytest.approx(36 / 37)
    else:
        entropy = logged(trainer.state.log_history, "on_policy_student_entropy")
        assert f"have entropy {entropy[1]:.4f} < collapse_min_entropy 100.0" in message and 0 < entropy[1] < 100
    assert trainer.state.global_step == 2


def test_a_healthy_on_policy_run_logs_its_samples_and_no_guard_fires(tiny_pair, tmp_path, caplog):
    trainer = make_trainer(tiny_pair, tmp_path, lmbda=1.0, save_strategy="no", max_steps=3, max_new_tokens=8)
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h]
    assert len(log) == 3
    for entry in log:
        assert 0 <= entry["generated_repetition_rate"] < 0.9 and 0 <= entry["generated_eos_rate"] <= 1
        assert entry["on_policy_student_entropy"] > 1 and entry["on_policy_teacher_logprob"] < 0
        assert entry["on_policy_teacher_logprob"] == pytest.approx(-entry["teacher_ce"])  # every step on-policy


def test_a_teacher_worse_than_the_untrained_student_is_one_warning_at_the_first_step(tiny_pair, tmp_path, caplog):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"])
    with torch.no_grad():
        teacher.model.norm.weight.mul_(8.0)  # confidently random: far worse on the data than a near-uniform student
    teacher.save_pretrained(tmp_path / "peaked")
    with caplog.at_level(logging.WARNING, logger="trl_distill"):
        for name, margin in (("a", 0.0), ("b", 100.0)):
            make_trainer(tiny_pair, tmp_path / name, save_strategy="no", max_steps=2, teacher_ce_margin=margin,
                         teacher_model_name_or_path=str(tmp_path / "peaked")).train()
        make_trainer(tiny_pair, tmp_path / "c", save_strategy="no", max_steps=2, alpha=0.0,
                     teacher_model_name_or_path=str(tmp_path / "peaked")).train()  # CE only: the teacher is unused
        on_policy_run = make_trainer(tiny_pair, tmp_path / "d", save_strategy="no", max_steps=1, lmbda=1.0,
                                     max_new_tokens=8, teacher_model_name_or_path=str(tmp_path / "peaked"))
        on_policy_run.train()  # every row the student's own sample: nothing of the dataset to judge the teacher on
    assert logged(on_policy_run.state.log_history, "on_policy_teacher_logprob")[1] < 0  # the teacher did rate them
    warned = [r.getMessage() for r in caplog.records if "at the first step" in r.getMessage()]
    assert len(warned) == 1, warned  # the second run's margin (100 nats) lets it pass, the third trains no KD, the
    # fourth trains on the student's samples only (the check judges a teacher on the dataset's rows)
    ce = [float(x.rstrip(",:")) for x in warned[0].split() if x.rstrip(",:").replace(".", "").isdigit()][:2]
    assert ce[0] > ce[1] + 0.5, warned  # the teacher's CE, then the student's
    assert warned[0].endswith("A wrong teacher, or data it was not trained for? (teacher_ce_margin=0)")
