"""2-process on-policy distillation (lmbda=1) with the student's rollouts from a real vLLM server, a ZeRO-3 teacher
beside the student. Records per rank the first step's sampled rows and the logs into ``<out>/<mode>/rank<k>.json``.

    engine_rollout_worker.py STUDENT TEACHER OUT URL GROUP_PORT zero2|zero3_student|lora|served|self|cross

TEACHER is a directory (mode cross: one with another tokenizer), or (mode served) the URL of a vLLM server of the
teacher; mode self ignores it (a LoRA student, adapters starting at zero, distilled from its own base).
"""

import os
import sys

import torch

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(ROOT, "configs", "deepspeed")


def main():
    student, teacher, out, url, port, mode = sys.argv[1:7]
    rank = int(os.environ["RANK"])
    served = {"teacher_server": teacher, "temperature": 1.0, "max_length": 64} if mode == "served" else {}
    config = DistillationConfig(
        output_dir=os.path.join(out, mode), lmbda=1.0, use_vllm=True, vllm_server_base_url=url,
        vllm_group_port=int(port), vllm_server_timeout=120, max_new_tokens=6,
        deepspeed=os.path.join(DEEPSPEED, "zero3_student.json" if mode == "zero3_student" else "zero2_student.json"),
        teacher_deepspeed=os.path.join(DEEPSPEED, "zero3_teacher.json"),
        **tiny_run_settings(max_steps=3, per_device_train_batch_size=2, save_strategy="steps", save_steps=2,
                            **served),
    )
    peft = None
    if mode in ("lora", "self"):
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=mode == "self")
    trainer = DistillationTrainer(student, None if served else "self" if mode == "self" else teacher, args=config,
                                  train_dataset=synthetic_prompt_completion(32), peft_config=peft)
    record = {"sampled": {}, "versions": []}
    engine, sample = trainer.sampler.engine, trainer.sampler.sample

    def recording(source, batch):
        new, completions = sample(source, batch)
        record["sampled"][str(trainer.state.global_step + 1)] = {
            "input_ids": new["input_ids"].tolist(), "attention_mask": new["attention_mask"].tolist(),
            "labels": new["labels"].tolist()}
        if "cross_tokenizer_batch" in new:  # the teacher's ids and the aligned groups of the sampled rows
            teacher_ids, teacher_mask, groups, _ = new["cross_tokenizer_batch"]
            record["sampled"][str(trainer.state.global_step + 1)].update(
                teacher_ids=teacher_ids.tolist(), teacher_mask=teacher_mask.tolist(), groups=groups.tolist())
        if rank == 0:
            record["versions"].append(engine.client.weight_version())
        return new, completions

    trainer.sampler.sample = recording
    trainer.train()
    record.update(rank=rank, log_history=trainer.state.log_history)
    write_rank_record(os.path.join(out, mode), rank, record)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
