"""A 2-process DeepSpeed distillation run (ZeRO-2 student, ZeRO-3 teacher) that records what each rank holds
and computes into ``<out>/<mode>/rank<k>.json``. Launched by tests through `trl_distill.testing.launch`.

Modes: ``main`` (evaluate, train with checkpoints, then the checks below); ``resume`` (resume ``main``'s
checkpoint given as the fourth argument); ``divergences`` (one optimizer step with each divergence);
``zero3_student`` (ZeRO-3 for the student too); ``ddp`` (no DeepSpeed at all).
"""

import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from trl_distill import LOSS_TYPES, DistillationConfig, DistillationTrainer
from trl_distill.model.fused_forward import gathered
from trl_distill.teacher import LiveTeacher
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

STUDENT_ZERO2 = {
    "zero_optimization": {"stage": 2, "overlap_comm": False},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}


STUDENT_ZERO3 = {
    **STUDENT_ZERO2,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def teacher_share(teacher) -> dict:
    params = list(teacher.parameters())
    return {
        "held": sum(p.ds_tensor.numel() for p in params),
        "total": sum(p.ds_numel for p in params),
        "materialized": sum(p.numel() for p in params),
        "persistent": sum(p.ds_numel for p in params if p.ds_persist),
    }


class RecordingTrainer(DistillationTrainer):
    """Records the (unpadded) samples each rank trains on."""

    seen: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            for ids, mask in zip(inputs["input_ids"].tolist(), inputs["attention_mask"].tolist()):
                self.seen.append([i for i, m in zip(ids, mask) if m])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class ShareRecorder(TrainerCallback):
    def __init__(self, trainer, rec):
        self.trainer, self.rec = trainer, rec

    def on_step_end(self, args, state, control, **kwargs):
        tr = self.trainer
        self.rec.setdefault("teacher_share_during_train", []).append(teacher_share(tr.teacher.module))
        self.rec.setdefault("backward_engine_is_student", []).append(
            tr.accelerator.deepspeed_engine_wrapped.engine is tr.model_wrapped
            and tr.accelerator.deepspeed_engine_wrapped.engine is not tr.teacher.engine
        )


class CycleDivergence(TrainerCallback):
    def __init__(self, trainer, rec):
        self.trainer, self.rec = trainer, rec

    def on_step_begin(self, args, state, control, **kwargs):
        args.divergence = LOSS_TYPES[state.global_step % len(LOSS_TYPES)]
        self.rec.setdefault("divergences_trained", []).append(args.divergence)


def count_lm_head_gathers(rec):
    """Record, per call of an lm_head gather (the loss's, and the once-per-step teacher pass's), how many of the
    given parameters are ZeRO-3 partitioned (0: nothing to gather, e.g. the teacher's head already held)."""
    import trl_distill.loss.fused as loss_module
    import trl_distill.teacher.step_pass as step_module
    from trl_distill.compat import is_zero3_partitioned

    rec["lm_head_gathers"] = []
    for module in (loss_module, step_module):
        def counting(*params, original=module.gathered):
            rec["lm_head_gathers"].append(sum(is_zero3_partitioned(p) for p in params))
            return original(*params)

        module.gathered = counting


def record_teacher_load(trainer, rec):
    """Record the teacher as `from_pretrained` returns it, before DeepSpeed prepares it: under `zero.Init` it
    is already partitioned, so no rank ever held all of it."""
    import trl_distill.teacher.zero3_loading as loading

    load, read = trainer.teacher._load, loading._read_into
    bytes_read = []

    def counting_read(target, *args):
        bytes_read.append(read(target, *args))
        return bytes_read[-1]

    def recording_load():
        loading._read_into = counting_read
        try:
            model = load()
        finally:
            loading._read_into = read
        rec["teacher_at_load"] = {
            "zero3_flag": is_deepspeed_zero3_enabled(),
            "all_partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
            "materialized": sum(p.numel() for p in model.parameters()),
            "bytes_read": sum(bytes_read),  # from the checkpoint, by this rank, with the partition-wise loader
            "param_bytes": sum(p.ds_numel * p.element_size() for p in model.parameters()),
        }
        return model

    trainer.teacher._load = recording_load


def fixed_batch(tok, device):
    texts = ["reverse: cat dog => dog cat", "reverse: the small teacher model => model teacher small the"]
    return tok(texts, return_tensors="pt", padding=True).to(device)


def main():
    pair, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    resume_from = sys.argv[4] if len(sys.argv) > 4 else None
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    dataset = synthetic_prompt_completion(64)
    args = DistillationConfig(
        **tiny_run_settings(
            output_dir=os.path.join(out, mode),
            per_device_train_batch_size=2,
            save_strategy="steps",
            save_steps=8,
            deepspeed={"zero3_student": STUDENT_ZERO3, "ddp": None}.get(mode, STUDENT_ZERO2),
            use_cpu=mode == "divergences",  # `use_cpu=True` with DeepSpeed must give the same 2-process setup
        )
    )
    trainer = RecordingTrainer(
        os.path.join(pair, "student"),
        os.path.join(pair, "teacher"),
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(16)),
        processing_class=tok,
    )
    trainer.seen = []
    rank = trainer.args.process_index
    rec = {"rank": rank, "world_size": trainer.args.world_size, "num_processes": trainer.accelerator.num_processes}
    if mode != "ddp":
        trainer.add_callback(ShareRecorder(trainer, rec))

    if mode == "resume":
        trainer.train(resume_from_checkpoint=resume_from)
        rec["log_history"] = trainer.state.log_history
        return write(out, mode, rank, rec)
    if mode == "ddp":  # no DeepSpeed: DDP student, plain frozen teacher on each rank
        trainer.args.max_steps = 6
        trainer.args.save_strategy = "no"
        trainer.train()
        rec["log_history"] = trainer.state.log_history
        rec["teacher_is_plain"] = not any(hasattr(p, "ds_id") for p in trainer.teacher.module.parameters())
        rec["student_wrapper"] = type(trainer.model_wrapped).__name__
        return write(out, mode, rank, rec)
    if mode == "zero3_student":  # ZeRO-3 for both: evaluate, train 6 steps, save
        trainer.args.max_steps = 6
        trainer.args.save_strategy = "no"
        rec["eval_before"] = trainer.evaluate()
        trainer.train()
        rec["log_history"] = trainer.state.log_history
        rec["student_partitioned"] = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
        rec["teacher_share_after_train"] = teacher_share(trainer.teacher.module)
        final = os.path.join(out, mode, "final")
        trainer.save_model(final)
        rec["final_files"] = sorted(os.listdir(final)) if trainer.accelerator.is_main_process else []
        return write(out, mode, rank, rec)
    if mode == "divergences":  # one optimizer step per divergence, several loss chunks per step
        trainer.args.max_steps = len(LOSS_TYPES)
        trainer.args.loss_chunk_size = 3
        count_lm_head_gathers(rec)
        trainer.add_callback(CycleDivergence(trainer, rec))
        trainer.train()
        rec["log_history"] = trainer.state.log_history
        rec["teacher_share_after_train"] = teacher_share(trainer.teacher.module)
        return write(out, mode, rank, rec)

    record_teacher_load(trainer, rec)
    rec["eval_before"] = trainer.evaluate()  # before train(), with a ZeRO-2 student
    teacher_engine = trainer.teacher.engine
    trainer.train()
    rec["log_history"] = trainer.state.log_history
    rec["seen"] = trainer.seen
    rec["teacher_engine_kept"] = trainer.teacher.engine is teacher_engine
    rec["teacher_share_after_train"] = teacher_share(trainer.teacher.module)
    rec["teacher_requires_grad"] = any(p.requires_grad for p in trainer.teacher.module.parameters())
    rec["student_partitioned"] = any(hasattr(p, "ds_id") for p in trainer.model.parameters())
    rec["student_numel"] = sum(p.numel() for p in trainer.model.parameters())
    rec["selected_plugin_is_student"] = trainer.accelerator.state.deepspeed_plugin is (
        trainer.accelerator.state.get_deepspeed_plugin("student")
    )
    rec["zero3_flag_after_train"] = is_deepspeed_zero3_enabled()
    rec["accelerator_config_stage"] = trainer.accelerator.deepspeed_config["zero_optimization"]["stage"]
    teacher_cfg = trainer.teacher.engine.config
    rec["teacher_engine_config"] = {
        "stage": teacher_cfg["zero_optimization"]["stage"],
        "micro_batch": teacher_cfg["train_micro_batch_size_per_gpu"],
        "reduce_bucket_size": teacher_cfg["zero_optimization"]["reduce_bucket_size"],
        "prefetch": teacher_cfg["zero_optimization"]["stage3_prefetch_bucket_size"],
        "has_optimizer": "optimizer" in teacher_cfg,
    }
    rec["eval_after"] = trainer.evaluate()

    # Teacher logits under ZeRO-3 (engine forward, and our hidden-states path) vs the same teacher loaded plainly
    batch = fixed_batch(tok, trainer.args.device)
    plain = AutoModelForCausalLM.from_pretrained(os.path.join(pair, "teacher"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = plain(**batch).logits
        z3 = trainer.teacher.engine(**batch).logits
        features = trainer.teacher.features(dict(batch))
        with gathered(*features.head.params):
            fused = features.head.logits(features.states)
    rec["plain_teacher_partitioned"] = any(hasattr(p, "ds_id") for p in plain.parameters())
    rec["teacher_logits_maxdiff"] = (z3 - ref).abs().max().item()
    rec["teacher_hidden_logits_maxdiff"] = (fused - ref).abs().max().item()

    # The saved student reloads with the trained student's logits
    final = os.path.join(out, mode, "final")
    trainer.save_model(final)
    trainer.accelerator.wait_for_everyone()
    with torch.no_grad():
        trained = trainer.model(**batch).logits
        reloaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()(**batch).logits
    rec["reloaded_logits_maxdiff"] = (trained - reloaded).abs().max().item()
    rec["final_files"] = sorted(os.listdir(final))
    rec["final_keys_match_student"] = sorted(load_file(os.path.join(final, "model.safetensors"))) == sorted(
        trainer.model.state_dict()
    )

    # A teacher prepared after the student's engine exists leaves the accelerator's state to the student
    acc = trainer.accelerator
    state = (acc.deepspeed_engine_wrapped, acc.deepspeed_config, list(acc._models))
    late = LiveTeacher(os.path.join(pair, "teacher"), {"dtype": torch.float32})
    late.prepare(acc, trainer.args.device)
    rec["late_teacher_state_kept"] = [
        acc.deepspeed_engine_wrapped is state[0], acc.deepspeed_config is state[1], acc._models == state[2]
    ]
    rec["late_teacher_share"] = teacher_share(late.module)
    late_save = os.path.join(out, mode, "final_after_late_teacher")
    trainer.save_model(late_save)
    acc.wait_for_everyone()
    rec["late_save_files"] = sorted(os.listdir(late_save))
    # A teacher that fails to load selects the student's plugin again
    try:
        LiveTeacher(os.path.join(pair, "no_such_teacher")).prepare(acc, trainer.args.device)
    except OSError:
        rec["failed_load_raised"] = True
    rec["plugin_after_failed_load_is_student"] = acc.state.deepspeed_plugin is acc.state.get_deepspeed_plugin("student")
    rec["zero3_flag_after_failed_load"] = is_deepspeed_zero3_enabled()

    # Every rank runs every teacher forward: rank 0 gets a batch without a single loss token
    inputs = dict(fixed_batch(tok, trainer.args.device))
    inputs["labels"] = inputs["input_ids"].clone()
    if rank == 0:
        inputs["labels"][:] = -100
    trainer.model_wrapped.train()
    loss = trainer.compute_loss(trainer.model_wrapped, inputs)
    rec["no_token_batch_loss"] = loss.item()

    write(out, mode, rank, rec)


def write(out, mode, rank, rec):
    write_rank_record(os.path.join(out, mode), rank, rec)


if __name__ == "__main__":
    main()
