"""A 2-process run (ZeRO-2 student, ZeRO-3 teacher) in fp32 or bf16, whose teacher takes the exact logits path: its
logits multiplier (HyperCLOVAX's `logits_scaling`) is one the fused lm_head rebuild does not read. Writes
``<out>/<mode>/rank<k>.json``; rank 0 also records KD and CE of the first step computed from both models' own
`forward(...).logits` over every row (the first step sees them all: 2 ranks x 4 rows).

    python -m torch.distributed.run --nproc_per_node 2 precision_worker.py STUDENT_DIR TEACHER_DIR OUT fp32|bf16
"""

import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer, divergence
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepspeed")
ROWS, TEMPERATURE = 8, 2.0


@torch.no_grad()
def reference(student_dir, teacher_dir, batch) -> dict:
    student, teacher = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                        for d in (student_dir, teacher_dir))
    target = batch["labels"][:, 1:]
    mask = target != -100
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    s, t = student(**inputs).logits[:, :-1][mask], teacher(**inputs).logits[:, :-1][mask]
    kd = divergence(s, t, "forward_kl", temperature=TEMPERATURE).item() * TEMPERATURE**2
    return {"kd_loss": kd, "ce_loss": F.cross_entropy(s, target[mask]).item()}


def main():
    student_dir, teacher_dir, out, mode = sys.argv[1:5]
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    args = DistillationConfig(
        output_dir=os.path.join(out, mode), deepspeed=os.path.join(CONFIGS, "zero2_student.json"),
        teacher_deepspeed=os.path.join(CONFIGS, "zero3_teacher.json"),
        **tiny_run_settings(max_steps=3, per_device_train_batch_size=ROWS // 2, temperature=TEMPERATURE,
                            alpha=0.5, bf16=mode == "bf16"),
    )
    data = synthetic_prompt_completion(ROWS, seed=5)
    trainer = DistillationTrainer(student_dir, teacher_dir, args=args, train_dataset=data, processing_class=tokenizer)
    rec = {}
    if trainer.accelerator.is_main_process:
        rec["reference"] = reference(student_dir, teacher_dir,
                                     trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)]))
    trainer.train()
    rec["log_history"] = trainer.state.log_history
    rec["paths"] = {p.name: p.exact for p in trainer.logit_paths}
    rec["student_dtype"] = str(next(trainer.model_wrapped.parameters()).dtype)
    rec["teacher_dtype"] = str(next(trainer.teacher.module.parameters()).ds_tensor.dtype)
    rec["teacher_share"] = sum(p.ds_tensor.numel() for p in trainer.teacher.module.parameters()) / sum(
        p.ds_numel for p in trainer.teacher.module.parameters())
    rank = trainer.accelerator.process_index
    write_rank_record(os.path.join(out, mode), rank, rec)


if __name__ == "__main__":
    main()
