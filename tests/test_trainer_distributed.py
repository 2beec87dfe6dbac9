"""2 processes, DeepSpeed on CPU: a ZeRO-2 student trained beside a ZeRO-3 teacher (tests/scripts/distill_worker.py).

Each test reads what every rank recorded; the runs happen once per session (see conftest.py).
"""

import json
from pathlib import Path

import pytest
import torch
from oracles import held_out_loss  # tests/ is on sys.path
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import LOSS_TYPES
from trl_distill.testing import launch, logged, synthetic_prompt_completion

pytestmark = pytest.mark.distributed


def test_world_size_two_without_setup_code(zero2_zero3_runs):
    for rec in zero2_zero3_runs["main"]:
        assert rec["world_size"] == 2 and rec["num_processes"] == 2


def test_teacher_partitioned_in_half_student_whole(zero2_zero3_runs):
    for rec in zero2_zero3_runs["main"]:
        share = rec["teacher_share_after_train"]
        assert share["held"] * 2 == share["total"]  # exactly half of the teacher's elements per rank
        # Only ZeRO-3's small persistent parameters (the norms, below the threshold) stay materialized
        assert share["materialized"] == share["persistent"] < 0.01 * share["total"]
        assert not rec["student_partitioned"]
        assert rec["student_numel"] == 37280  # the whole student on each rank
        assert not rec["teacher_requires_grad"]


def test_teacher_loaded_partitioned_with_zero_init(zero2_zero3_runs):
    """The teacher is loaded while its ZeRO-3 plugin is selected: `from_pretrained` returns it partitioned."""
    for rec in zero2_zero3_runs["main"]:
        load = rec["teacher_at_load"]
        assert load["zero3_flag"] and load["all_partitioned"]
        assert load["materialized"] == 0  # not a single full tensor on the rank right after loading
        # each rank read exactly its half of the checkpoint's bytes (trl_distill.zero3_loading), not all of it
        assert load["bytes_read"] * 2 == load["param_bytes"] > 0


def test_teacher_stays_partitioned_during_training(zero2_zero3_runs):
    """Pitfall 2: an engine built before `train()`'s free_memory() must survive it, still partitioned."""
    for rec in zero2_zero3_runs["main"]:
        assert rec["teacher_engine_kept"]  # prepared in evaluate(), reused by train()
        shares = rec["teacher_share_during_train"]
        assert len(shares) == 24
        assert all(s["held"] * 2 == s["total"] and s["materialized"] == s["persistent"] for s in shares)


def test_backward_runs_on_the_student_engine(zero2_zero3_runs):
    """Pitfall 1: `accelerator.backward` must reach the student's engine, never the teacher's."""
    for rec in zero2_zero3_runs["main"]:
        assert rec["backward_engine_is_student"] == [True] * 24


def test_student_plugin_selected_again(zero2_zero3_runs):
    """Pitfall 4 and 3: after the teacher is loaded and prepared, the student's plugin and config are back."""
    for rec in zero2_zero3_runs["main"]:
        assert rec["selected_plugin_is_student"]
        assert rec["zero3_flag_after_train"] is False
        assert rec["accelerator_config_stage"] == 2


def test_teacher_prepared_after_the_student_leaves_its_state(zero2_zero3_runs):
    """Pitfalls 1, 3, 4 with the order reversed: a teacher prepared once the student's engine exists keeps the
    backward engine, the config `save_model` reads and the model list the student's; a failing load selects
    the student's plugin again."""
    for rec in zero2_zero3_runs["main"]:
        assert rec["late_teacher_state_kept"] == [True, True, True]
        assert rec["late_teacher_share"]["held"] * 2 == rec["late_teacher_share"]["total"]
        assert rec["failed_load_raised"]
        assert rec["plugin_after_failed_load_is_student"] and rec["zero3_flag_after_failed_load"] is False
    assert "model.safetensors" in zero2_zero3_runs["main"][0]["late_save_files"]


def test_teacher_config_filled_from_the_same_arguments(zero2_zero3_runs):
    """Pitfall 5: the teacher's "auto" values come from the student's TrainingArguments and its own hidden size."""
    for rec in zero2_zero3_runs["main"]:
        cfg = rec["teacher_engine_config"]
        assert cfg == {
            "stage": 3,
            "micro_batch": 4,  # max(per_device_train_batch_size=2, per_device_eval_batch_size=4)
            "reduce_bucket_size": 64 * 64,  # the teacher's hidden size (64), not the student's (32)
            "prefetch": int(0.9 * 64 * 64),
            "has_optimizer": False,
        }


