"""Reliability: bad input fails in seconds with the fix named; a crash costs at most the work since the last
complete checkpoint; no rank waits forever (uneven batches, a batch without loss tokens, NaN from the teacher)."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.runtime.checkpoints import MARKER, is_complete, mark_complete, resolve_resume
from trl_distill.testing import launch, logged, synthetic_prompt_completion

WORKER = Path(__file__).parents[1] / "scripts" / "reliability_worker.py"
ROOT = Path(__file__).parents[2]


def _read(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory) -> dict:
    """Each worker mode once; a failing launch records its output and how long it took to fail."""
    out = tmp_path_factory.mktemp("reliability")
    pair = str(Path(tiny_pair["teacher"]).parent)
    results = {"dir": out}
    for mode in ("reference", "crash", "crash_resume", "uneven", "empty_batch", "nan_teacher"):
        start = time.monotonic()
        try:
            launch(WORKER, pair, str(out), mode, timeout=240, own_launch=mode == "crash")  # it SIGKILLs rank 1
            results[mode] = _read(out / mode)
        except RuntimeError as failure:
            results[mode] = {"failed": str(failure), "seconds": time.monotonic() - start}
    return results


@pytest.mark.distributed
def test_kill_9_while_saving_then_resume_reproduces_the_uninterrupted_losses(runs):
    crashed = runs["crash"]
    assert "failed" in crashed  # rank 1 was SIGKILLed while writing checkpoint-6; torchrun stopped rank 0
    directory = runs["dir"] / "crash"
    # the killed run left checkpoint-6 half written; the resumed run skipped it, then wrote it again whole
    assert is_complete(directory / "checkpoint-4") and is_complete(directory / "checkpoint-6")
    reference, resumed = logged(runs["reference"][0]["log_history"]), logged(runs["crash_resume"][0]["log_history"])
    assert runs["crash_resume"][0]["global_step"] == 8
    for step in range(5, 9):  # computed again after resuming from checkpoint-4
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


def test_resume_skips_incomplete_checkpoints(tmp_path, caplog):
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * step)
    mark_complete(tmp_path / "checkpoint-2")
    mark_complete(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"x")  # truncated after the fact
    with caplog.at_level("WARNING", logger="trl_distill.runtime.checkpoints"):
        assert resolve_resume(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-4" in caplog.text and "checkpoint-6" in caplog.text
    with pytest.raises(ValueError, match="checkpoint-6' is incomplete.*newest complete one is .*checkpoint-2"):
        resolve_resume(str(tmp_path / "checkpoint-6"), str(tmp_path))
    assert not (tmp_path / "checkpoint-6" / MARKER).exists()


def test_checkpoints_without_markers_are_left_to_the_trainer(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    assert resolve_resume(True, str(tmp_path)) is None  # an empty one (no trainer_state.json) cannot resume: fresh
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    # written without trl_distill (no training_args.bin naming it): the Trainer's own choice, resumable
    assert resolve_resume(True, str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert resolve_resume(str(tmp_path / "checkpoint-3"), str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert resolve_resume(None, str(tmp_path)) is None


@pytest.mark.distributed
def test_uneven_batches_finish_on_every_rank(runs):
    ranks = runs["uneven"]
    assert [r["global_step"] for r in ranks] == [4, 4]  # 13 examples, 2 per rank: the last batch is padded
    assert all(r["all_finite"] for r in ranks)
    for key in ("eval_loss", "eval_kd_loss", "eval_ce_loss"):  # 5 examples over 2 ranks, gathered once each
        assert ranks[0]["eval"][key] == ranks[1]["eval"][key], key


@pytest.mark.distributed
def test_a_rank_without_loss_tokens_keeps_step_with_the_others(runs):
    ranks = runs["empty_batch"]
    assert [r["global_step"] for r in ranks] == [4, 4] and all(r["all_finite"] for r in ranks)


@pytest.mark.distributed
def test_nan_in_the_teacher_stops_every_rank_with_one_message(runs):
    failed = runs["nan_teacher"]
    assert "failed" in failed and failed["seconds"] < 120
    for rank in (0, 1):  # rank 0's teacher is fine; it stops too, with the same message
        assert (f"[rank{rank}]: trl_distill.runtime.validation.TeacherNotFiniteError: The teacher produced NaN or inf "
                "at step 3 (on 1 rank(s))") in failed["failed"]


@pytest.mark.distributed
def test_rank0_prints_both_effective_deepspeed_configs(tiny_pair, tmp_path):
    pair = str(Path(tiny_pair["teacher"]).parent)
    result = launch(WORKER, pair, str(tmp_path), "empty_batch", timeout=240)
    lines = {line.split(" DeepSpeed config: ")[0]: json.loads(line.split(" DeepSpeed config: ")[1])
             for line in result.stdout.splitlines() if " DeepSpeed config: " in line}
    assert set(lines) == {"trl_distill: student", "trl_distill: teacher"}  # once each: rank 0 only
    assert lines["trl_distill: student"]["zero_optimization"]["stage"] == 2
    assert lines["trl_distill: teacher"]["zero_optimization"]["stage"] == 3
    assert "auto" not in json.dumps(lines)


# ---- Bad input, one process: each fails before training with the fix named ----

def _config(tmp_path, **kwargs):
    return DistillationConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                              gradient_checkpointing=False, **kwargs)


def test_missing_teacher_path(tiny_pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="teacher_model: no model directory at './no/such/teacher'"):
        DistillationTrainer(tiny_pair["student"], "./no/such/teacher", args=_config(tmp_path),
                            train_dataset=synthetic_prompt_completion(4))


def test_tokenizer_mismatch(tiny_pair, tmp_path):
    teacher = tmp_path / "teacher"
    AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"]).save_pretrained(teacher)
    other = AutoTokenizer.from_pretrained(tiny_pair["student"])
    other.add_tokens(["<teacher-only>"])  # the teacher's tokenizer knows a token the student's does not
    other.save_pretrained(teacher)
    with pytest.raises(ValueError, match="Student and teacher tokenizers differ"):  # told not to distil across
        DistillationTrainer(tiny_pair["student"], str(teacher), args=_config(tmp_path, cross_tokenizer=False),
                            train_dataset=synthetic_prompt_completion(4))
    # by default another tokenizer means cross-tokenizer distillation; this one is not even the teacher's own
    with pytest.raises(ValueError, match="The teacher's tokenizer has 261 tokens but the teacher's lm_head only 260"):
        DistillationTrainer(tiny_pair["student"], str(teacher), args=_config(tmp_path),
                            train_dataset=synthetic_prompt_completion(4))


def test_empty_dataset(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="The train dataset is empty"):
        DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=_config(tmp_path),
                            train_dataset=synthetic_prompt_completion(4).select([]))


def test_every_completion_truncated_away(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="empty after preprocessing.*max_length=3"):
        DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=_config(tmp_path, max_length=3),
                            train_dataset=synthetic_prompt_completion(8))
    assert not (tmp_path / "out").exists()


def test_remote_code_is_off_for_both_models_unless_asked(tiny_pair, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    seen = []
    load = PreTrainedModel.from_pretrained.__func__

    def recording(cls, path, *args, **kwargs):  # every model class loads through here
        seen.append((os.path.basename(str(path)), kwargs.get("trust_remote_code", False)))
        return load(cls, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording))
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=_config(tmp_path, max_steps=1),
                                  train_dataset=synthetic_prompt_completion(4))
    trainer.get_train_dataloader()  # loads the teacher
    assert ("student", False) in seen and ("teacher", False) in seen


def test_saved_students_are_safetensors(tiny_pair, tmp_path):
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"],
                                  args=_config(tmp_path, max_steps=1, save_strategy="no"),
                                  train_dataset=synthetic_prompt_completion(4))
    trainer.train()
    trainer.save_model()
    files = {p.name for p in (tmp_path / "out").iterdir()} - {"training_args.bin"}  # the Trainer's, never read
    assert "model.safetensors" in files and not any(name.endswith((".bin", ".pt", ".pth")) for name in files)
    torch.testing.assert_close(
        AutoModelForCausalLM.from_pretrained(tmp_path / "out", use_safetensors=True).lm_head.weight,
        trainer.model.lm_head.weight,
    )


def test_student_deepspeed_config_without_micro_batch_is_filled(tmp_path):
    """DeepSpeed itself would stop with "Either train_batch_size or train_micro_batch_size_per_gpu needs to be
    provided"; the config fills both from the arguments (in a subprocess: it sets up a process group)."""
    import subprocess
    import sys

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2},}')  # trailing comma too
    script = (
        "from trl_distill import DistillationConfig\n"
        f"c = DistillationConfig(output_dir={str(tmp_path / 'o')!r}, deepspeed={str(tmp_path / 'ds.json')!r}, "
        "per_device_train_batch_size=3, gradient_accumulation_steps=2, bf16=False, report_to='none')\n"
        "d = c.hf_deepspeed_config.config\n"
        "print(d['train_micro_batch_size_per_gpu'], d['gradient_accumulation_steps'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["3", "2"], out.stderr[-2000:]
