"""Launched with `accelerate launch --use_deepspeed` and no DeepSpeed argument in the script: records the world
size, the student's ZeRO stage and the teacher's share per rank into ``<out>/rank<k>.json``."""

import os
import sys

from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import logged, synthetic_prompt_completion, write_rank_record

pair, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
args = DistillationConfig(
    output_dir=out, per_device_train_batch_size=2, max_steps=3, logging_steps=1, save_strategy="no",
    bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True,
)
trainer = DistillationTrainer(
    os.path.join(pair, "student"), os.path.join(pair, "teacher"), args=args,
    train_dataset=synthetic_prompt_completion(16), processing_class=tok,
)
trainer.train()
params = list(trainer.teacher.module.parameters())
record = {
    "world_size": trainer.args.world_size,
    "student_stage": trainer.accelerator.state.get_deepspeed_plugin("student").zero_stage,
    "teacher_held": sum(p.ds_tensor.numel() for p in params),
    "teacher_total": sum(p.ds_numel for p in params),
    "losses": logged(trainer.state.log_history),
}
write_rank_record(out, trainer.args.process_index, record)
