"""2-process on-policy runs on CPU (gloo) with an FSDP2 student (accelerate's `fsdp_version: 2`) beside a teacher
sharded with FSDP2 on its own, one trainer after another in one launch. Records per rank the rows each step sampled,
the logs and what the run's mode measures into ``<out>/<mode>/rank<k>.json``.

    fsdp2_modes_worker.py PAIR OUT MODE [MODE ...]
    fsdp2_modes_worker.py PAIR OUT vllm=STUDENT@URL@PORT

MODE: student (lmbda=1: the student samples with HF generate; a generation eval with `eval_reward_funcs` at steps 2
and 3, and `evaluate()` before `train()`, refused) | teacher (seq_kd: the sharded teacher samples) | sampled_token
(lmbda=1 under the sampled-token objective) | vllm, vllm_lora (lmbda=1 from the rollout server at URL serving
STUDENT, a full or a LoRA student; the weights are gathered at step 2, and after the run rank 0 records the server's
log-probs of a probe beside those of the gathered weights (merged for LoRA) and of the initial ones).

The student's FSDP2 groups reshard after each forward (every forward is collective), and under HF generate rank 1
samples completions half as long as rank 0's, as if it met EOS first: it must keep stepping until rank 0 is done.
"""

import os
import sys

import torch
from accelerate.state import AcceleratorState
from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, with_answers, write_rank_record

FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                                               "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                               "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
PROBE = "def probe(x):\n    return x + 1\n"
MODES = {
    "student": dict(lmbda=1.0, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
                    eval_reward_funcs=["trl_distill.testing:even_length_reward"]),
    "teacher": dict(lmbda=0.0, seq_kd=True),
    "sampled_token": dict(lmbda=1.0, on_policy_objective="sampled_token", temperature=1.0),
    "vllm": dict(lmbda=1.0, use_vllm=True, vllm_server_timeout=120),
}
MODES["vllm_lora"] = MODES["vllm"]


def lora():
    """A LoRA adapter that starts non-zero (the server then serves base + delta from the first sync)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def gathered_state(model) -> dict:
    """The student's full weights (every parameter's `full_tensor()`, collective: every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


class GatherAtStep(TrainerCallback):
    """Gathers the student's full weights (`gathered_state`) at the end of optimizer step `step`, on every rank."""

    def __init__(self, model, step: int):
        self.model, self.step, self.state = model, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.state = gathered_state(self.model)


def probe_logprobs(student_dir: str, state: dict, tokenizer, peft: bool = False) -> list[float]:
    """The log-probs of the probe's tokens from a plain copy of the student holding `state` (`peft`: a LoRA
    student's, merged into its base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    if peft:
        from peft import get_peft_model

        model = get_peft_model(model, lora())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and (not state or {m.split(".")[-2] for m in missing} <= {"lm_head"}), (missing, unexpected)
    model = model.merge_and_unload() if peft else model
    ids = tokenizer(PROBE)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def run(pair: str, out: str, spec: str, rank: int) -> dict:
    mode, _, server = spec.partition("=")
    student, teacher = os.path.join(pair, "student"), os.path.join(pair, "teacher")
    extra = dict(MODES[mode])
    if mode.startswith("vllm"):
        student, url, port = server.split("@")
        extra.update(vllm_server_base_url=url, vllm_group_port=int(port))
    # rank 1 samples shorter completions than rank 0 (as if it met EOS first): it must keep stepping with rank 0
    lengths = {"max_new_tokens": 6 - 3 * rank, "eval_max_new_tokens": 6 - 3 * rank} if server == "" else \
        {"max_new_tokens": 6}
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    data = with_answers(synthetic_prompt_completion(32))
    config = DistillationConfig(**tiny_run_settings(output_dir=os.path.join(out, mode), max_steps=3,
                                                    per_device_train_batch_size=2, save_strategy="no",
                                                    **lengths, **extra), **FSDP2)
    trainer = DistillationTrainer(student, teacher, args=config, train_dataset=data,
                                  eval_dataset=data.select(range(6)) if "eval_steps" in extra else None,
                                  processing_class=tokenizer, peft_config=lora() if mode == "vllm_lora" else None)
    record = {"sampled": {}, "versions": [], "rank": rank}
    sample = trainer.sampler.sample

    def recording(source, batch, *args, **kwargs):
        new, completions = sample(source, batch, *args, **kwargs)
        if not trainer.is_in_train:
            record["sampled_before_train"] = record.get("sampled_before_train", 0) + 1
        elif not args and not kwargs.get("sampling"):  # training's samples (not the generation eval's)
            record["sampled"][str(trainer.state.global_step + 1)] = {
                "source": source, "completions": [c.tolist() for c in completions],
                "input_ids": new["input_ids"].tolist(), "attention_mask": new["attention_mask"].tolist(),
                "labels": new["labels"].tolist()}
            if server and rank == 0:
                record["versions"].append(trainer.sampler.engine.client.weight_version())
        return new, completions

    trainer.sampler.sample = recording
    synced = GatherAtStep(trainer.model, 2)  # the weights the server samples step 3 from (synced before it)
    if server:
        trainer.add_callback(synced)
    if mode == "student":  # refused before the (not yet sharded) student generates anything
        try:
            trainer.evaluate()
        except ValueError as error:
            record["eval_before_refused"] = str(error)
    trainer.train()
    record["log_history"] = trainer.state.log_history
    record["is_fsdp2"] = trainer.accelerator.is_fsdp2
    if server and rank == 0:  # the server's log-probs of a probe beside those of the gathered weights
        from trl_distill.rollout.engine_client import RolloutServerClient

        client = RolloutServerClient(url, timeout=60)
        client.connect(tokenizer)
        record["server_version"] = client.weight_version()
        record["server_logprobs"] = client.prompt_logprobs(tokenizer(PROBE)["input_ids"])
        record["gathered_logprobs"] = probe_logprobs(student, synced.state, tokenizer, mode == "vllm_lora")
        record["initial_logprobs"] = probe_logprobs(student, {}, tokenizer)  # the base's
    return record


def main():
    pair, out, *modes = sys.argv[1:]
    rank = int(os.environ["RANK"])
    for spec in modes:
        record = run(pair, out, spec, rank)
        write_rank_record(os.path.join(out, spec.partition("=")[0]), rank, record)
        torch.distributed.barrier()
        AcceleratorState._reset_state()  # the next trainer builds its own accelerator


if __name__ == "__main__":
    main()
