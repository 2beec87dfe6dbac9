"""2-process on-policy distillation (lmbda=1) with the student's rollouts from a real vLLM server, a ZeRO-3 teacher
beside the student: one trainer after another in one launch. Records per rank the first step's sampled rows and the
logs (and, on rank 0, how far the server's log-probs are from the saved checkpoint-2's after the run) into
``<out>/<mode>/rank<k>.json``.

    engine_rollout_worker.py STUDENT OUT URL MODE=TEACHER@PORT [MODE=TEACHER@PORT ...]

MODE: zero2 | zero3_student | lora | served | self | cross. TEACHER is a directory (mode cross: one with another
tokenizer), or (mode served) the URL of a vLLM server of the teacher; mode self ignores it (a LoRA student, adapters
starting at zero, distilled from its own base). PORT: the run's weight-sync group port.
"""

import os
import sys

import torch
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, write_rank_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(ROOT, "configs", "deepspeed")
PROBE = "def probe(x):\n    return x + 1\n"


def server_gap(url: str, checkpoint: str, lora: bool, student: str) -> float:
    """max |log-prob| difference on a probe between the server and the saved checkpoint (merged, for LoRA)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from trl_distill.rollout.engine_client import RolloutServerClient

    unset_hf_deepspeed_config()  # a ZeRO-3 student's run left it set: from_pretrained would partition (collective)
    if lora:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(checkpoint).merge_and_unload().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(student)
    client = RolloutServerClient(url, timeout=60)
    client.connect(tokenizer)
    ids = tokenizer(PROBE)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    ours = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return float((torch.tensor(client.prompt_logprobs(ids)) - ours).abs().max())


def run(student: str, out: str, url: str, mode: str, teacher: str, port: str, rank: int) -> dict:
    served = {"teacher_server": teacher, "temperature": 1.0, "max_length": 64} if mode == "served" else {}
    config = DistillationConfig(
        output_dir=os.path.join(out, mode), lmbda=1.0, use_vllm=True, vllm_server_base_url=url,
        vllm_group_port=int(port), vllm_server_timeout=120, max_new_tokens=6,
        deepspeed=os.path.join(DEEPSPEED, "zero3_student.json" if mode == "zero3_student" else "zero2_student.json"),
        teacher_deepspeed=os.path.join(DEEPSPEED, "zero3_teacher.json"),
        **tiny_run_settings(max_steps=3, per_device_train_batch_size=2, save_strategy="steps", save_steps=2,
                            **served),
    )
    peft = None
    if mode in ("lora", "self"):
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=mode == "self")
    trainer = DistillationTrainer(student, None if served else "self" if mode == "self" else teacher, args=config,
                                  train_dataset=synthetic_prompt_completion(32), peft_config=peft)
    record = {"sampled": {}, "versions": []}
    engine, sample = trainer.sampler.engine, trainer.sampler.sample

    def recording(source, batch):
        new, completions = sample(source, batch)
        record["sampled"][str(trainer.state.global_step + 1)] = {
            "input_ids": new["input_ids"].tolist(), "attention_mask": new["attention_mask"].tolist(),
            "labels": new["labels"].tolist()}
        cross = extras_of(new).cross_tokenizer
        if cross is not None:  # the teacher's ids and the aligned groups of the sampled rows
            teacher_ids, teacher_mask, groups, *_ = cross
            record["sampled"][str(trainer.state.global_step + 1)].update(
                teacher_ids=teacher_ids.tolist(), teacher_mask=teacher_mask.tolist(), groups=groups.tolist())
        if rank == 0:
            record["versions"].append(engine.client.weight_version())
        return new, completions

    trainer.sampler.sample = recording
    trainer.train()
    record.update(rank=rank, log_history=trainer.state.log_history)
    torch.distributed.barrier()  # checkpoint-2 is whole on every rank
    if rank == 0 and mode in ("zero2", "zero3_student", "lora"):  # the server holds step 2's weights, the last sync
        record["server_gap"] = server_gap(url, os.path.join(out, mode, "checkpoint-2"), mode == "lora", student)
    return record


def main():
    student, out, url, *runs = sys.argv[1:]
    rank = int(os.environ["RANK"])
    for spec in runs:
        mode, rest = spec.split("=", 1)
        teacher, port = rest.rsplit("@", 1)
        write_rank_record(os.path.join(out, mode), rank, run(student, out, url, mode, teacher, port, rank))
        torch.distributed.barrier()
        AcceleratorState._reset_state()  # the next trainer builds its own accelerator (its own two plugins)


if __name__ == "__main__":
    main()
