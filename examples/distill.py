"""Distil a teacher into a student with a ZeRO-2 student and a ZeRO-3 teacher.

    torchrun --nproc_per_node 2 examples/distill.py --teacher TEACHER_DIR --student STUDENT_DIR --output_dir OUT

Works the same under `accelerate launch --num_processes 2` and on a machine without GPU (DeepSpeed on CPU).
The dataset is the small prompt–completion task bundled in `trl_distill.testing`; pass your own with
`DistillationTrainer(train_dataset=...)`.
"""

import argparse
import json
import os

from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs", "deepspeed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--divergence", default="forward_kl")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    dataset = synthetic_prompt_completion(512, seed=0)
    config = DistillationConfig(
        output_dir=args.output_dir,
        deepspeed=os.path.join(CONFIGS, "zero2_student.json"),
        teacher_deepspeed=os.path.join(CONFIGS, "zero3_teacher.json"),
        divergence=args.divergence,
        alpha=1.0,
        temperature=1.0,
        per_device_train_batch_size=8,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=25,
        save_strategy="no",
        gradient_checkpointing=False,
        report_to="none",
    )
    trainer = DistillationTrainer(
        args.student, args.teacher, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        share = trainer.teacher.module
        held = sum(p.ds_tensor.numel() for p in share.parameters())
        total = sum(p.ds_numel for p in share.parameters())
        summary = {"teacher_share_per_rank": held / total, "log_history": trainer.state.log_history}
        with open(os.path.join(args.output_dir, "distill_summary.json"), "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
