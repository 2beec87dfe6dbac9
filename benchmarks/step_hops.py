"""A training step's hops, counted by running it (`tests/step_hops.py`): off-policy, on-policy with HF generate, and
on-policy with the student's rollouts from a real vLLM server (from .venv-vllm), each under a live teacher on one
process, tiny models. Prints each step's count and its hops; docs/architecture.md ("Hops, counted") quotes them.

    python benchmarks/step_hops.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from step_hops import StepHops, report  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_distill import DistillationConfig, DistillationTrainer  # noqa: E402
from trl_distill.testing import (  # noqa: E402
    build_tiny_model,
    build_tokenizer,
    save_tiny_pair,
    synthetic_prompt_completion,
    tiny_run_settings,
    vllm_server,
)

ON_POLICY = dict(lmbda=1.0, on_policy_objective="sampled_token", max_new_tokens=8, temperature=1.0)


def count(name: str, student, teacher: str, tokenizer, output_dir: str, **overrides) -> None:
    hops = StepHops()
    args = DistillationConfig(**tiny_run_settings(
        output_dir=output_dir, per_device_train_batch_size=4, save_strategy="no", use_cpu=True, max_steps=3,
        teacher_model_name_or_path=teacher, **overrides))
    DistillationTrainer(student, args=args, train_dataset=synthetic_prompt_completion(32), processing_class=tokenizer,
                        callbacks=[hops]).train()
    print(report(name, hops), flush=True)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="step_hops_"))
    pair = save_tiny_pair(tmp)
    tokenizer = AutoTokenizer.from_pretrained(pair["tokenizer"])
    count("off-policy", pair["student"], pair["teacher"], tokenizer, str(tmp / "off"))
    count("on-policy, HF generate", pair["student"], pair["teacher"], tokenizer, str(tmp / "hf"), **ON_POLICY)
    served = tmp / "rollout_student"  # vLLM's CPU attention refuses head_dim 16: a student it can serve
    student = build_tiny_model(build_tokenizer(), "student", seed=1, hidden_size=64, num_attention_heads=2)
    student.save_pretrained(served)
    build_tokenizer().save_pretrained(served)
    with vllm_server(served, name="student", rollout=True) as url:
        count("on-policy, vLLM rollouts", str(served), pair["teacher"], tokenizer, str(tmp / "vllm"), use_vllm=True,
              vllm_server_base_url=url, **ON_POLICY)


if __name__ == "__main__":
    main()
