"""One timed `trl-distill` training run for `benchmarks/teacher_cache.py`: the CLI's own trainer, plus a step timer.

    torchrun --nproc_per_node 2 benchmarks/cache_train_worker.py [trl-distill flags]

Rank 0 writes ``<output_dir>/step_times.json``: a ``time.perf_counter`` stamp at the end of every optimizer step
and the wall time of ``train()`` (which, with a live teacher, includes loading and partitioning it).
"""

import json
import os
import sys
import time

from _common import step_timer  # benchmarks/_common.py (the script's folder)

from trl_distill.cli import build_trainer, make_parser


def main() -> None:
    script_args, training_args, model_args = make_parser().parse_args_and_config(args=sys.argv[1:])
    trainer = build_trainer(script_args, training_args, model_args)
    timer = step_timer()
    trainer.add_callback(timer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(training_args.output_dir, "step_times.json"), "w") as f:
            json.dump({"start": start, "ends": timer.ends, "train_seconds": seconds}, f)


if __name__ == "__main__":
    main()
