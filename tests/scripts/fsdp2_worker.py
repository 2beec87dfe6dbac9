"""A 2-process FSDP2 distillation run on CPU (gloo): the student under accelerate's `fsdp_version: 2`, the teacher
sharded with FSDP2 on its own. Records what each rank holds, reads and computes into ``<out>/<mode>/rank<k>.json``.

    fsdp2_worker.py <pair dir> <out> main     # evaluate, train 6 steps (checkpoints every 3), save the student
    fsdp2_worker.py <pair dir> <out> killed   # main's run, rank 1 killed (SIGKILL) at the end of step 4
    fsdp2_worker.py <pair dir> <out> resume   # resume the killed run in its output dir (its newest complete checkpoint)
    fsdp2_worker.py <pair dir> <out> lora     # a LoRA student: adapter-only checkpoints
"""

import os
import signal
import sys

import torch
from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

FSDP2 = {"fsdp_version": 2, "reshard_after_forward": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
         "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"}
# the LoRA run: the ZeRO-3-like mode, accelerate's activation checkpointing, whole-model checkpoints
FSDP2_LORA = {**FSDP2, "reshard_after_forward": True, "activation_checkpointing": True,
              "state_dict_type": "FULL_STATE_DICT"}


def settings(out: str, mode: str, **overrides) -> dict:
    """The run's `DistillationConfig` arguments; the one-process reference of the tests uses them too."""
    return tiny_run_settings(output_dir=os.path.join(out, mode), max_steps=6, per_device_train_batch_size=2,
                             save_strategy="steps", save_steps=3, **overrides)


def count_teacher_reads(rec):
    """Count the bytes this rank reads from the teacher's safetensors files while it loads (every pread)."""
    import trl_distill.teacher.zero3_loading as loading

    read = loading._pread_exact
    rec["teacher_bytes_read"] = 0

    def counting(fd, view, offset, path):
        rec["teacher_bytes_read"] += len(view)
        return read(fd, view, offset, path)

    loading._pread_exact = counting


def shares(model) -> dict:
    """Bytes of `model`'s parameters this rank holds, bytes of the whole model, and whether each is a DTensor."""
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return {"held": sum(t.numel() * t.element_size() for t in local),
            "total": sum(p.numel() * p.element_size() for p in params),
            "all_sharded": all(hasattr(p, "to_local") for p in params)}


class ShareRecorder(TrainerCallback):
    def __init__(self, trainer, rec):
        self.trainer, self.rec = trainer, rec

    def on_train_begin(self, args, state, control, **kwargs):  # (the teacher is prepared by now)
        self.forwards = 0  # of the teacher's first layer: each one gathers it

        def count(module, inputs):
            self.forwards += 1

        self.trainer.teacher.module.model.layers[0].register_forward_pre_hook(count)

    def on_step_end(self, args, state, control, **kwargs):
        self.rec.setdefault("teacher_during_train", []).append(shares(self.trainer.teacher.module))
        self.rec.setdefault("teacher_layer_forwards", []).append(self.forwards)
        self.forwards = 0


class KillRankOne(TrainerCallback):
    """SIGKILL rank 1 at the end of step 4: checkpoint-3 is complete, step 4 is lost, as when a node dies."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 4 and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    pair, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ["RANK"])
    rec = {"mode": mode}
    count_teacher_reads(rec)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    dataset = synthetic_prompt_completion(64)
    extra = {}
    if mode == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    run = "killed" if mode == "resume" else mode  # the resumed run trains on in the killed run's output dir
    accumulate = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2} if mode == "lora" else {}
    args = DistillationConfig(**{**settings(out, run, eval_strategy="steps", eval_steps=3), **accumulate},
                              fsdp="full_shard", fsdp_config=FSDP2_LORA if mode == "lora" else FSDP2)
    trainer = DistillationTrainer(model=os.path.join(pair, "student"), teacher_model=os.path.join(pair, "teacher"),
                                  args=args, train_dataset=dataset, eval_dataset=dataset.select(range(8)),
                                  processing_class=tokenizer, **extra)
    trainer.add_callback(ShareRecorder(trainer, rec))
    if mode == "killed":
        trainer.add_callback(KillRankOne())
    rec["is_fsdp2"] = trainer.accelerator.is_fsdp2
    if mode == "main":
        try:
            trainer.evaluate()
        except ValueError as error:  # accelerate prepares an FSDP2 student only with its optimizer
            rec["eval_before_refused"] = str(error)
    rec["checkpoints_found"] = sorted(n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-"))
    trainer.train(resume_from_checkpoint=mode == "resume" or None)
    rec["log_history"] = trainer.state.log_history
    rec["student"] = shares(trainer.model)
    rec["teacher"] = shares(trainer.teacher.module)
    rec["teacher_root_gathered"] = not hasattr(trainer.teacher.module.lm_head.weight, "to_local")
    moments = [state[k] for state in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    rec["moment_bytes"] = sum(m.to_local().numel() * m.element_size() for m in moments)
    if mode == "main":
        rec["eval_after"] = trainer.evaluate()
        trainer.save_model(os.path.join(out, mode, "final"))
        probe = tokenizer(["reverse: cat dog => dog cat"], return_tensors="pt")
        with torch.no_grad():
            rec["final_logits"] = trainer.model(**probe).logits[0, -1].tolist()
    trainer.accelerator.wait_for_everyone()
    write_rank_record(out + "/" + mode, rank, rec)


if __name__ == "__main__":
    main()
