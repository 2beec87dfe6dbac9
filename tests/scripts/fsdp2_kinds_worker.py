"""2 processes on CPU (gloo): an FSDP2 student beside each teacher kind other than the plain live one, one scenario
after another in one launch. Records what each rank logs, holds and reads into ``<out>/<mode>/rank<k>.json``.

    fsdp2_kinds_worker.py OUT PATHS MODE [MODE ...]   # PATHS: a JSON object of the paths below

      cache       # a live teacher (pair) sharded with FSDP2 writes a float32 top-k cache to OUT/cache/written
      from_cache  # the student trains from the cache `cache` wrote
      cross       # a live teacher of another tokenizer (other)
      panel       # two live teachers at once (pair's; second, its layers kept gathered: its own `fsdp`), summed
      self        # self-distillation of a LoRA student: its own base, adapters off
      privileged  # a live teacher reading its own prompt (`teacher_prompt`)
      moe         # an MoE student (its router loss on) beside an MoE teacher (moe) whose checkpoint keeps experts apart
      served      # a vLLM server's top-k (served_student, url)
"""

import json
import os
import sys

import torch
from fsdp2_worker import count_teacher_reads, shares  # (tests/scripts/)
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer, compat
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

HINT = "{prompt} hint:{completion} =>"  # the privileged teacher is shown the reference completion
CACHE = dict(top_k=16, shard_rows=8, batch_size=3, log_prob_dtype="float32")
ROWS = 16


def fsdp2(layer: str) -> dict:
    """The student's FSDP2 settings (accelerate's), each of its decoder layers `layer` a group of its own."""
    return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False,
                                                  "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                  "transformer_layer_cls_to_wrap": [layer]}}


def settings(out: str, mode: str, **overrides) -> dict:
    """The run's `DistillationConfig` arguments (without FSDP); the one-process references of the tests use them."""
    return tiny_run_settings(output_dir=os.path.join(out, mode), max_steps=3, per_device_train_batch_size=2,
                             save_strategy="no", **overrides)


def scenario(mode: str, paths: dict) -> tuple[dict, dict]:
    """``(the trainer's keyword arguments, extra DistillationConfig arguments)`` of `mode` (see the module doc)."""
    pair = paths.get("pair", "")
    student, teacher = os.path.join(pair, "student"), os.path.join(pair, "teacher")
    trainer = {"model": student, "teacher_model": teacher, "processing_class": os.path.join(pair, "tokenizer")}
    if mode == "from_cache":
        return {**trainer, "teacher_model": None}, {"teacher_cache": paths["cache"]}
    if mode == "cross":
        return {**trainer, "teacher_model": paths["other"]}, {"cross_tokenizer": True}
    if mode == "panel":
        second = {"name": "b", "model": paths["second"], "fsdp": {"reshard_after_forward": False}}  # its own
        return {**trainer, "teacher_model": None}, {"teachers": [f"a={teacher}", second], "teacher_combine": "sum",
                                                   "teacher_weights": [0.25, 0.75]}
    if mode == "self":
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        return {**trainer, "teacher_model": "self", "peft_config": lora}, {}
    if mode == "privileged":
        return trainer, {"teacher_prompt": HINT}
    if mode == "served":
        served = paths["served_student"]
        return {"model": served, "teacher_model": None, "processing_class": served}, {
            "teacher_server": paths["url"], "teacher_model_name_or_path": "teacher", "teacher_server_top_k": 8,
            "temperature": 1.0, "max_length": 64}  # (a server: log-probs at temperature 1, its max-model-len)
    if mode == "moe":
        moe = paths["moe"]
        return {"model": os.path.join(moe, "student"), "teacher_model": os.path.join(moe, "teacher"),
                "processing_class": os.path.join(moe, "student")}, {"router_aux_loss_coef": 0.02}
    return trainer, {}


