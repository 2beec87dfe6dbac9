"""2 processes on CPU (gloo): an FSDP2 student (accelerate's `fsdp_version: 2`) beside a teacher sharded with FSDP2 on
its own (tests/scripts/fsdp2_worker.py), against the one-process run on the same rows."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import launch, logged, read_rank_records, synthetic_prompt_completion

pytestmark = pytest.mark.distributed
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from fsdp2_worker import settings  # noqa: E402


@pytest.fixture(scope="module")
def fsdp2_runs(tiny_pair, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2")
    pair = str(Path(tiny_pair["teacher"]).parent)
    worker = SCRIPTS / "fsdp2_worker.py"
    launch(worker, pair, str(out), "main", timeout=400)
    with pytest.raises(RuntimeError, match="exitcode  : -9"):  # a rank killed: its own launch, not the shared ranks
        launch(worker, pair, str(out), "killed", timeout=300, own_launch=True)
    launch(worker, pair, str(out), "resume", timeout=300)
    launch(worker, pair, str(out), "lora", timeout=300)
    runs = {mode: read_rank_records(out / mode) for mode in ("main", "resume", "lora")}
    runs["dir"], runs["pair"] = out, pair
    return runs


@pytest.fixture(scope="module")
def one_process(fsdp2_runs) -> list[dict]:
    """The same rows on one process, without FSDP: a batch of 4 is the two ranks' 2 + 2."""
    pair = fsdp2_runs["pair"]
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    args = DistillationConfig(**{**settings(str(fsdp2_runs["dir"]), "single"), "per_device_train_batch_size": 4,
                                 "save_strategy": "no"})
    trainer = DistillationTrainer(model=os.path.join(pair, "student"), teacher_model=os.path.join(pair, "teacher"),
                                  args=args, train_dataset=synthetic_prompt_completion(64), processing_class=tokenizer)
    trainer.train()
    return trainer.state.log_history


def test_losses_equal_the_one_process_run(fsdp2_runs, one_process):
    for rank in fsdp2_runs["main"]:
        assert rank["is_fsdp2"]
        for key in ("loss", "kd_loss", "ce_loss"):
            expected, got = logged(one_process, key), logged(rank["log_history"], key)
            assert sorted(got) == list(range(1, 7)), key
            for step, value in got.items():
                assert value == pytest.approx(expected[step], abs=1e-5), (key, step)


def test_teacher_and_student_each_hold_half_on_each_rank(fsdp2_runs):
    for rank in fsdp2_runs["main"]:
        for model in ("student", "teacher"):
            share = rank[model]
            assert share["all_sharded"], model
            assert share["held"] == share["total"] // 2, (model, share)  # every dim 0 of the tiny models is even
        assert all(step == rank["teacher"] for step in rank["teacher_during_train"])  # sharded at every step
        assert not rank["teacher_root_gathered"]  # its root group is freed once the step's losses are done


