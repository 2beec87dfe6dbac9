"""A 2-process LoRA-student run (ZeRO-2 student) that records what each rank holds into ``<out>/<mode>/rank<k>.json``.

    lora_worker.py STUDENT_DIR OUT MODE [CHECKPOINT]

Modes: ``base_teacher`` (the teacher is the student's base loaded again from disk, ZeRO-3 partitioned; 8 steps,
checkpoints every 4); ``resume`` (``base_teacher`` resumed from CHECKPOINT); ``self`` (teacher 'self': the
student's base with its adapters disabled).
"""

import os
import resource
import sys

import torch
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def param_bytes(params) -> int:
    total = 0
    for p in params:
        held = p.ds_tensor if hasattr(p, "ds_tensor") else p
        total += held.numel() * held.element_size()
    return total


class HeadGradRecorder(TrainerCallback):
    """Whether the frozen lm_head ever got a gradient buffer, checked right after each backward."""

    def __init__(self, trainer, rec):
        self.trainer, self.rec = trainer, rec

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        head = self.trainer.model.get_base_model().get_output_embeddings()
        self.rec.setdefault("lm_head_grad_is_none", []).append(head.weight.grad is None)


def main():
    student, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    out = os.path.join(out, mode)
    tok = AutoTokenizer.from_pretrained(student)
    config = DistillationConfig(
        output_dir=out,
        deepspeed=os.path.join(ROOT, "configs", "deepspeed", "zero2_student.json"),
        teacher_model_name_or_path="self" if mode == "self" else student,
        **tiny_run_settings(max_steps=8, per_device_train_batch_size=2, save_strategy="steps", save_steps=4,
                            learning_rate=5e-3),
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DistillationTrainer(
        student, args=config, train_dataset=synthetic_prompt_completion(64), processing_class=tok, peft_config=lora
    )
    rec = {"rank": trainer.accelerator.process_index}
    trainer.add_callback(HeadGradRecorder(trainer, rec))
    trainer.train(resume_from_checkpoint=sys.argv[4] if mode == "resume" else None)
    base = trainer.model.get_base_model()
    teacher = trainer.teacher.module
    rec.update(
        log_history=trainer.state.log_history,
        student_param_bytes=param_bytes(p for n, p in base.named_parameters() if "lora_" not in n),
        adapter_param_bytes=param_bytes(p for n, p in base.named_parameters() if "lora_" in n),
        teacher_param_bytes=0 if teacher is base else param_bytes(teacher.parameters()),
        teacher_is_student_base=teacher is base,
        teacher_shares_student_storage=all(
            t.data_ptr() == s.data_ptr() for t, s in zip(teacher.parameters(), base.parameters())
        ),
        trainable=sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    trainer.accelerator.wait_for_everyone()
    write_rank_record(out, rec["rank"], rec)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
