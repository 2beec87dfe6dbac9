"""2-process runs (ZeRO-2 student, ZeRO-3 teacher) that crash, stall or misbehave on purpose; each rank writes what
it saw to ``<out>/<run>/rank<k>.json``.

    reliability_worker.py PAIR_DIR OUT MODE

Modes: ``reference`` (8 steps, a checkpoint every 2); ``crash`` (the same, rank 1 SIGKILLs itself while writing
checkpoint-6); ``crash_resume`` (``resume_from_checkpoint=True`` in the crashed run's directory); ``uneven`` (13
examples, 2 per rank, one epoch, then evaluate 5); ``empty_batch`` (rank 1's second batch has no loss token);
``nan_teacher`` (the teacher's hidden states turn NaN on rank 1 at step 3).
"""

import math
import os
import signal
import sys

import torch
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings, write_rank_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(ROOT, "configs", "deepspeed")


def build(pair, out, run, dataset, **settings):
    config = DistillationConfig(
        output_dir=os.path.join(out, run),
        deepspeed=os.path.join(DEEPSPEED, "zero2_student.json"),
        teacher_deepspeed=os.path.join(DEEPSPEED, "zero3_teacher.json"),
        **tiny_run_settings(**{"per_device_train_batch_size": 2, **settings}),
    )
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    return DistillationTrainer(os.path.join(pair, "student"), os.path.join(pair, "teacher"), args=config,
                               train_dataset=dataset, processing_class=tok)


def crash_while_saving(trainer, at_step):
    """Rank 1 dies (SIGKILL, no cleanup) after the weights of checkpoint-`at_step` are written, before its
    optimizer shard is."""
    save = trainer._save_optimizer_and_scheduler

    def dying(output_dir):
        if trainer.state.global_step == at_step and trainer.accelerator.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return save(output_dir)

    trainer._save_optimizer_and_scheduler = dying


def mask_second_batch_on_rank1(trainer):
    collate, calls = trainer.data_collator, []

    def collator(features):
        batch = collate(features)
        calls.append(1)
        if trainer.accelerator.process_index == 1 and len(calls) == 2:
            batch["labels"][:] = -100
        return batch

    trainer.data_collator = collator


def nan_from_step(trainer, step):
    features = trainer.teacher.features

    def poisoned(inputs, positions=None):
        out = features(inputs, positions)
        if trainer.accelerator.process_index == 1 and trainer.state.global_step + 1 >= step:
            out = out._replace(states=out.states * float("nan"))
        return out

    trainer.teacher.features = poisoned


def main():
    pair, out, mode = sys.argv[1:4]
    data = synthetic_prompt_completion(64)
    checkpointing = dict(max_steps=8, save_strategy="steps", save_steps=2)
    if mode == "reference":
        trainer = build(pair, out, "reference", data, **checkpointing)
    elif mode in ("crash", "crash_resume"):
        trainer = build(pair, out, "crash", data, **checkpointing)
        if mode == "crash":
            crash_while_saving(trainer, at_step=6)
    elif mode == "uneven":
        trainer = build(pair, out, mode, data.select(range(13)), max_steps=-1, num_train_epochs=1)
    elif mode == "empty_batch":
        trainer = build(pair, out, mode, data, max_steps=4)
        mask_second_batch_on_rank1(trainer)
    elif mode == "nan_teacher":
        trainer = build(pair, out, mode, data, max_steps=6)
        nan_from_step(trainer, 3)
    else:
        raise ValueError(mode)
    trainer.train(resume_from_checkpoint=True if mode == "crash_resume" else None)
    rec = {"rank": trainer.accelerator.process_index, "log_history": trainer.state.log_history,
           "global_step": trainer.state.global_step}
    if mode == "uneven":
        rec["eval"] = trainer.evaluate(data.select(range(5)))
    losses = logged(trainer.state.log_history)
    rec["all_finite"] = all(math.isfinite(v) for v in losses.values())
    write_rank_record(os.path.join(out, mode), rec["rank"], rec)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
