"""The teacher once per optimizer step (`trl_distill.teacher.step_pass`): the same losses as once per micro-batch, one
all-gather of each teacher parameter per step instead of one per micro-batch, and the paths that keep the old way."""

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.rollout.sampling import DATASET, completion_source
from trl_distill.runtime import plan
from trl_distill.teacher.rows import DenseRows
from trl_distill.teacher.step_pass import TeacherStepPass, plain_rows, right_padded
from trl_distill.testing import (
    launch,
    logged,
    read_rank_records,
    synthetic_prompt_completion,
    tiny_run_settings,
    tokenized_with_unlabelled_batches,
)

WORKER = Path(__file__).parents[1] / "scripts" / "teacher_step_worker.py"
MODES = ("step", "micro_batch", "step_rows3")
KEYS = ("loss", "kd_loss", "ce_loss")


@pytest.fixture(scope="module")
def step_runs(tiny_pair, tmp_path_factory) -> dict:
    """2 processes, ZeRO-2 student + ZeRO-3 teacher, gradient accumulation 4, 4 optimizer steps, in three modes."""
    out = tmp_path_factory.mktemp("teacher_step")
    pair = str(Path(tiny_pair["teacher"]).parent)
    for mode in MODES:
        launch(WORKER, pair, str(out), mode, timeout=300)
    return {mode: read_rank_records(out / mode) for mode in MODES}


def assert_same_losses(run: list[dict], reference: list[dict], tolerance: float = 1e-6) -> None:
    for rec, ref in zip(run, reference, strict=True):
        for key in KEYS:
            got, want = logged(rec["log_history"], key), logged(ref["log_history"], key)
            assert sorted(got) == sorted(want) and len(got) >= 4, key
            for step in want:
                assert abs(got[step] - want[step]) <= tolerance, (key, step, got[step], want[step])


def test_same_losses_as_once_per_micro_batch_on_two_processes(step_runs):
    """Uneven lengths (right-padded per micro-batch, then to one length for the teacher) and a micro-batch with no
    loss token (every third one the collator builds) change no logged value beyond 1e-6."""
    for rec in step_runs["step"]:
        assert rec["forwards_ahead"] == 4 and rec["unlabelled_batches"] >= 5
    assert step_runs["micro_batch"][0]["forwards_ahead"] == 0
    assert_same_losses(step_runs["step"], step_runs["micro_batch"])
    assert_same_losses(step_runs["step_rows3"], step_runs["micro_batch"])  # 8 rows per rank, 3 per forward


def test_each_teacher_parameter_gathered_once_per_step(step_runs):
    """DeepSpeed's own fetches of each partitioned teacher parameter, per optimizer step (after the first, which
    also runs the logit check): 1 per step with the step pass, 4 per step (one per micro-batch) without, 3 with
    at most 3 rows per forward (8 rows per rank). The lm_head, gathered by the loss: once per step."""
    for mode, per_step in (("step", 1), ("micro_batch", 4), ("step_rows3", 3)):
        for rec in step_runs[mode]:
            persistent = set(rec["persistent"])
            assert len(rec["fetches_per_step"]) == 4
            for step in rec["fetches_per_step"][1:]:
                layers = {n: c for n, c in step.items() if ".layers." in n and n not in persistent}
                assert len(layers) == 4 * 7 and set(layers.values()) == {per_step}, (mode, layers)
                assert step["model.embed_tokens.weight"] == per_step
                assert step["lm_head.weight"] == (4 if mode == "micro_batch" else 1), mode


def test_plan_accounts_for_what_the_pass_holds(step_runs, tiny_pair):
    """`trl-distill plan`'s teacher_step row bounds what a rank holds through a step: the teacher's hidden states
    at the step's loss tokens (<= every token) and its lm_head, gathered once, whole."""
    teacher = plan.load_spec(tiny_pair["teacher"])
    for rec in step_runs["step"]:
        assert rec["head_released"] and len(rec["held"]) == 4
        for held in rec["held"]:
            settings = plan.Settings(gpus_per_node=2, dtype="fp32", micro_batch=2, seq_len=held["row_width"],
                                     gradient_accumulation=4)
            planned = plan.teacher_step_bytes(teacher, settings)
            assert held["head_gathered"] and held["head_bytes"] == teacher.vocab * teacher.hidden * 4
            assert 0 < held["states_bytes"] <= planned - held["head_bytes"]


# ---- one process, no DeepSpeed ----

