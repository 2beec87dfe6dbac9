"""2 processes, ZeRO-2 student + ZeRO-3 teacher, gradient accumulation 4: the teacher once per optimizer step
(`teacher_step_pass`) against once per micro-batch. Records into ``<out>/<mode>/rank<k>.json`` the logged losses
and, per optimizer step, how many times DeepSpeed fetched (all-gathered) each teacher parameter.

    teacher_step_worker.py <pair dir> <out> <mode>     # mode: step | micro_batch | step_rows3
"""

import os
import sys

from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import (
    synthetic_prompt_completion,
    tiny_run_settings,
    tokenized_with_unlabelled_batches,
    write_rank_record,
)

STUDENT_ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": False}, "bf16": {"enabled": "auto"}}


def count_fetches(module) -> dict[str, int]:
    """Count, per parameter name, DeepSpeed's fetches of it: calls of its ZeRO-3 all-gathers (the partitioned
    coordinator's `all_gather_coalesced`, `GatheredParameters`' `all_gather`) that find it not available."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    counts = dict.fromkeys((name for name, _ in module.named_parameters()), 0)
    names = {id(p): name for name, p in module.named_parameters()}

    def counting(param, original):
        def gather(param_list=None, *args, **kwargs):
            for p in param_list if param_list is not None else [param]:
                if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                    counts[names[id(p)]] += 1
            return original(param_list, *args, **kwargs)

        return gather

    for p in module.parameters():
        p.all_gather_coalesced = counting(p, p.all_gather_coalesced)
        p.all_gather = counting(p, p.all_gather)
    return counts


class PerStep(TrainerCallback):
    def __init__(self, counts: dict, rec: dict):
        self.counts, self.rec, self.last = counts, rec, dict(counts)

    def on_step_end(self, args, state, control, **kwargs):
        self.rec["fetches_per_step"].append({k: v - self.last[k] for k, v in self.counts.items()})
        self.last = dict(self.counts)


def main():
    pair, out, mode = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    data, collate = tokenized_with_unlabelled_batches(tok, synthetic_prompt_completion(64))
    args = DistillationConfig(**tiny_run_settings(
        output_dir=os.path.join(out, mode), per_device_train_batch_size=2, gradient_accumulation_steps=4,
        max_steps=4, save_strategy="no", deepspeed=STUDENT_ZERO2, remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True}, teacher_step_pass=mode != "micro_batch",
        teacher_batch_size=3 if mode == "step_rows3" else None,
    ))
    trainer = DistillationTrainer(os.path.join(pair, "student"), os.path.join(pair, "teacher"), args=args,
                                  train_dataset=data, processing_class=tok, data_collator=collate)
    rec = {"rank": trainer.args.process_index, "fetches_per_step": []}
    prepare = trainer.prepare_teacher

    def prepare_and_count():
        prepare()
        if "counts" not in rec:
            rec["counts"] = counts = count_fetches(trainer.teacher.module)
            trainer.add_callback(PerStep(counts, rec))

    trainer.prepare_teacher = prepare_and_count
    step_pass = trainer.teacher.step_pass
    run_ahead, features, forwards = step_pass.run, trainer.teacher.features, []

    def counted_features(inputs, positions=None):  # a forward of the pass over real rows (not a rank's idle one)
        forwards.append(positions is not None and positions.numel() > 0)
        return features(inputs, positions)

    def run_and_measure(batch_samples):  # what the pass holds while the step's micro-batches train
        trainer.teacher.features = counted_features
        try:
            run_ahead(batch_samples)
        finally:
            trainer.teacher.features = features
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        head = trainer.teacher.module.lm_head.weight
        rec.setdefault("held", []).append({
            "states_bytes": sum(rows.states.nbytes for _, rows in step_pass.queue),
            "head_gathered": head.ds_status == ZeroParamStatus.AVAILABLE and head.numel() == head.ds_numel,
            "head_bytes": head.ds_numel * head.element_size(),
            "row_width": max(b["input_ids"].shape[1] for b in batch_samples),
        })

    step_pass.run = run_and_measure
    trainer.train()
    rec.pop("counts")
    rec["log_history"] = trainer.state.log_history
    rec["forwards_ahead"] = sum(forwards)
    rec["unlabelled_batches"] = collate.calls // 3
    rec["persistent"] = [n for n, p in trainer.teacher.module.named_parameters() if p.ds_persist]
    rec["head_released"] = trainer.teacher.module.lm_head.weight.numel() == 0  # partitioned again after training
    write_rank_record(os.path.join(out, mode), rec["rank"], rec)


if __name__ == "__main__":
    main()
