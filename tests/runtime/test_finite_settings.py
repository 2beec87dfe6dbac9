"""A float setting that is NaN (or inf, where it bounds nothing) is refused as the config is built, in one line naming
it, instead of surfacing as a loss that is not finite with the advice to lower the learning rate; and so is an MoE
student's own router coefficient."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import build_tokenizer, synthetic_prompt_completion, tiny_run_settings

SAMPLED = dict(lmbda=1.0, temperature=1.0, on_policy_objective="sampled_token")


@pytest.mark.parametrize("name, value, extra", [
    ("router_aux_loss_coef", math.nan, {}),
    ("router_aux_loss_coef", math.inf, {}),
    ("temperature", math.inf, {}),
    ("alpha", math.nan, {}),
    ("beta", -math.inf, {}),
    ("task_reward_weight", math.nan, SAMPLED),
    ("sampled_token_kl_coef", math.inf, SAMPLED),
    ("epsilon", math.nan, SAMPLED),
    ("eval_temperature", math.nan, {}),
    ("collapse_min_entropy", math.inf, {}),
    ("cross_tokenizer_uld_weight", math.nan, {}),
    ("learning_rate", math.nan, {}),
    ("logging_steps", math.inf, {}),  # (was an OverflowError's traceback)
    ("teacher_server_timeout", math.nan, {}),
])
def test_a_non_finite_setting_is_one_line(tmp_path, name, value, extra):
    with pytest.raises(ValueError) as error:
        DistillationConfig(output_dir=str(tmp_path), report_to="none", **{**extra, name: value})
    text = str(error.value)
    assert text.startswith(f"{name} must be a finite number, got {value}: pass a number, or leave it at its default")
    assert "\n" not in text


@pytest.mark.parametrize("name", ["teacher_server_timeout", "vllm_server_timeout", "max_grad_norm",
                                  "teacher_ce_margin"])
def test_inf_stays_where_it_means_no_bound(tmp_path, name):
    assert getattr(DistillationConfig(output_dir=str(tmp_path), report_to="none", **{name: math.inf}), name) == math.inf


def test_an_moe_students_own_non_finite_router_coefficient_is_one_line(tmp_path):
    """Unset, the coefficient is the model's (its config.json): NaN there is named there."""
    tokenizer = build_tokenizer()
    config = AutoConfig.for_model("mixtral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=math.nan,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    student, teacher = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    args = DistillationConfig(output_dir=str(tmp_path / "out"), **tiny_run_settings(max_steps=1))
    with pytest.raises(ValueError, match=r"^The student's config.json sets router_aux_loss_coef=nan: pass a finite "
                                         r"--router_aux_loss_coef \(e.g. 0.001\), or 0.0"):
        DistillationTrainer(student, teacher, args=args, train_dataset=synthetic_prompt_completion(4),
                            processing_class=tokenizer)
    assert not (tmp_path / "out").exists()
