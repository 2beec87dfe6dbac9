"""Distil into a LoRA student: only the adapters train, the teacher stays frozen (and partitioned), checkpoints hold
the adapter only, and `trl-distill merge` folds it into a plain model at the end.

    torchrun --nproc_per_node 2 examples/lora_student.py --student STUDENT_DIR --teacher TEACHER_DIR --output_dir OUT
    torchrun --nproc_per_node 2 examples/lora_student.py --student STUDENT_DIR --teacher self --output_dir OUT

`--teacher self` is self-distillation: the teacher is the student's own base model with its adapters disabled
(no second copy of the weights). The same run from the CLI: `configs/recipes/lora_student.yaml`.
"""

import argparse
import os

from datasets import load_dataset
from peft import LoraConfig

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.model.merge import merge_adapter

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "configs", "deepspeed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True, help="a model directory or hub id, or 'self'")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--no_deepspeed", action="store_true", help="plain PyTorch (one process or DDP)")
    args = parser.parse_args()

    deepspeed = None if args.no_deepspeed else os.path.join(CONFIGS, "zero2_student.json")
    config = DistillationConfig(
        output_dir=args.output_dir,
        deepspeed=deepspeed,
        teacher_deepspeed=None if deepspeed is None or args.teacher == "self" else os.path.join(
            CONFIGS, "zero3_teacher.json"),
        divergence="forward_kl",
        alpha=0.5,
        max_length=128,
        per_device_train_batch_size=8,
        max_steps=args.max_steps,
        learning_rate=1e-3,  # LoRA usually wants a larger rate than full fine-tuning
        logging_steps=10,
        save_steps=max(args.max_steps // 2, 1),
        gradient_checkpointing=False,
        report_to="none",
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    corpus = os.path.join(HERE, "data", "python_reference", "train.jsonl")
    trainer = DistillationTrainer(
        args.student, args.teacher, args=config, peft_config=lora,
        train_dataset=load_dataset("json", data_files=corpus, split="train").select_columns("text"),
    )
    trainer.train()
    trainer.save_model()  # adapter_model.safetensors + adapter_config.json
    if trainer.accelerator.is_main_process:
        merged = merge_adapter(args.output_dir, os.path.join(args.output_dir, "merged"))
        print(f"adapter in {args.output_dir}; merged model in {merged}")


if __name__ == "__main__":
    main()
