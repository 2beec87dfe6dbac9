"""One timed distillation run for `benchmarks/trainers.py`, on 1 process (``python``) or several (``torchrun``).

    trainer_worker.py '<spec JSON>'

Contenders (``spec["trainer"]``):

* ``ours``: `trl_distill.DistillationTrainer` (``alpha=1``: pure forward KL at T=1), student DeepSpeed config
  ``spec["deepspeed"]`` (or none), teacher ZeRO-3 derived by the trainer; ``ours_per_micro_batch``: the same with
  ``teacher_step_pass=False`` (the teacher once per micro-batch, as before issue 17).
* ``gkd``: `trl.experimental.gkd.GKDTrainer` with ``lmbda=0, beta=0, seq_kd=False`` (off-policy forward KL), the
  same student DeepSpeed config (TRL then prepares the teacher itself: stage 0 beside a ZeRO-2 student, ZeRO-3
  beside a ZeRO-3 one).
* ``bare``: a plain PyTorch loop: teacher forward under ``no_grad``, student forward, full-logit KL on completion
  tokens, backward, gradient clipping at 1.0 and fused AdamW (what the Trainer runs by default), no Trainer.
* ``cli``: `trl_distill.cli.build_trainer` on the `trl-distill` flags ``spec["argv"]`` (the data from their
  ``--dataset_name``, prepared by the trainer itself: a teacher of another tokenizer, a teacher cache), then timed as
  ``ours``; ``cache_write``: `trl-distill cache-teacher` on ``spec["argv"]`` in this process, timed as a whole
  (``seconds``; no optimizer steps), with its manifest's rows, loss tokens and bytes.

``spec["config"]`` adds fields to both configs (``lmbda``, ``max_new_tokens``: on-policy; ``on_policy_objective``;
``router_aux_loss_coef``), ``spec["lora"]`` gives both trainers a `peft.LoraConfig` of those arguments; with
``lmbda`` > 0 the collator also hands GKD the left-padded prompts (``prompts``, ``prompt_attention_mask``) it samples
from (ours finds them in ``labels``).

Every contender reads the same saved models and the same pre-tokenized batches through one collator. Each rank
writes ``<spec["out"]>/rank<k>.json``: memory probes (``/proc/self/status`` VmRSS / VmHWM; the high-water mark is
reset through ``/proc/self/clear_refs`` right after the teacher is ready, so the load and training peaks are
separate), the teacher bytes this rank holds, and a ``time.perf_counter`` stamp at the end of every optimizer step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
from _common import step_timer  # benchmarks/_common.py, memory_probe.py, step_split.py (the script's folder)
from memory_probe import reset_peak_rss
from step_split import instrument_gkd, instrument_ours, teacher_compute_seconds

from trl_distill.runtime.distributed import teardown_process_group
from trl_distill.testing import write_rank_record

KIB = 1024


def gpu_turn() -> None:
    """Called where each contender is about to start its GPU work (after building a `DistillationTrainer`, whose
    models load in train(); before building GKD's, which prepares its teacher at once): nothing here;
    `benchmarks/gpu/train_worker.py` waits there for its row's turn on the GPU."""


# ---- memory and teacher size --------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "VmData", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) * KIB
    return out


def probe(rec: dict, name: str, reset: bool = False) -> None:
    """Record VmRSS, VmHWM and ru_maxrss (bytes) under `name`; optionally reset the high-water mark after."""
    rec["memory"][name] = {**_status(), "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB}
    if reset:
        rec["memory"][name]["hwm_reset"] = reset_peak_rss()


def teacher_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of teacher parameters this rank holds: its ZeRO-3 partitions (``ds_tensor``) plus every parameter
    whose full data is present (unpartitioned, or ZeRO-3 persistent/gathered), outside any forward."""
    partition = full = total = 0
    for p in module.parameters():
        size = p.element_size()
        if hasattr(p, "to_local"):  # FSDP2: this rank's rows
            partition += p.to_local().numel() * size
            total += p.numel() * size
        elif hasattr(p, "ds_tensor"):
            partition += p.ds_tensor.numel() * size
            total += p.ds_numel * size
            full += p.numel() * size  # 0 while partitioned; the whole tensor for persistent parameters
        else:
            full += p.numel() * size
            total += p.numel() * size
    return {"held": partition + full, "partition": partition, "materialized": full, "total": total}


# ---- data ---------------------------------------------------------------------------------------------------
def dataset(spec: dict):
    """Random token ids (fixed seed), each sequence split at a random point into prompt and completion."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(spec["data_seed"])
    n, t = spec["num_examples"], spec["seq_len"]
    ids = torch.randint(4, spec["vocab_size"], (n, t), generator=g)  # ids 0-3 are the special tokens
    lo, hi = spec["prompt_len_range"]
    prompt = torch.randint(lo, hi + 1, (n,), generator=g)
    completion = torch.arange(t).unsqueeze(0) >= prompt.unsqueeze(1)
    spec["loss_token_fraction"] = completion[:, 1:].sum().item() / (n * t)  # shifted labels that carry loss
    return Dataset.from_dict({"input_ids": ids.tolist(), "completion_mask": completion.int().tolist()})


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """``labels`` = input ids with the prompt masked (-100); every contender gets exactly these tensors."""
    ids = torch.tensor([e["input_ids"] for e in examples])
    completion = torch.tensor([e["completion_mask"] for e in examples], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(~completion, -100)}


def collate_with_prompts(examples: list[dict]) -> dict[str, torch.Tensor]:
    """`collate`, plus each row's prompt left-padded (id 0, masked): ``prompts`` [B, P], ``prompt_attention_mask``
    [B, P], what `GKDTrainer` samples on-policy completions from."""
    batch = collate(examples)
    lengths = [e["completion_mask"].index(1) for e in examples]
    width = max(lengths)
    prompts = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
        prompts[row, width - length:] = torch.tensor(example["input_ids"][:length])
        mask[row, width - length:] = 1
    return {**batch, "prompts": prompts, "prompt_attention_mask": mask}


def lora_config(spec: dict):
    """`peft.LoraConfig` of ``spec["lora"]`` (a causal LM's), or None."""
    if not spec.get("lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **spec["lora"])


# ---- contenders ---------------------------------------------------------------------------------------------
FSDP2_ARGS = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False,
                                                    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}


def common_args(spec: dict) -> dict:
    return dict(**(FSDP2_ARGS if spec.get("fsdp2") else {}),
        output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=spec.get("accumulation", 1),
        learning_rate=1e-4, lr_scheduler_type="constant", seed=0, bf16=spec.get("bf16", False), fp16=False,
        # transformers' bf16 on CPU needs it, and its gloo process group for FSDP without DeepSpeed (GKD's config)
        use_cpu=(spec.get("bf16", False) or spec.get("fsdp2", False)) and not torch.cuda.is_available(),
        gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no",
        logging_steps=spec.get("logging_steps", 10**6), remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True}, deepspeed=spec["deepspeed"], dataloader_num_workers=0,
    )  # fmt: skip


def run_ours(spec: dict, rec: dict, data, tokenizer) -> list[float]:
    from trl_distill import DistillationConfig, DistillationTrainer

    args = DistillationConfig(
        **common_args(spec), alpha=1.0, temperature=1.0, divergence="forward_kl", assistant_only_loss=False,
        teacher_step_pass=spec["trainer"] != "ours_per_micro_batch",
        log_distill_metrics=spec.get("log_distill_metrics", True),
        distill_metrics_every_step=spec.get("distill_metrics_every_step", False), **spec.get("config", {}),
    )
    probe(rec, "before_trainer")
    trainer = DistillationTrainer(
        spec["student"], spec["teacher"], args=args, train_dataset=data, processing_class=tokenizer,
        data_collator=collate, peft_config=lora_config(spec),
    )
    gpu_turn()
    return train_ours(trainer, spec, rec)


def run_cli(spec: dict, rec: dict, data, tokenizer) -> list[float]:
    from trl_distill.cli import build_trainer, make_parser

    probe(rec, "before_trainer")
    trainer = build_trainer(*make_parser().parse_args_and_config(args=spec["argv"]))
    gpu_turn()
    return train_ours(trainer, spec, rec)


def train_ours(trainer, spec: dict, rec: dict) -> list[float]:
    """Train a `DistillationTrainer`, probing memory once its teacher is ready; the optimizer steps' end times."""
    prepare = trainer.prepare_teacher

    def prepare_and_probe():  # the teacher is loaded and prepared inside train(), after the Trainer's free_memory()
        first = not getattr(trainer.teacher, "prepared", "teacher_ready" in rec["memory"])  # a cache: no model
        prepare()
        if first:
            probe(rec, "teacher_ready", reset=True)

    trainer.prepare_teacher = prepare_and_probe
    timer = step_timer(instrument_ours(trainer) if spec.get("split") else None)
    trainer.add_callback(timer)
    rec["train_loss"] = trainer.train().training_loss
    teacher = getattr(trainer.teacher, "module", None)  # None: a teacher cache
    rec["teacher_bytes"] = teacher_bytes(teacher) if teacher is not None else {"held": 0}
    rec["dtypes"] = {"student": str(trainer.model.dtype), "teacher": str(teacher.dtype) if teacher else None}
    rec["world_size"] = trainer.args.world_size
    rec["fsdp2"] = bool(getattr(trainer.accelerator, "is_fsdp2", False))
    rec["split"] = timer.split
    return timer.ends


def run_cache_write(spec: dict, rec: dict, data, tokenizer) -> None:
    """`trl-distill cache-teacher` with ``spec["argv"]``, here; its seconds and what its manifest says it wrote."""
    from trl_distill.cli import cache_teacher

    probe(rec, "before_trainer")
    gpu_turn()
    start = time.perf_counter()
    cache_teacher.main(spec["argv"])
    rec["seconds"] = time.perf_counter() - start
    probe(rec, "teacher_ready")  # (after the run: the high-water mark holds the teacher's load and the cache pass)
    directory = spec["argv"][spec["argv"].index("--teacher_cache") + 1]
    manifest = json.loads(open(os.path.join(directory, "manifest.json")).read())
    rec["cache"] = {"rows": manifest["num_rows"], "loss_tokens": sum(s["tokens"] for s in manifest["shards"]),
                    "bytes": sum(s["bytes"] for s in manifest["shards"]), "top_k": manifest["top_k"]}


def run_gkd(spec: dict, rec: dict, data, tokenizer) -> list[float]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from trl_distill.runtime import fsdp2
    from trl_distill.runtime.distributed import prepare_cpu_distributed_state

    class CPUGKDConfig(GKDConfig):
        """GKDConfig with the gloo process-group set-up DeepSpeed needs on a CPU-only machine (nothing else)."""

        def __post_init__(self):
            prepare_cpu_distributed_state(self)
            super().__post_init__()

    class CPUGKDTrainer(GKDTrainer):
        """GKDTrainer with FSDP2 turned on for CPU processes as ours turns it on (accelerate 1.15 drops it there);
        GKD prepares its teacher with `prepare_model(evaluation_mode=True)`: replicated on every rank."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            fsdp = fsdp2.turn_on_for_cpu(self.accelerator, self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = self.is_fsdp_enabled or fsdp

    settings = {"lmbda": 0.0, **spec.get("config", {})}
    args = CPUGKDConfig(**common_args(spec), beta=0.0, seq_kd=False, temperature=1.0, **settings)
    probe(rec, "before_trainer")
    gpu_turn()
    trainer = CPUGKDTrainer(
        spec["student"], spec["teacher"], args=args, train_dataset=data, processing_class=tokenizer,
        data_collator=collate_with_prompts if settings["lmbda"] > 0 else collate, peft_config=lora_config(spec),
    )
    probe(rec, "teacher_ready", reset=True)  # GKD loads and prepares its teacher in __init__
    timer = step_timer(instrument_gkd(trainer) if spec.get("split") else None)
    trainer.add_callback(timer)
    rec["train_loss"] = trainer.train().training_loss
    teacher = getattr(trainer.teacher_model, "module", trainer.teacher_model)
    rec["teacher_bytes"] = teacher_bytes(teacher)
    rec["dtypes"] = {"student": str(trainer.model.dtype), "teacher": str(teacher.dtype)}
    rec["world_size"] = trainer.args.world_size
    rec["fsdp2"] = bool(getattr(trainer.accelerator, "is_fsdp2", False))
    rec["split"] = timer.split
    return timer.ends


def run_bare(spec: dict, rec: dict, data, tokenizer) -> list[float]:
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    probe(rec, "before_trainer")
    gpu_turn()
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=dtype).train()
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=dtype).eval().requires_grad_(False)
    probe(rec, "teacher_ready", reset=True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    ends, losses, b = [], [], spec["batch"]
    for step in range(spec["steps"]):
        batch = collate([data[i] for i in range(step * b, (step + 1) * b)])
        labels = batch.pop("labels")[:, 1:]
        mask = labels != -100
        with torch.no_grad():
            t_logits = teacher(**batch).logits[:, :-1]
        s_logits = student(**batch).logits[:, :-1]
        t_logp = F.log_softmax(t_logits[mask], dim=-1)
        s_logp = F.log_softmax(s_logits[mask], dim=-1)
        loss = F.kl_div(s_logp, t_logp, reduction="sum", log_target=True) / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ends.append(time.perf_counter())
    rec["train_loss"] = sum(losses) / len(losses)
    rec["teacher_bytes"] = teacher_bytes(teacher)
    rec["world_size"] = 1
    return ends


RUNNERS = {"ours": run_ours, "ours_per_micro_batch": run_ours, "gkd": run_gkd, "bare": run_bare, "cli": run_cli,
           "cache_write": run_cache_write}


def cap_memory(spec: dict) -> None:
    """``spec["memory_cap_mib"]``: this process's `RLIMIT_DATA` (heap and anonymous mappings: where tensors live), so
    a run that does not fit fails with torch's "can't allocate memory" instead of the machine's OOM killer."""
    cap = spec.get("memory_cap_mib")
    if cap:
        resource.setrlimit(resource.RLIMIT_DATA, (cap * KIB * KIB, cap * KIB * KIB))


def main() -> None:
    spec = json.loads(sys.argv[1])
    cap_memory(spec)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    rec: dict = {"rank": rank, "spec": spec, "memory": {}}
    probe(rec, "start")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    data = dataset(spec)
    ends = RUNNERS[spec["trainer"]](spec, rec, data, tokenizer)
    probe(rec, "after_train")
    if ends is None:  # no optimizer steps (cache_write): timed as a whole
        write_rank_record(spec["out"], rank, rec)
        teardown_process_group()
        return
    warm = spec["warmup"]
    rec["step_ends"] = ends
    rec["timed_steps"] = len(ends) - warm
    rec["timed_seconds"] = ends[-1] - ends[warm - 1]
    rec["torch_threads"] = torch.get_num_threads()
    rec["loss_token_fraction"] = spec["loss_token_fraction"]
    split = rec.pop("split", None)
    if split is not None:  # after the memory probes: the plain teacher copy is not counted in them
        rec["split"] = split.per_step(warm, rec["timed_seconds"] / rec["timed_steps"])
        rows = spec["batch"] * spec.get("accumulation", 1)
        rec["split"]["teacher_compute"] = teacher_compute_seconds(spec, rows, with_head=spec["trainer"] == "gkd")
        rec["split"]["teacher_gather"] = max(0.0, rec["split"]["teacher"] - rec["split"]["teacher_compute"])
    write_rank_record(spec["out"], rank, rec)
    teardown_process_group()  # all ranks together (a barrier first), as trl_distill does at exit


if __name__ == "__main__":
    main()
