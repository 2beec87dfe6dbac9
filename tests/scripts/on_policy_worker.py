"""2-process mixed distillation (lmbda=0.5 with seq_kd) with a ZeRO-2 student and a ZeRO-3 teacher; each rank
samples completions of a different length (3 vs 7 tokens), so the teacher's synced generation must wait for the
longer rank. Records per rank, for each step, the completions' source and length into ``<out>/<run>/rank<k>.json``.

    on_policy_worker.py PAIR_DIR OUT full|resume [CHECKPOINT]
"""

import os
import sys

import torch
from transformers import AutoTokenizer

import trl_distill.rollout.on_policy as on_policy_module
from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    pair, out, run = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    length = 3 if rank == 0 else 7
    sample = on_policy_module.sample_completions

    def exact_length(model, batch, kwargs, *args, **more):  # no early end of sequence: lengths differ by rank
        return sample(model, batch, {**kwargs, "min_new_tokens": length}, *args, **more)

    on_policy_module.sample_completions = exact_length
    config = DistillationConfig(
        output_dir=os.path.join(out, "full"),
        deepspeed=os.path.join(ROOT, "configs", "deepspeed", "zero2_student.json"),
        teacher_deepspeed=os.path.join(ROOT, "configs", "deepspeed", "zero3_teacher.json"),
        lmbda=0.5, seq_kd=True, max_new_tokens=length,
        **tiny_run_settings(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3),
    )
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    trainer = DistillationTrainer(os.path.join(pair, "student"), os.path.join(pair, "teacher"), args=config,
                                  train_dataset=synthetic_prompt_completion(32), processing_class=tok)
    rec = {"sources": {}, "lengths": {}}
    sample_step = trainer.sampler.sample

    def recording(source, batch):
        new, completions = sample_step(source, batch)
        step = str(trainer.state.global_step + 1)
        rec["sources"][step], rec["lengths"][step] = source, max(len(c) for c in completions)
        return new, completions

    trainer.sampler.sample = recording
    trainer.train(resume_from_checkpoint=sys.argv[4] if run == "resume" else None)
    rec.update(rank=rank, global_step=trainer.state.global_step, log_history=trainer.state.log_history)
    write_rank_record(os.path.join(out, run), rank, rec)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