def test_each_rank_read_only_its_rows_of_the_teacher(fsdp2_runs):
    ranks = fsdp2_runs["main"]
    total = ranks[0]["teacher"]["total"]  # fp32 on disk and in memory
    assert [r["teacher_bytes_read"] for r in ranks] == [total // 2, total // 2]


def test_resume_after_a_kill_reproduces_the_uninterrupted_run(fsdp2_runs):
    """Rank 1 was killed at the end of step 4; `resume_from_checkpoint=True` finds checkpoint-3 and steps 4-6 give the
    uninterrupted run's losses."""
    main, resumed = fsdp2_runs["main"][0], fsdp2_runs["resume"][0]
    assert resumed["checkpoints_found"] == ["checkpoint-3"]  # what the kill left
    for key in ("loss", "kd_loss", "ce_loss"):
        expected = logged(main["log_history"], key)
        got = {s: v for s, v in logged(resumed["log_history"], key).items() if s > 3}
        assert sorted(got) == [4, 5, 6]
        for step, value in got.items():
            assert value == pytest.approx(expected[step], abs=1e-6), (key, step)


def test_evaluates_during_and_after_training_and_refuses_before_in_one_line(fsdp2_runs):
    for rank in fsdp2_runs["main"]:
        evals = logged(rank["log_history"], "eval_loss")
        assert sorted(evals) == [3, 6] and evals[6] < evals[3]
        assert rank["eval_after"]["eval_loss"] == pytest.approx(evals[6], abs=1e-6)
        assert rank["eval_before_refused"].startswith("evaluate() before train() with an FSDP2 student")
        assert "\n" not in rank["eval_before_refused"]
    assert fsdp2_runs["main"][0]["eval_after"]["eval_loss"] == fsdp2_runs["main"][1]["eval_after"]["eval_loss"]


def test_saved_student_loads_with_from_pretrained_and_gives_the_trained_logits(fsdp2_runs):
    """Checkpoints in FSDP2's sharded form (SHARDED_STATE_DICT: torch.distributed.checkpoint directories); save_model
    writes the student whole (with that type the stock Trainer's save_model writes nothing)."""
    final = fsdp2_runs["dir"] / "main" / "final"
    checkpoint = fsdp2_runs["dir"] / "main" / "checkpoint-3"
    assert (checkpoint / "trl_distill_complete.json").exists() and (checkpoint / "pytorch_model_fsdp_0").is_dir()
    assert not (checkpoint / "model.safetensors").exists() and (final / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    with torch.no_grad():
        logits = model(**tokenizer(["reverse: cat dog => dog cat"], return_tensors="pt")).logits[0, -1]
    assert torch.allclose(logits, torch.tensor(fsdp2_runs["main"][0]["final_logits"]), atol=1e-5)


def test_the_teacher_runs_once_per_optimizer_step(fsdp2_runs):
    """Gradient accumulation 2 (the LoRA run): the teacher's first layer runs, and so is gathered, once per optimizer
    step, as without accumulation (the main run). Step 1 adds the start-up logits check's two forwards (fused, own
    logits); step 4 the evaluation at the end of step 3 (one batch per rank)."""
    for mode in ("lora", "main"):
        for rank in fsdp2_runs[mode]:
            assert rank["teacher_layer_forwards"] == [1 + 2, 1, 1, 1 + 1, 1, 1], mode


def test_lora_on_fsdp2_saves_an_adapter_only_checkpoint(fsdp2_runs):
    """(In FSDP2's ZeRO-3-like mode, reshard_after_forward true, with accelerate's activation checkpointing, and
    gradient accumulation 2.)"""
    checkpoint = fsdp2_runs["dir"] / "lora" / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    state = torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=True)
    assert state and all(".lora_A." in name or ".lora_B." in name for name in state), sorted(state)
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    losses = logged(fsdp2_runs["lora"][0]["log_history"])
    assert losses == logged(fsdp2_runs["lora"][1]["log_history"]) and losses[6] < losses[1]


def test_the_planners_fsdp2_column_matches_what_each_rank_holds(fsdp2_runs):
    """`trl-distill plan`'s fsdp2 column (fp32, 1 node x 2) against the run: the teacher's and the student's 1/N, and
    the optimizer's moments on 1/N."""
    from trl_distill.runtime import plan

    pair = fsdp2_runs["pair"]
    student, teacher = (plan.load_spec(os.path.join(pair, name)) for name in ("student", "teacher"))
    settings = plan.Settings(nodes=1, gpus_per_node=2, dtype="fp32", micro_batch=2, seq_len=64)
    rows = plan.estimate(student, teacher, settings, **plan.CONFIGS["fsdp2"][1])
    for rank in fsdp2_runs["main"]:
        assert rows["teacher_params"] == rank["teacher"]["held"]
        assert rows["student_params"] == rank["student"]["held"] + rank["student"]["total"]  # 1/N + gathered
        assert rows["optimizer"] == rank["moment_bytes"]