def trainer_for(out: str, mode: str, paths: dict, **args) -> DistillationTrainer:
    """The scenario's trainer; `args`: its DistillationConfig arguments beyond `settings` (FSDP2's, or a batch)."""
    kwargs, extra = scenario(mode, paths)
    if "fsdp" not in args and "teachers" in extra:  # the one-process reference: an entry's own FSDP2 settings are
        # refused without an FSDP2 student, and change no value
        extra["teachers"] = [{k: v for k, v in t.items() if k != "fsdp"} if isinstance(t, dict) else t
                             for t in extra["teachers"]]
    kwargs["processing_class"] = AutoTokenizer.from_pretrained(kwargs["processing_class"])
    config = DistillationConfig(**{**settings(out, mode, **extra), **args})
    return DistillationTrainer(args=config, train_dataset=synthetic_prompt_completion(ROWS), **kwargs)


def live_members(teacher) -> dict:
    """Each live teacher model the run holds, by name: a panel's members, a privileged teacher's inner one."""
    members = getattr(teacher, "members", None) or {"teacher": getattr(teacher, "inner", teacher)}
    return {name: member for name, member in members.items() if getattr(member, "sharded", False)}


def count_router_losses() -> list:
    """Record the router loss of each of the student's training forwards on this rank (its own rows)."""
    import trl_distill.model.fused_forward as fused

    own, seen = fused.router_aux_loss, []

    def recording(*args):
        aux = own(*args)
        if torch.is_grad_enabled():
            seen.append(aux.item())
        return aux

    fused.router_aux_loss = recording
    return seen


def expert_rows(teacher, directory: str) -> dict:
    """Each teacher parameter gathered whole (collective) against transformers' own load of its checkpoint: the
    largest difference of each fused expert parameter, and of every parameter."""
    from transformers import AutoModelForCausalLM

    own = dict(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).named_parameters())
    diffs = {name: (param.full_tensor() - own[name]).abs().max().item() for name, param in teacher.named_parameters()}
    return {"fused": {name: diff for name, diff in diffs.items() if ".experts." in name}, "max": max(diffs.values())}


def run(out: str, mode: str, paths: dict, reads: dict) -> dict:
    reads["teacher_bytes_read"] = 0
    layer = "MixtralDecoderLayer" if mode == "moe" else "LlamaDecoderLayer"
    trainer = trainer_for(out, mode, paths, **fsdp2(layer))
    router_losses = count_router_losses() if mode == "moe" else []
    rec = {"mode": mode, "is_fsdp2": trainer.accelerator.is_fsdp2}
    if mode == "cache":
        from trl_distill.cache import fill_teacher_cache, open_teacher_cache

        run = (trainer.context, trainer.teacher, trainer.train_dataset, os.path.join(out, "cache", "written"))
        manifest = open_teacher_cache(*run, top_k=CACHE["top_k"], shard_rows=CACHE["shard_rows"],
                                      log_prob_dtype=CACHE["log_prob_dtype"], run_lock=trainer.run_lock)
        fill_teacher_cache(*run, manifest, batch_size=CACHE["batch_size"])
        trainer.run_lock.release()
    else:
        trainer.train()
        rec["log_history"] = trainer.state.log_history
        rec["student"] = shares(trainer.model)
    members = live_members(trainer.teacher)
    rec["teachers"] = {name: shares(member.module) for name, member in members.items()}
    rec["teacher_bytes_read"] = reads["teacher_bytes_read"]
    if mode == "self":
        rec["teacher_is_the_students_base"] = trainer.teacher.module is trainer.model.get_base_model()
    if mode == "moe":
        rec["own_router_losses"] = router_losses
        rec["expert_rows"] = expert_rows(members["teacher"].module, os.path.join(paths["moe"], "teacher"))
    trainer.accelerator.wait_for_everyone()
    return rec


def main():
    out, paths, modes = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    reads = {}
    count_teacher_reads(reads)  # (into reads["teacher_bytes_read"])
    for mode in modes:
        write_rank_record(os.path.join(out, mode), int(os.environ["RANK"]), run(out, mode, paths, reads))
        compat.forget_accelerator_state()  # the next scenario's student gets its own FSDP2 plugin


if __name__ == "__main__":
    main()
