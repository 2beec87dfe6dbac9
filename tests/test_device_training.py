"""Whole training steps on a (simulated) GPU: the trainer built with its device the simulator's (tests/device_sim.py),
so the Trainer moves the student there and the teacher is prepared there, as on CUDA; every batch is prepared onto
it. Each step gives the loss and the logged metrics that the same step gives on the host: no `.numpy()` of a device
tensor, no op mixing the device with the host, anywhere on the path (collators, teachers, losses, metrics)."""

import contextlib

import pytest
import torch
from device_sim import DEVICE, on_device  # tests/ is on sys.path
from oracles import write_teacher_cache
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.teacher.capabilities import StepHooks
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings


def one_step(tmp_path, monkeypatch, on: bool, data, tokenizer, student, **overrides) -> tuple[float, dict]:
    """One training step of a fresh trainer over the first 4 rows (on the device when `on`): its loss and logs."""
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / f"out_{on}"), per_device_train_batch_size=4, save_strategy="no", use_cpu=True,
        max_steps=1, log_distill_metrics=True, **overrides))
    with monkeypatch.context() as patch:
        if on:  # the run's device (`TrainingArguments.device`): where the Trainer puts the models and batches
            patch.setattr(DistillationConfig, "device", property(lambda self: DEVICE))
        with on_device() if on else contextlib.nullcontext():
            trainer = DistillationTrainer(student, args=args, train_dataset=data, processing_class=tokenizer)
            trainer.prepare_teacher()
            assert next(trainer.model.parameters()).device == (DEVICE if on else torch.device("cpu"))
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1
            raw = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
            if (hooks := trainer.teacher.capability(StepHooks)) is not None:  # as get_batch_samples asks it
                hooks.before_step([raw])
            torch.manual_seed(0)
            loss = trainer.training_step(trainer.model, raw).item()
            logs = {}
            trainer.metrics.log_into(logs)
            trainer.teacher.release()
    return loss, logs


def on_both(tmp_path, monkeypatch, data, tokenizer, student, **overrides):
    host = one_step(tmp_path, monkeypatch, False, data, tokenizer, student, **overrides)
    device = one_step(tmp_path, monkeypatch, True, data, tokenizer, student, **overrides)
    return host, device


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])


def test_a_live_teacher_step_with_its_metrics(tiny_pair, tokenizer, tmp_path, monkeypatch):
    (loss, logs), device = on_both(tmp_path, monkeypatch, synthetic_prompt_completion(8), tokenizer,
                                   tiny_pair["student"], teacher_model_name_or_path=tiny_pair["teacher"])
    assert logs["kl_teacher_student"] > 0 and "top1_agreement" in logs
    assert device[0] == pytest.approx(loss, rel=1e-6) and device[1] == pytest.approx(logs, rel=1e-5)


def test_the_sampled_token_objective_on_policy_across_tokenizers(tiny_pair, other_teacher, tokenizer, tmp_path,
                                                                 monkeypatch):
    """The student samples on the device (HF generate), the teacher of another tokenizer reads its re-rendering,
    the discounted sampled-token loss runs."""
    (loss, logs), device = on_both(tmp_path, monkeypatch, synthetic_prompt_completion(8), tokenizer,
                                   tiny_pair["student"], teacher_model_name_or_path=other_teacher, lmbda=1.0,
                                   max_new_tokens=4, on_policy_objective="sampled_token", temperature=1.0,
                                   sampled_token_discount=0.5)
    assert logs["aligned_token_share"] > 0 and "on_policy_teacher_logprob" in logs
    assert device[0] == pytest.approx(loss, rel=1e-6) and device[1] == pytest.approx(logs, rel=1e-5)


def test_two_routed_teachers(tiny_pair, second_teacher, tokenizer, tmp_path, monkeypatch):
    data = synthetic_prompt_completion(8).add_column("teacher", ["a", "b"] * 4)
    (loss, logs), device = on_both(tmp_path, monkeypatch, data, tokenizer, tiny_pair["student"],
                                   teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"])
    assert logs["kd_loss/a"] > 0 and logs["kd_loss/b"] > 0
    assert device[0] == pytest.approx(loss, rel=1e-6) and device[1] == pytest.approx(logs, rel=1e-5)


def test_a_teacher_cache_written_on_the_device_trains_as_one_written_on_the_host(tiny_pair, tokenizer, tmp_path,
                                                                               monkeypatch):
    """`cache-teacher` with the teacher on the device (its top-k read back to the host), then a step from it."""
    data = synthetic_prompt_completion(8)
    for on in (False, True):
        args = DistillationConfig(**tiny_run_settings(
            output_dir=str(tmp_path / f"writer_{on}"), per_device_train_batch_size=4, save_strategy="no", use_cpu=True,
            max_steps=1, teacher_model_name_or_path=tiny_pair["teacher"]))
        with monkeypatch.context() as patch:
            if on:
                patch.setattr(DistillationConfig, "device", property(lambda self: DEVICE))
            with on_device() if on else contextlib.nullcontext():
                writer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=data,
                                             processing_class=tokenizer)
                write_teacher_cache(writer, str(tmp_path / f"cache_{on}"), top_k=16, shard_rows=4, batch_size=3)
    (loss, logs), device = [one_step(tmp_path, monkeypatch, on, data, tokenizer, tiny_pair["student"],
                                     teacher_cache=str(tmp_path / f"cache_{on}")) for on in (False, True)]
    assert logs["kd_loss"] > 0
    assert device[0] == pytest.approx(loss, rel=1e-6) and device[1] == pytest.approx(logs, rel=1e-5)
