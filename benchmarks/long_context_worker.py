"""One run of `make bench-long` on 2 processes: ZeRO-2 student + ZeRO-3 teacher on rows of `tokens` tokens, with
sequence parallelism 2 (``sp``: each rank holds half of every row) or without (``dp``). Two optimizer steps of one
row per rank; records into ``<out>/rank<k>.json`` the peak RSS after set-up and over training, and the step times.

    long_context_worker.py <model dir> <out> <sp|dp> <tokens>
"""

import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import step_timer  # noqa: E402
from memory_probe import reset_peak_rss  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_distill import DistillationConfig, DistillationTrainer  # noqa: E402
from trl_distill.testing import long_prompt_completion, tiny_run_settings, write_rank_record  # noqa: E402

ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": False}, "bf16": {"enabled": "auto"}}


def peak_rss() -> int:
    """This process's RSS high-water mark, bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def main():
    models, out, mode, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(models, "tokenizer"))
    args = DistillationConfig(**tiny_run_settings(
        output_dir=out, per_device_train_batch_size=1, max_steps=2, save_strategy="no", deepspeed=ZERO2,
        max_length=tokens, teacher_model_name_or_path=os.path.join(models, "teacher"),
        sequence_parallel_size=2 if mode == "sp" else 1, gradient_checkpointing=False))
    trainer = DistillationTrainer(os.path.join(models, "student"), args=args,
                                  train_dataset=long_prompt_completion(6, tokens), processing_class=tokenizer)
    timer = step_timer()
    trainer.add_callback(timer)
    setup = peak_rss()
    reset = reset_peak_rss()
    start = time.perf_counter()
    trainer.train()
    ends = [start, *timer.ends]  # the first step includes the logit check
    write_rank_record(out, trainer.args.process_index, {
        "mode": mode, "tokens": tokens, "setup_peak_rss": setup, "peak_rss": peak_rss(), "reset_worked": reset,
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "step_seconds": [b - a for a, b in zip(ends, ends[1:])],
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]})


if __name__ == "__main__":
    main()
