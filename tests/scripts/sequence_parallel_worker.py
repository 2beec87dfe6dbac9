"""2 processes, ZeRO-2 student + a ZeRO-3 teacher (or its cache), rows of 2k tokens, SGD: with sequence parallelism
(``sp``: both ranks hold half of each row) or without (``dp``: each rank its own rows). Records into
``<out>/rank<k>.json`` the logged losses, the student's weights after training (SGD: their change is the
gradient), and the sequence lengths each rank's attention saw (local shard, whole sequence).

    sequence_parallel_worker.py <pair dir> <out> <sp|dp> <grad accumulation> <tokens> [cache dir | server URL]

Modes joined by '+' (``dp+sp+dp``) train one trainer after another in this process, each into ``<out>/<i>-<mode>``
with the accumulation of its mode (``dp``: 1, ``sp``: the one given), as separate processes would.

Environment: SP_WORKER_ARGS (JSON, more config fields), SP_WORKER_LORA (a LoRA student).
"""

import json
import os
import sys

import torch
from teacher_step_worker import STUDENT_ZERO2
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.testing import long_prompt_completion, tiny_run_settings, write_rank_record


def main():
    pair, out, modes, accumulation, tokens = sys.argv[1:6]
    cache = sys.argv[6] if len(sys.argv) > 6 else None
    if "+" not in modes:
        return train(pair, out, modes, accumulation, int(tokens), cache)
    for i, mode in enumerate(modes.split("+")):
        train(pair, os.path.join(out, f"{i}-{mode}"), mode, accumulation if mode == "sp" else 1, int(tokens), cache)


def train(pair: str, out: str, mode: str, accumulation, tokens: int, cache: str | None) -> None:
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "student"))  # saved beside the student
    if cache and cache.startswith("http"):  # a vLLM server of the teacher
        teacher = {"teacher_server": cache, "teacher_model_name_or_path": "teacher"}
    else:
        teacher = {"teacher_cache": cache} if cache else {"teacher_model_name_or_path": os.path.join(pair, "teacher")}
    settings = dict(
        output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=int(accumulation), max_steps=2,
        save_strategy="no", deepspeed=STUDENT_ZERO2, max_length=tokens, optim="sgd", learning_rate=0.5,
        sequence_parallel_size=2 if mode == "sp" else 1, **teacher,
    )
    args = DistillationConfig(**tiny_run_settings(**{**settings, **json.loads(os.environ.get("SP_WORKER_ARGS", "{}"))}))
    data = long_prompt_completion(8, tokens)
    lora = None
    if os.environ.get("SP_WORKER_LORA"):  # a LoRA student
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = DistillationTrainer(os.path.join(pair, "student"), args=args, train_dataset=data, processing_class=tok,
                                  peft_config=lora)
    start = trainer.get_batch_samples

    rows, attention = [], []  # the run's sharded attention (uninstalled, and let go, as training ends)

    def recording(*a, **k):
        result = start(*a, **k)
        rows.append([int(b["input_ids"].sum()) for b in result[0]])
        if trainer.sequence_parallel_scope is not None and not attention:
            attention.append(trainer.sequence_parallel_scope.attention)
            attention[0].recording = True
        return result

    trainer.get_batch_samples = recording
    trainer.train()
    rec = {"rank": trainer.args.process_index, "log_history": trainer.state.log_history, "rows": rows,
           "seen": sorted(set(map(tuple, attention[0].seen))) if mode == "sp" else []}
    torch.save({n: p.detach().clone() for n, p in trainer.student.named_parameters()},
               os.path.join(out, f"weights{rec['rank']}.pt"))
    write_rank_record(out, rec["rank"], rec)


if __name__ == "__main__":
    main()