def test_training_loss_falls_and_ranks_see_disjoint_samples(zero2_zero3_runs):
    rank0, rank1 = zero2_zero3_runs["main"]
    losses = logged(rank0["log_history"])
    assert sorted(losses) == list(range(1, 25))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(20, 25)) / 5
    assert last < 0.85 * first
    # One epoch is 16 steps × 2 ranks × 2 samples = the 64 samples, each seen by exactly one rank
    epoch0 = [{tuple(s) for s in rec["seen"][:32]} for rec in (rank0, rank1)]
    assert len(epoch0[0]) == len(epoch0[1]) == 32
    assert not epoch0[0] & epoch0[1]


def test_kd_and_ce_logged_and_consistent(zero2_zero3_runs):
    log = zero2_zero3_runs["main"][0]["log_history"]
    loss, kd, ce = logged(log), logged(log, "kd_loss"), logged(log, "ce_loss")
    for step in loss:  # alpha = 0.5; kd_loss already includes the T² factor
        assert loss[step] == pytest.approx(0.5 * kd[step] + 0.5 * ce[step], rel=1e-5)
    assert logged(zero2_zero3_runs["main"][1]["log_history"]) == loss  # every rank logs the same value


def test_teacher_logits_match_plainly_loaded_teacher(zero2_zero3_runs):
    for rec in zero2_zero3_runs["main"]:
        assert not rec["plain_teacher_partitioned"]
        assert rec["teacher_logits_maxdiff"] < 1e-5
        assert rec["teacher_hidden_logits_maxdiff"] < 1e-5  # hidden states + gathered lm_head (the loss's path)


def test_checkpoint_holds_the_student_only(zero2_zero3_runs, tiny_pair):
    checkpoint = zero2_zero3_runs["dir"] / "main" / "checkpoint-8"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "trainer_state.json", "global_step8", "config.json"} <= files
    weights = load_file(checkpoint / "model.safetensors")
    student_keys = set(load_file(f"{tiny_pair['student']}/model.safetensors"))
    assert set(weights) == student_keys
    assert sum(t.numel() for t in weights.values()) == 37280
    # DeepSpeed's own engine checkpoint holds the student module, not the teacher
    states = torch.load(checkpoint / "global_step8" / "mp_rank_00_model_states.pt", weights_only=False)
    assert set(states["module"]) == student_keys
    shards = sorted(p.name for p in (checkpoint / "global_step8").iterdir())
    assert shards == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_saved_student_reloads_with_the_same_logits(zero2_zero3_runs):
    """Pitfall 3: `save_model` writes `model.safetensors` (the student's), and it reloads exactly."""
    rec = zero2_zero3_runs["main"][0]
    assert "model.safetensors" in rec["final_files"]
    assert rec["final_keys_match_student"]
    assert rec["reloaded_logits_maxdiff"] < 1e-6


def test_resume_reproduces_the_uninterrupted_run(zero2_zero3_runs):
    main, resumed = zero2_zero3_runs["main"][0], zero2_zero3_runs["resume"][0]
    for key in ("loss", "kd_loss", "ce_loss"):
        expected = logged(main["log_history"], key)
        got = {s: v for s, v in logged(resumed["log_history"], key).items() if s > 8}
        assert sorted(got) == list(range(9, 25))
        for step, value in got.items():
            assert value == pytest.approx(expected[step], abs=1e-6), (key, step)


def test_evaluate_before_and_after_train(zero2_zero3_runs):
    """Pitfall 6: evaluate() before train() with a ZeRO-2 student (the stock Trainer refuses it)."""
    for rec in zero2_zero3_runs["main"]:
        before, after = rec["eval_before"], rec["eval_after"]
        assert {"eval_loss", "eval_kd_loss", "eval_ce_loss"} <= set(before)
        assert after["eval_loss"] < before["eval_loss"]


def test_every_rank_runs_every_teacher_forward(zero2_zero3_runs):
    """Pitfall 7: rank 0's batch has no loss token; it still joins the teacher's ZeRO-3 gathers (else: hang)."""
    rank0, rank1 = zero2_zero3_runs["main"]
    assert rank0["no_token_batch_loss"] == 0.0
    assert rank1["no_token_batch_loss"] > 0.0


