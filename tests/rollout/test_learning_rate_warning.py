"""On-policy runs above the learning rate docs/on_policy.md recommends (1e-4 LoRA, 5e-5 full fine-tuning) get one
warning naming it; others, and off-policy runs at any rate, none. (That a trainer logs it once, on rank 0, is checked
where a sampled-token run is built: tests/rollout/test_sampled_token_training.py.)"""

import re
from pathlib import Path

import pytest

from trl_distill.rollout.learning_rate import ON_POLICY_LEARNING_RATE, learning_rate_warning
from trl_distill.rollout.sampling import Sampling
from trl_distill.run_plan import OnPolicyPlan

DOC = (Path(__file__).parents[2] / "docs" / "on_policy.md").read_text()


def args(lmbda=1.0, learning_rate=2e-5, objective="divergence", seq_kd=False):
    """The run's on-policy plan and its learning rate."""
    return OnPolicyPlan(lmbda, seq_kd, Sampling(128, 1.0), objective, use_vllm=False, seed=42), learning_rate


@pytest.mark.parametrize("settings, lora, bound", [
    (args(learning_rate=3e-3), False, "5e-5"),  # our own experiments' rate
    (args(learning_rate=1e-3, objective="sampled_token"), False, "5e-5"),  # where the sampled-token objective fell
    (args(learning_rate=6e-5), False, "5e-5"),
    (args(learning_rate=2e-4, lmbda=0.5), True, "1e-4"),  # partly on-policy, LoRA
    (args(learning_rate=1e-3, objective="sampled_token"), True, "1e-4"),
])
def test_above_the_bound_one_line_names_it(settings, lora, bound):
    line = learning_rate_warning(*settings, lora)
    kind = "LoRA" if lora else "full fine-tuning"
    assert line is not None and "\n" not in line
    assert f"above the {bound} docs/on_policy.md recommends for {kind} (LoRA 1e-4, full fine-tuning 5e-5)" in line
    assert "lower --learning_rate" in line


@pytest.mark.parametrize("settings, lora", [
    (args(), False), (args(), True),  # the default, SFTConfig's 2e-5: under both bounds
    (args(learning_rate=5e-5), False), (args(learning_rate=1e-4), True),  # at the bound
    (args(learning_rate=5e-5), True),  # LoRA at the full bound
    (args(lmbda=0.0, learning_rate=3e-3), False),  # off-policy: the quickstart's rate is its own
    (args(lmbda=0.0, learning_rate=3e-3, seq_kd=True), True),  # the teacher's samples: not the student's own
])
def test_within_the_bound_or_off_policy_none(settings, lora):
    assert learning_rate_warning(*settings, lora) is None


def test_the_doc_states_the_bounds_the_warning_checks():
    section = DOC.split("**Learning rate.**", 1)[1].split("\n\n", 1)[0]
    assert ON_POLICY_LEARNING_RATE == {"LoRA": 1e-4, "full fine-tuning": 5e-5}
    assert re.search(r"≤ \*\*1e-4 with a LoRA student\*\*", section) and "≤ **5e-5 fully fine-tuned**" in section
