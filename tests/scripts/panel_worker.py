"""2 processes, ZeRO-2 student + two ZeRO-3 teachers (`teachers`, routed by the dataset's `teacher` column),
gradient accumulation 2. Records into ``<out>/rank<k>.json`` each teacher's share of its parameters on this rank, how
many times DeepSpeed fetched (all-gathered) each teacher's parameters per optimizer step, the DeepSpeed plugins the
accelerator holds and the logged losses.

    panel_worker.py <pair dir> <second teacher dir> <out> [on-policy]

``on-policy``: the student's own samples (lmbda 1, reverse KL), and for each micro-batch its rows' teachers and the
rows each teacher's forward ran on.
"""

import os
import sys

from teacher_step_worker import STUDENT_ZERO2, count_fetches
from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record


class PerStep(TrainerCallback):
    """Each teacher's fetches of each of its parameters during each optimizer step."""

    def __init__(self, counts: dict[str, dict[str, int]], rec: dict):
        self.counts, self.rec = counts, rec
        self.last = {name: dict(c) for name, c in counts.items()}

    def on_step_end(self, args, state, control, **kwargs):
        self.rec["fetches_per_step"].append({name: {k: v - self.last[name][k] for k, v in c.items()}
                                             for name, c in self.counts.items()})
        self.last = {name: dict(c) for name, c in self.counts.items()}


def record_forwards(trainer, rec: dict) -> None:
    """Per micro-batch: its rows' teachers (`teacher_route`) and the rows each teacher's forward ran on."""
    from trl_distill.data.batch import extras_of

    ran = {name: [] for name in trainer.teacher.members}
    for name, member in trainer.teacher.members.items():
        forward = member.features

        def counted(inputs, positions=None, forward=forward, seen=ran[name]):
            seen.append(inputs["input_ids"].shape[0])
            return forward(inputs, positions)

        member.features = counted
    compute_loss, rec["micro_batches"] = trainer.compute_loss, []

    def recorded(model, inputs, *args, **kwargs):
        route, before = extras_of(inputs).route.tolist(), {name: len(seen) for name, seen in ran.items()}
        out = compute_loss(model, inputs, *args, **kwargs)
        rec["micro_batches"].append({"route": route, "ran": {n: seen[before[n]:] for n, seen in ran.items()}})
        return out

    trainer.compute_loss = recorded


def main():
    pair, second, out = sys.argv[1:4]
    on_policy = sys.argv[4:] == ["on-policy"]
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    data = synthetic_prompt_completion(64)
    data = data.add_column("teacher", ["a" if i % 3 else "b" for i in range(len(data))])
    settings = tiny_run_settings(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        save_strategy="no", deepspeed=STUDENT_ZERO2,
        teachers=[f"a={os.path.join(pair, 'teacher')}", f"b={second}"],
    )
    if on_policy:  # the student's own samples, every step
        settings.update(lmbda=1.0, max_new_tokens=6, divergence="reverse_kl", alpha=1.0, max_steps=2)
    args = DistillationConfig(**settings)
    trainer = DistillationTrainer(os.path.join(pair, "student"), args=args, train_dataset=data, processing_class=tok)
    rec = {"rank": trainer.args.process_index, "fetches_per_step": []}
    prepare = trainer.prepare_teacher

    def prepare_and_count():
        prepare()
        if "counts" not in rec:
            members = trainer.teacher.members.items()
            rec["counts"] = counts = {name: count_fetches(member.module) for name, member in members}
            rec["persistent"] = {name: [n for n, p in member.module.named_parameters() if p.ds_persist]
                                 for name, member in members}
            trainer.add_callback(PerStep(counts, rec))

    if on_policy:
        record_forwards(trainer, rec)
    else:
        trainer.prepare_teacher = prepare_and_count
    trainer.train()
    rec.pop("counts", None)
    rec["plugins"] = sorted(trainer.accelerator.state.deepspeed_plugins)
    rec["shares"] = {}
    for name, member in trainer.teacher.members.items():
        params = list(member.module.parameters())
        rec["shares"][name] = {"held": sum(p.ds_tensor.numel() for p in params),
                               "total": sum(p.ds_numel for p in params),
                               "bytes_held": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params),
                               "materialized": sum(p.numel() for p in params)}
    rec["log_history"] = trainer.state.log_history
    write_rank_record(out, rec["rank"], rec)


if __name__ == "__main__":
    main()