def test_each_divergence_trains(zero2_zero3_runs, tiny_pair):
    """With `loss_chunk_size=3` (several chunks per batch) the teacher's lm_head is gathered once per step.
    This run also sets `use_cpu=True`, which must give the same 2-process DeepSpeed setup."""
    for rec in zero2_zero3_runs["divergences"]:
        # one gather of the teacher's (partitioned) head per step; the loss finds it held
        assert [n for n in rec["lm_head_gathers"] if n] == [1] * len(LOSS_TYPES)
        assert len(rec["lm_head_gathers"]) == 2 * len(LOSS_TYPES)
        assert rec["world_size"] == 2
        assert rec["divergences_trained"] == list(LOSS_TYPES)
        losses = logged(rec["log_history"])
        assert len(losses) == len(LOSS_TYPES)
        assert all(0.0 < v < 10.0 for v in losses.values())
        assert rec["teacher_share_after_train"]["held"] * 2 == rec["teacher_share_after_train"]["total"]
    # The student the 6 steps left (one per divergence, saved at the last) beats the untrained one on held-out rows:
    # 0.5 T² KL(teacher ‖ student) + 0.5 CE measured 2.7934 -> 2.5291 (-0.264; CE 5.566 -> 5.029 carries it, the
    # random teacher being near-uniform at T = 2, KL ~0.02): assert half that improvement
    saved = zero2_zero3_runs["dir"] / "divergences" / f"checkpoint-{len(LOSS_TYPES)}"
    student, initial, teacher = (AutoModelForCausalLM.from_pretrained(p)
                                 for p in (saved, tiny_pair["student"], tiny_pair["teacher"]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    train_prompts = set(synthetic_prompt_completion(64)["prompt"])
    heldout = [r for r in synthetic_prompt_completion(24, seed=11) if r["prompt"] not in train_prompts][:16]
    before, after = (held_out_loss(m, teacher, tokenizer, heldout)["loss"] for m in (initial, student))
    assert len(heldout) == 16 and after < before - 0.13, (before, after)


def test_zero3_student_beside_zero3_teacher(zero2_zero3_runs):
    """Any student stage: a ZeRO-3 student (the loss gathers its lm_head inside its forward) computes the same
    losses as the ZeRO-2 student on the same data, evaluates before train() and saves a loadable model."""
    zero2 = logged(zero2_zero3_runs["main"][0]["log_history"])
    for rec in zero2_zero3_runs["zero3_student"]:
        assert rec["student_partitioned"]
        assert rec["teacher_share_after_train"]["held"] * 2 == rec["teacher_share_after_train"]["total"]
        assert "eval_loss" in rec["eval_before"]
        zero3 = logged(rec["log_history"])
        assert sorted(zero3) == list(range(1, 7))
        for step, value in zero3.items():
            assert value == pytest.approx(zero2[step], rel=1e-5), step
    assert "model.safetensors" in zero2_zero3_runs["zero3_student"][0]["final_files"]


def test_ddp_without_deepspeed(zero2_zero3_runs):
    """2 processes without DeepSpeed: DDP student, a plain frozen teacher on each rank, the same losses."""
    zero2 = logged(zero2_zero3_runs["main"][0]["log_history"])
    for rec in zero2_zero3_runs["ddp"]:
        assert rec["world_size"] == 2 and rec["teacher_is_plain"]
        assert rec["student_wrapper"] == "DistributedDataParallel"
        ddp = logged(rec["log_history"])
        assert sorted(ddp) == list(range(1, 7))
        for step, value in ddp.items():
            assert value == pytest.approx(zero2[step], rel=1e-5), step


def test_accelerate_launch_use_deepspeed(tiny_pair, tmp_path):
    """`accelerate launch --use_deepspeed` on a machine without GPU: world size 2, no setup code in the script."""
    script = Path(__file__).parent / "scripts" / "accelerate_worker.py"
    pair = str(Path(tiny_pair["teacher"]).parent)
    launch(script, pair, str(tmp_path), launcher="accelerate", launcher_args=("--use_deepspeed", "--zero_stage=2"))
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["world_size"] == 2 and rec["student_stage"] == 2
        assert rec["teacher_held"] * 2 == rec["teacher_total"]
        assert len(rec["losses"]) == 3
