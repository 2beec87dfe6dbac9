"""One contender of benchmarks/on_policy.py on 2 processes: on-policy KD (lmbda = 1), ZeRO-2 student + ZeRO-3
teacher, completions sampled by the student's HF `generate` ("hf") or by the rollout server ("vllm"). Records per
rank the end time of every optimizer step and the seconds spent sampling and syncing in each.

    on_policy_worker.py SPEC_JSON
"""

import json
import os
import sys
import time

import torch

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, write_rank_record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, step_timer  # noqa: E402


def main():
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    engine = spec["contender"] == "vllm"
    args = DistillationConfig(
        output_dir=spec["out"], lmbda=1.0, max_new_tokens=spec["new_tokens"], max_steps=spec["steps"],
        per_device_train_batch_size=spec["rows_per_rank"], learning_rate=1e-4, save_strategy="no",
        logging_steps=1, report_to="none", disable_tqdm=True, bf16=False, gradient_checkpointing=False, seed=0,
        deepspeed=str(ROOT / "configs/deepspeed/zero2_student.json"),
        teacher_deepspeed=str(ROOT / "configs/deepspeed/zero3_teacher.json"),
        use_vllm=engine, vllm_server_base_url=spec.get("url"), vllm_group_port=spec.get("group_port", 51216))
    trainer = DistillationTrainer(spec["student"], spec["teacher"], args=args,
                                  train_dataset=synthetic_prompt_completion(256))
    timer = step_timer()
    trainer.add_callback(timer)
    spent = {"sample": [], "sync": []}
    sample = trainer.sampler.sample

    def timed_sample(source, batch):
        started = time.perf_counter()
        sync_before = trainer.sampler.engine.seconds["sync"] if engine else 0.0
        new, completions = sample(source, batch)
        sync = (trainer.sampler.engine.seconds["sync"] if engine else 0.0) - sync_before
        spent["sample"].append(time.perf_counter() - started - sync)
        spent["sync"].append(sync)
        spent.setdefault("tokens", []).append(sum(len(c) for c in completions))
        return new, completions

    trainer.sampler.sample = timed_sample
    started = time.perf_counter()
    trainer.train()
    write_rank_record(spec["out"], rank, {"start": started, "ends": timer.ends, **spent})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