def run(tiny_pair, tmp_path, **overrides) -> tuple[DistillationTrainer, dict]:
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    data, collate = tokenized_with_unlabelled_batches(tok, synthetic_prompt_completion(32))
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=4,
                                 gradient_accumulation_steps=4, save_strategy="no", use_cpu=True,
                                 remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    settings.update(overrides)
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                                  train_dataset=data, processing_class=tok, data_collator=collate)
    trainer.forwards_ahead = count_forwards_ahead(trainer)
    trainer.train()
    return trainer, {key: logged(trainer.state.log_history, key) for key in KEYS}


def count_forwards_ahead(trainer) -> list:
    """A list that gets one entry per teacher forward the once-per-step pass runs."""
    step_pass, forwards = trainer.teacher.step_pass, []
    run, features = step_pass.run, trainer.teacher.features

    def counted(batch_samples):
        trainer.teacher.features = lambda *a, **k: forwards.append(1) or features(*a, **k)
        try:
            run(batch_samples)
        finally:
            trainer.teacher.features = features

    step_pass.run = counted
    return forwards


def test_same_losses_without_deepspeed(tiny_pair, tmp_path):
    ahead, step_losses = run(tiny_pair, tmp_path / "step")
    per_micro_batch, micro_losses = run(tiny_pair, tmp_path / "micro", teacher_step_pass=False)
    assert len(ahead.forwards_ahead) == 4 and len(per_micro_batch.forwards_ahead) == 0
    assert not ahead.teacher.step_pass.queue  # nothing computed ahead outlives training
    for key in KEYS:
        assert len(step_losses[key]) == 4
        for step, value in micro_losses[key].items():
            assert abs(step_losses[key][step] - value) <= 1e-6, (key, step)


def test_sampled_steps_keep_the_per_micro_batch_path(tiny_pair, tmp_path):
    """With lmbda the teacher must see the sampled rows: those steps run it per micro-batch (after sampling), the
    dataset steps of the same run once per step."""
    trainer, _ = run(tiny_pair, tmp_path, lmbda=0.5, max_new_tokens=4, seed=3)
    dataset_steps = [completion_source(0.5, False, 3, step) == DATASET for step in range(4)]
    assert 0 < sum(dataset_steps) < 4  # this seed mixes both kinds
    assert len(trainer.forwards_ahead) == sum(dataset_steps)


def test_padding_free_batches_are_not_plain_rows():
    ids = torch.ones(1, 12, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(12)[None], "cu_seq_lens_q": torch.tensor(
        [0, 5, 12])}
    assert "cu_seq_lens_q" in plain_rows([batch])
    plain = {"input_ids": ids, "labels": ids, "attention_mask": ids}
    assert plain_rows([plain, {k: v[:, :7] for k, v in plain.items()}]) is None
    assert plain_rows([plain, {"input_ids": ids, "labels": ids}]) is not None  # keys differ


def test_right_padding_continues_positions_and_masks_the_rest():
    a = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]]),
         "position_ids": torch.tensor([[0, 1, 2]])}
    b = {"input_ids": torch.tensor([[8, 9, 10, 11, 12]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
         "position_ids": torch.tensor([[0, 1, 2, 3, 4]])}
    rows = right_padded([a, b], pad_id=3)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 10, 11, 12]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_rows_for_another_micro_batch_are_refused():
    class Stub:
        args = None

    step = TeacherStepPass(Stub(), None)
    step.queue.append((torch.tensor([[1, 2, 3]]), DenseRows(torch.zeros(2, 4), None, selected=True)))
    with pytest.raises(RuntimeError, match="teacher_step_pass=False"):
        step.take({"input_ids": torch.tensor([[1, 2, 4]])})
    assert not step.queue


def test_teacher_batch_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="teacher_batch_size must be a positive integer"):
        DistillationConfig(output_dir=str(tmp_path), teacher_batch_size=0)


def test_the_warning_names_why(tiny_pair, tmp_path, caplog):
    """Padding-free training (SFT's own collator) says once that the teacher runs per micro-batch, and trains."""
    tok = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                                 gradient_accumulation_steps=2, save_strategy="no", use_cpu=True, padding_free=True,
                                 max_length=None)
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                                  train_dataset=synthetic_prompt_completion(16), processing_class=tok)
    forwards = count_forwards_ahead(trainer)
    with caplog.at_level(logging.WARNING, logger="trl_distill.teacher.step_pass"):
        trainer.train()
    assert forwards == []
    told = [r.getMessage() for r in caplog.records if "once per micro-batch" in r.getMessage()]
    assert len(told) == 1 and "cu_seq_lens" in told[0]
