"""The GPU run's training rows: what each runs (`ROWS`), the models they read (`build_models`) and each one's spec for
`benchmarks/trainer_worker.py` (`spec_of`).

Every row trains on the same rows of random token ids (a ~10 % prompt, the rest completion) with a ZeRO-2 student of
the same shape beside the same teacher (on one process trl_distill holds it whole on the device; GKD prepares its own),
forward KL at T = 1, micro batch 1, unless its line says otherwise; ours against TRL's nearest equivalent where TRL
has one (``vs``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
Z2 = str(ROOT / "configs/deepspeed/zero2_student.json")


@dataclass(frozen=True)
class Row:
    trainer: str  # trainer_worker.py's contender
    what: str  # what it runs, for the report
    launcher: str = "torchrun"  # or "python": one plain process
    phase: str = "off_policy"  # its steps and timeout: "off_policy" or "on_policy" (the sizes' entries)
    vs: str | None = None  # the row it is compared with in the report
    settings: dict = field(default_factory=dict)  # on_policy, config, lora, student / teacher model, cache
    needs: str | None = None  # a row whose output it reads: run before it


ROWS = {
    "ours_one_process": Row("ours", "ours, one plain python process (no launcher)", launcher="python"),
    "ours_torchrun_1": Row("ours", "ours under torchrun --nproc_per_node 1", vs="gkd_torchrun_1"),
    "gkd_torchrun_1": Row("gkd", "TRL GKDTrainer, lmbda 0, beta 0 (off-policy forward KL), the same ZeRO-2 config"),
    "ours_on_policy": Row("ours", "ours on-policy: lmbda 1, the student samples each completion with HF generate",
                          phase="on_policy", vs="gkd_on_policy", settings={"on_policy": True}),
    "gkd_on_policy": Row("gkd", "TRL GKDTrainer on-policy: lmbda 1, beta 0 (its own HF generate)", phase="on_policy",
                         settings={"on_policy": True}),
    "ours_sampled_token": Row("ours", "ours on-policy with the sampled-token objective (a policy gradient on the "
                              "sampled tokens, reward log p_teacher - log p_student); TRL has none",
                              phase="on_policy", vs="ours_on_policy",
                              settings={"on_policy": True, "config": {"on_policy_objective": "sampled_token"}}),
    "ours_fsdp2": Row("ours", "ours with an FSDP2 student beside an FSDP2 teacher (accelerate fsdp_version 2) "
                      "instead of the DeepSpeed pair; one GPU runs it at world size 1, nothing to shard over (the CPU "
                      "dry run, where one process cannot run FSDP, runs it as ours_torchrun_1)", vs="ours_torchrun_1",
                      settings={"fsdp2": True}),
    "ours_lora": Row("ours", "ours, LoRA student (peft; the base frozen)", vs="gkd_lora", settings={"lora": True}),
    "gkd_lora": Row("gkd", "TRL GKDTrainer, lmbda 0, beta 0, the same LoRA (peft_config)", settings={"lora": True}),
    "ours_moe": Row("ours", "ours, a Mixture-of-Experts student (Mixtral) with its router loss "
                    "(router_aux_loss_coef 0.02); TRL's GKDTrainer drops the router loss", vs="ours_torchrun_1",
                    settings={"student": "student_moe", "config": {"router_aux_loss_coef": 0.02}}),
    "ours_cross_tokenizer": Row("cli", "ours (trl-distill's trainer), a teacher of another tokenizer (byte-level BPE) "
                                "on the same rows as text; TRL's GOLD not run (README)", vs="ours_torchrun_1",
                                settings={"teacher": "teacher_other"}),
    "cache_write": Row("cache_write", "trl-distill cache-teacher: the teacher's top-k of every row into a cache "
                       "(packed 7bit)", settings={"cache": "write"}),
    "ours_from_cache": Row("cli", "ours (trl-distill's trainer) from that cache: no teacher in the job; TRL has none",
                           vs="ours_torchrun_1", settings={"cache": "read"}, needs="cache_write"),
}


def models_needed(names: list[str]) -> set[str]:
    """The extra models the rows `names` read: ``student_moe``, ``teacher_other``, ``text`` (the rows as words)."""
    needed = set()
    for name in names:
        row = ROWS[name]
        needed |= {row.settings[k] for k in ("student", "teacher") if k in row.settings}
        if row.trainer in ("cli", "cache_write"):
            needed.add("text")
    return needed


def data_spec(sizes: dict, phase: str) -> dict:
    seq, steps = sizes["seq_len"], sizes[phase]["steps"]
    return {"vocab_size": sizes["vocab_size"], "seq_len": seq, "prompt_len_range": [seq * 3 // 40, seq * 5 // 40],
            "data_seed": 0, "num_examples": steps}


def build_models(sizes: dict, directory: Path, needed: set[str]) -> dict:
    """The tokenizer, teacher and student (and the `needed` extras) saved under `directory`, each model with its
    tokenizer (built on the GPU when there is one, in the run's dtype)."""
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_distill.testing import build_tokenizer, tiny_llama_config

    sys.path.insert(0, str(HERE.parent))  # benchmarks/
    from trainer_worker import dataset
    from trainers import synthetic_tokenizer

    tokenizer = synthetic_tokenizer(sizes["vocab_size"])
    out = {"tokenizer": str(directory / "tokenizer")}
    tokenizer.save_pretrained(out["tokenizer"])
    seq = sizes["seq_len"]
    plan = [("teacher", 0, tokenizer, lambda: tiny_llama_config(tokenizer, "teacher", max_position_embeddings=seq,
                                                                **sizes["teacher"])),
            ("student", 1, tokenizer, lambda: tiny_llama_config(tokenizer, "student", max_position_embeddings=seq,
                                                                **sizes["student"]))]  # fmt: skip
    if needed & {"text", "teacher_other"}:  # the same rows as words of the synthetic vocabulary
        rows = dataset(data_spec(sizes, "off_policy"))
        words = [tokenizer.convert_ids_to_tokens(r["input_ids"]) for r in rows]
        cuts = [r["completion_mask"].index(1) for r in rows]
        text = [{"prompt": " ".join(w[:c]), "completion": " " + " ".join(w[c:])} for w, c in zip(words, cuts)]
        out["text"] = str(directory / "rows.jsonl")
        Path(out["text"]).write_text("".join(json.dumps(r) + "\n" for r in text))
    if "teacher_other" in needed:  # a byte-level BPE learnt on those rows: each word one token or several
        other = build_tokenizer(sizes["other_vocab_size"], corpus=[r["prompt"] + r["completion"] for r in text])
        plan.append(("teacher_other", 0, other, lambda: tiny_llama_config(  # (~2.3 of its tokens a word)
            other, "teacher", max_position_embeddings=3 * seq, **sizes["teacher"])))
    if "student_moe" in needed:
        ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        plan.append(("student_moe", 1, tokenizer, lambda: AutoConfig.for_model(
            "mixtral", vocab_size=len(tokenizer), max_position_embeddings=seq, tie_word_embeddings=False, **ids,
            **sizes["student_moe"])))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, seed, its_tokenizer, config in plan:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config(), dtype=getattr(torch, sizes["dtype"]))
        out[name], out[f"{name}_params"] = str(directory / name), sum(p.numel() for p in model.parameters())
        model.save_pretrained(out[name])
        its_tokenizer.save_pretrained(out[name])
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def spec_of(name: str, sizes: dict, models: dict, out: Path, work: Path) -> dict:
    """`name`'s spec for trainer_worker.py, its output under `out` (a teacher cache under `work`)."""
    import torch

    row = ROWS[name]
    settings, phase = row.settings, sizes[row.phase]
    bf16 = sizes.get("bf16", True)
    spec = {"trainer": row.trainer, "deepspeed": Z2, "out": str(out), "student": models["student"],
            "teacher": models["teacher"], "tokenizer": models["tokenizer"], **data_spec(sizes, row.phase),
            "batch": 1, "accumulation": 1, "steps": phase["steps"], "warmup": phase["warmup"], "bf16": bf16,
            "log_distill_metrics": False, "config": dict(settings.get("config", {}))}  # fmt: skip
    if settings.get("on_policy"):
        spec["config"].update(lmbda=1.0, max_new_tokens=phase["new_tokens"])
    if settings.get("lora"):
        spec["lora"] = sizes["lora"]
    if settings.get("fsdp2") and torch.cuda.is_available():  # (one CPU process has no FSDP: see the row)
        spec.update(deepspeed=None, fsdp2=True)
    if "student" in settings:
        spec["student"] = models[settings["student"]]
    if row.trainer in ("cli", "cache_write"):
        flags = ["--model_name_or_path", spec["student"], "--dataset_name", models["text"], "--max_steps",
                 str(phase["steps"]), "--per_device_train_batch_size", "1", "--learning_rate", "1e-4",
                 "--lr_scheduler_type", "constant", "--seed", "0", "--bf16", str(bf16).lower(),
                 "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true",
                 "--save_strategy", "no", "--logging_steps", "1000000", "--deepspeed", Z2,
                 "--dataloader_num_workers", "0", "--alpha", "1", "--temperature", "1", "--divergence", "forward_kl",
                 "--log_distill_metrics", "false", "--max_length", str(3 * sizes["seq_len"])]  # fmt: skip
        if bf16 and not torch.cuda.is_available():  # transformers' bf16 on a CPU needs it (as common_args)
            flags += ["--use_cpu", "true"]
        cache = str(work / "teacher_cache")
        if settings.get("cache") == "write":
            flags += ["--teacher_model_name_or_path", models["teacher"], "--teacher_cache", cache, "--cache_top_k",
                      str(sizes["cache_top_k"])]  # fmt: skip
        elif settings.get("cache") == "read":
            flags += ["--teacher_cache", cache, "--output_dir", str(out)]
        else:
            flags += ["--teacher_model_name_or_path", models[settings.get("teacher", "teacher")], "--output_dir",
                      str(out)]  # fmt: skip
        spec["argv"] = flags
    return spec
