"""2 processes, ZeRO-2 student beside a ZeRO-3 teacher: the runs of tests/runtime/test_distill_metrics_distributed.py,
one trainer after another in one launch, each recording what every rank logged into ``<out>/<run>/rank<k>.json``.

    metrics_worker.py PAIR OUT RUN [RUN ...]     RUN: live | cache=DIR | served=URL | cross=TEACHER_DIR | nan | generate

Metric runs train one epoch of 16 rows (2 steps of 2 ranks x 2 rows x accumulation 2) at learning rate 0 with one
log at its end; ``live`` also evaluates. ``nan`` poisons rank 1's student after step 2 and records the stop.
``generate`` evaluates with `GENERATION` (the student's samples of 10 eval prompts, 2 each, judged) after training.
"""

import os
import sys

import torch
from accelerate.state import AcceleratorState
from transformers import AutoTokenizer, TrainerCallback

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.errors import ExternalError
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings, with_answers, write_rank_record

STUDENT_ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": False}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}

# The generation eval of the `generate` run (and of its 1-process reference): 10 prompts in batches of 4 (ranks get 2
# and 1 batches), 2 samples each at temperature 1
GENERATION = dict(eval_reward_funcs=["trl_distill.testing:even_length_reward", "exact_match"], num_generations_eval=2,
                  eval_temperature=1.0, eval_max_new_tokens=8, per_device_eval_batch_size=4)


class PoisonRankOne(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and args.process_index == 1:
            with torch.no_grad():
                self.trainer.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")


def run(pair: str, out: str, spec: str) -> dict:
    name, _, value = spec.partition("=")
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    teacher = os.path.join(pair, "teacher")
    settings = dict(output_dir=os.path.join(out, name), max_steps=2, logging_steps=2, learning_rate=0.0,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="no",
                    loss_chunk_size=7, deepspeed=STUDENT_ZERO2, teacher_model_name_or_path=teacher,
                    distill_metrics_every_step=True)
    student = os.path.join(pair, "student")
    if name == "cache":
        settings.update(teacher_cache=value, temperature=1.0, teacher_model_name_or_path=None)
    elif name == "served":
        student = os.path.join(os.path.dirname(value.split("|")[1]), "student")
        tok = AutoTokenizer.from_pretrained(student)
        settings.update(teacher_server=value.split("|")[0], teacher_server_top_k=5, temperature=1.0, max_length=64,
                        teacher_model_name_or_path=None)
    elif name == "cross":
        settings.update(teacher_model_name_or_path=value)
    elif name == "generate":
        settings.update(GENERATION)
    elif name == "nan":
        settings.update(max_steps=4, logging_steps=1, learning_rate=2e-3, save_strategy="steps", save_steps=2)
    data = synthetic_prompt_completion(16)
    evaluation = data if name == "live" else with_answers(synthetic_prompt_completion(10, seed=5)) \
        if name == "generate" else None
    trainer = DistillationTrainer(student, args=DistillationConfig(**tiny_run_settings(**settings)),
                                  train_dataset=data, eval_dataset=evaluation, processing_class=tok)
    record = {}
    if name == "nan":
        trainer.add_callback(PoisonRankOne(trainer))
        try:
            trainer.train()
        except ExternalError as error:
            record["stopped"] = str(error)
        record["global_step"] = trainer.state.global_step
    else:
        trainer.train()
        if name in ("live", "generate"):
            record["eval"] = trainer.evaluate()
    record["log"] = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return record


def main():
    pair, out, *runs = sys.argv[1:]
    rank = int(os.environ["RANK"])
    for spec in runs:
        record = run(pair, out, spec)
        write_rank_record(os.path.join(out, spec.partition("=")[0]), rank, record)
        AcceleratorState._reset_state()  # the next trainer builds its own accelerator (its own two plugins)


if __name__ == "__main__":
    main()
