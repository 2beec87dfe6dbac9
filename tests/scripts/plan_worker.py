"""One training step of a 2-process DeepSpeed run (ZeRO-2 student, ZeRO-3 teacher, fp32) that records what each
rank really holds, for the memory planner's check (tests/runtime/test_plan.py). Writes ``<out>/rank<k>.json``.

Usage: ``plan_worker.py MODELS_DIR OUT_DIR`` where MODELS_DIR holds ``tokenizer/``, ``teacher/``, ``student/``.
"""

import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def held(trainer) -> dict:
    """Bytes this rank holds: the teacher's ZeRO-3 shard, the student's parameters, the ZeRO-2 optimizer state."""
    zero = trainer.model_wrapped.optimizer  # DeepSpeedZeroOptimizer
    moments = [s[k] for s in zero.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
    teacher = list(trainer.teacher.module.parameters())
    flat_ptrs = {t.untyped_storage().data_ptr() for t in zero.bit16_groups_flat}
    return {
        "teacher_shard_bytes": nbytes(p.ds_tensor for p in teacher),
        "teacher_total_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in teacher),
        # in fp32 the optimizer's "master" partition could alias the flat parameters; record whether it does
        "fp32_partition_aliases_params": any(
            t.untyped_storage().data_ptr() in flat_ptrs for t in zero.single_partition_of_fp32_groups
        ),
        "student_param_bytes": nbytes(trainer.model.parameters()),
        "student_flat_bytes": nbytes(zero.bit16_groups_flat),  # the flattened (padded) buffer params point into
        "fp32_partition_bytes": nbytes(zero.single_partition_of_fp32_groups),
        "moment_bytes": nbytes(moments),
        "optimizer_class": type(zero.optimizer).__name__,
    }


def main():
    models, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(os.path.join(models, "tokenizer"))
    args = DistillationConfig(
        **tiny_run_settings(
            output_dir=out, max_steps=1, per_device_train_batch_size=2, save_strategy="no",
            deepspeed=str(CONFIGS / "zero2_student.json"), teacher_deepspeed=str(CONFIGS / "zero3_teacher.json"),
        )
    )
    trainer = DistillationTrainer(
        os.path.join(models, "student"), os.path.join(models, "teacher"), args=args,
        train_dataset=synthetic_prompt_completion(16), processing_class=tok,
    )
    trainer.train()
    rank = trainer.args.process_index
    rec = {"rank": rank, "world_size": trainer.args.world_size, **held(trainer)}
    write_rank_record(out, rank, rec)


if __name__ == "__main__":
    main()
