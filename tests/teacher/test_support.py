# ruff: noqa: E501  (the table of test names below is clearer one per line)
"""The support matrix (`trl_distill.teacher.support_matrix`, the README's table), cell by cell: every "refused" cell
is tried and gives its message; every "yes" cell names the test that runs it, and the runs no other test covers are
here, each asserting numbers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from peft import LoraConfig

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.teacher import support_matrix
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings

TESTS = Path(__file__).parents[1]
LORA = dict(r=4, target_modules=["q_proj", "v_proj"])

# The test that runs each "yes" cell (file::function).
YES = {
    ("live (ZeRO-3)", "off-policy"): "test_trainer_distributed.py::test_training_loss_falls_and_ranks_see_disjoint_samples",
    ("live (ZeRO-3)", "on-policy"): "rollout/test_on_policy.py::test_loss_on_a_generated_batch_equals_gkd_generalized_jsd",
    ("live (ZeRO-3)", "packing"): "teacher/test_teacher_step.py::test_the_warning_names_why",
    ("live (ZeRO-3)", "eval"): "test_trainer_distributed.py::test_evaluate_before_and_after_train",
    ("live (ZeRO-3)", "gradient accumulation"): "teacher/test_teacher_step.py::test_same_losses_as_once_per_micro_batch_on_two_processes",
    ("live (ZeRO-3)", "LoRA"): "test_lora.py::test_cli_trains_a_lora_student_beside_a_zero3_teacher_on_two_processes",
    ("live (ZeRO-3)", "cross-tokenizer"): "cross_tokenizer/test_cross_tokenizer_training.py::test_another_tokenizer_switches_on_by_itself_and_the_fused_kd_is_the_models_own",
    ("self", "off-policy"): "test_lora.py::test_self_distillation_shares_the_base_and_matches_a_separate_copy",
    ("self", "on-policy"): "teacher/test_support.py::test_self_on_policy_packing_eval_and_accumulation",
    ("self", "packing"): "teacher/test_support.py::test_self_on_policy_packing_eval_and_accumulation",
    ("self", "eval"): "teacher/test_support.py::test_self_on_policy_packing_eval_and_accumulation",
    ("self", "gradient accumulation"): "teacher/test_support.py::test_self_on_policy_packing_eval_and_accumulation",
    ("self", "LoRA"): "test_lora.py::test_self_distillation_shares_the_base_and_matches_a_separate_copy",
    ("cache", "off-policy"): "cache/test_teacher_cache.py::test_training_from_the_cache_follows_the_online_curve",
    ("cache", "gradient accumulation"): "teacher/test_served_training.py::test_accumulation_dataloader_workers_and_evaluation_against_the_live_server",
    ("cache", "LoRA"): "cache/test_teacher_cache.py::test_a_lora_student_from_the_cache_starts_where_the_full_student_does",
    ("served (vLLM)", "on-policy"): "rollout/test_engine_rollouts.py::test_a_served_teacher_scores_the_rollouts",
    ("served (vLLM)", "off-policy"): "teacher/test_served_training.py::test_students_from_either_cache_and_from_the_live_server_get_the_same_losses",
    ("served (vLLM)", "eval"): "teacher/test_served_training.py::test_accumulation_dataloader_workers_and_evaluation_against_the_live_server",
    ("served (vLLM)", "gradient accumulation"): "teacher/test_served_training.py::test_accumulation_dataloader_workers_and_evaluation_against_the_live_server",
    ("served (vLLM)", "LoRA"): "teacher/test_served_training.py::test_a_lora_student_against_the_server_starts_where_the_full_student_does",
    ("cross-tokenizer", "off-policy"): "cross_tokenizer/test_cross_tokenizer_training.py::test_another_tokenizer_switches_on_by_itself_and_the_fused_kd_is_the_models_own",
    ("cross-tokenizer", "on-policy"): "cross_tokenizer/test_sampled.py::test_an_on_policy_batch_is_scored_on_the_models_own_logits",
    ("cross-tokenizer", "eval"): "teacher/test_support.py::test_cross_tokenizer_evaluation_scores_the_first_training_step",
    ("cross-tokenizer", "gradient accumulation"): "cross_tokenizer/test_cross_tokenizer_training.py::test_two_processes_with_a_zero3_teacher_of_another_tokenizer",
    ("cross-tokenizer", "LoRA"): "cross_tokenizer/test_cross_tokenizer_training.py::test_a_lora_student_and_a_resumed_run_across_tokenizers",
    ("cross-tokenizer", "cross-tokenizer"): "cross_tokenizer/test_cross_tokenizer_training.py::test_another_tokenizer_switches_on_by_itself_and_the_fused_kd_is_the_models_own",
    ("live (ZeRO-3)", "sampled-token"): "rollout/test_sampled_token_training.py::test_each_step_is_the_formula_with_a_task_reward_and_two_routed_teachers",
    ("self", "sampled-token"): "rollout/test_sampled_token_training.py::test_self_distillation_under_the_sampled_token_objective",
    ("served (vLLM)", "sampled-token"): "rollout/test_sampled_token_training.py::test_a_served_teacher_is_asked_for_the_sampled_tokens_only",
    ("live (ZeRO-3)", "teacher-prompt"): "teacher/test_privileged.py::test_the_kd_is_the_teachers_reading_of_its_own_prompt_aligned_on_the_completion",
    ("served (vLLM)", "teacher-prompt"): "teacher/test_privileged.py::test_a_served_teacher_reads_its_own_prompt",
    ("cross-tokenizer", "sampled-token"): "rollout/test_sampled_token_training.py::test_a_teacher_of_another_tokenizer_scores_each_aligned_groups_text",
    ("cross-tokenizer", "teacher-prompt"): "cross_tokenizer/test_privileged_across.py::test_the_teacher_of_another_tokenizer_reads_its_own_prompt_and_the_same_completion",
}

# How to ask for each refused mode: the run's settings, and whether the trainer (not the config) refuses it.
MODE_SETTINGS = {"on-policy": dict(lmbda=0.5, max_new_tokens=4), "packing": dict(packing=True),
                 "cross-tokenizer": dict(cross_tokenizer=True), "eval": {},
                 "sampled-token": dict(lmbda=1.0, max_new_tokens=4, on_policy_objective="sampled_token",
                                       temperature=1.0),
                 "teacher-prompt": dict(teacher_prompt="{prompt}")}


def cells(value: str) -> list[tuple[str, str]]:
    return [(kind, mode) for kind, row in support_matrix().items() for mode, cell in row.items() if
            cell.startswith(value)]


def test_the_matrix_has_every_kind_and_mode_and_only_yes_or_refused():
    matrix = support_matrix()
    assert list(matrix) == ["live (ZeRO-3)", "self", "cache", "served (vLLM)", "cross-tokenizer"]
    assert all(cell == "yes" or cell.startswith("refused: ") for row in matrix.values() for cell in row.values())
    assert set(YES) == set(cells("yes"))


@pytest.mark.parametrize("cell", sorted(YES), ids=lambda cell: f"{cell[0]}-{cell[1]}")
def test_each_yes_cell_names_a_test_that_exists(cell):
    file, name = YES[cell].split("::")
    functions = {node.name for node in ast.walk(ast.parse((TESTS / file).read_text()))
                 if isinstance(node, ast.FunctionDef)}
    assert name in functions, YES[cell]


def kind_settings(kind: str, tiny_pair, other_teacher, tmp_path) -> tuple[dict, dict]:
    """``(config settings, trainer keyword arguments)`` that select `kind`."""
    if kind == "cache":
        return dict(teacher_cache=str(tmp_path / "no_cache_needed")), {}
    if kind == "served (vLLM)":
        return dict(teacher_server="http://127.0.0.1:9", temperature=1.0), {}
    if kind == "self":
        return dict(teacher_model_name_or_path="self"), dict(peft_config=LoraConfig(**LORA))
    if kind == "cross-tokenizer":
        return dict(teacher_model_name_or_path=other_teacher), {}
    return dict(teacher_model_name_or_path=tiny_pair["teacher"]), {}


@pytest.mark.parametrize("cell", cells("refused"), ids=lambda cell: f"{cell[0]}-{cell[1]}")
def test_each_refused_cell_gives_its_message(cell, tiny_pair, other_teacher, tmp_path):
    """Refused before anything is loaded, opened or asked: the cache directory does not exist and no server
    listens at the URL."""
    kind, mode = cell
    message = support_matrix()[kind][mode].removeprefix("refused: ")
    settings, trainer_kwargs = kind_settings(kind, tiny_pair, other_teacher, tmp_path)
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), max_steps=2, use_cpu=True, **settings,
                                 **MODE_SETTINGS[mode])
    data = synthetic_prompt_completion(8)
    with pytest.raises(ValueError) as error:
        args = DistillationConfig(**settings)
        eval_dataset = data if mode == "eval" else None
        DistillationTrainer(tiny_pair["student"], args=args, train_dataset=data, eval_dataset=eval_dataset,
                            **trainer_kwargs)
    assert str(error.value) == message
    assert not (tmp_path / "out").exists()


def self_run(tiny_pair, tmp_path, name, **overrides) -> DistillationTrainer:
    settings = dict(output_dir=str(tmp_path / name), teacher_model_name_or_path="self", per_device_train_batch_size=4,
                    max_steps=3, save_strategy="no", use_cpu=True)
    args = DistillationConfig(**tiny_run_settings(**{**settings, **overrides}))
    return DistillationTrainer(tiny_pair["student"], args=args, train_dataset=synthetic_prompt_completion(16),
                               eval_dataset=synthetic_prompt_completion(8, seed=1), peft_config=LoraConfig(**LORA))


def test_self_on_policy_packing_eval_and_accumulation(tiny_pair, tmp_path):
    """The 'self' teacher is the student with its LoRA adapters off, and LoRA starts as the identity (B = 0): the
    KD of the first step is exactly 0 in every mode (sampled completions, packed rows, accumulation 2, evaluation
    before training), and the adapters then move the student away from its base (KD > 0 after training)."""
    runs = {"on-policy": dict(lmbda=1.0, max_new_tokens=4), "packing": dict(packing=True, max_length=64),
            "gradient accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)}
    for mode, overrides in runs.items():
        trainer = self_run(tiny_pair, tmp_path, mode, **overrides)
        before = trainer.evaluate()["eval_kd_loss"]
        trainer.train()
        kd = logged(trainer.state.log_history, "kd_loss")
        assert abs(before) <= 1e-6 and abs(kd[1]) <= 1e-6, (mode, before, kd)
        assert trainer.evaluate()["eval_kd_loss"] > 1e-6, mode  # (measured: 8.6e-5 after 3 on-policy steps)
        if mode == "on-policy":
            history = [h for h in trainer.state.log_history if "loss" in h]
            assert [h["on_policy_fraction"] for h in history] == [1.0] * 3
            assert all(0 < h["generated_length"] <= 4 for h in history)


def test_cross_tokenizer_evaluation_scores_the_first_training_step(tiny_pair, other_teacher, tmp_path):
    """evaluate() before training, over the same 8 rows as the first (and only) training batch, gives that step's
    kd_loss and ce_loss (the student has not moved yet)."""
    data = synthetic_prompt_completion(8)
    args = DistillationConfig(**tiny_run_settings(
        output_dir=str(tmp_path / "out"), teacher_model_name_or_path=other_teacher, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, max_steps=1, save_strategy="no", use_cpu=True))
    trainer = DistillationTrainer(tiny_pair["student"], args=args, train_dataset=data, eval_dataset=data)
    scores = trainer.evaluate()
    trainer.train()
    kd, ce = logged(trainer.state.log_history, "kd_loss"), logged(trainer.state.log_history, "ce_loss")
    assert scores["eval_kd_loss"] > 0.01
    assert abs(scores["eval_kd_loss"] - kd[1]) <= 1e-5 and abs(scores["eval_ce_loss"] - ce[1]) <= 1e-5
