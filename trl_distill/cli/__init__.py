"""`trl-distill`: distil a teacher into a student from the command line, the way `trl sft` trains.

    trl-distill --model_name_or_path STUDENT --teacher_model_name_or_path TEACHER --dataset_name DATA \
        --output_dir OUT [--config recipe.yaml] [--divergence reverse_kl ...] [--use_peft --lora_r 16 ...]
    trl-distill merge --adapter DIR --output DIR     # a LoRA student's adapter merged into its base model
    trl-distill plan --student S --teacher T --nodes 2 --gpus_per_node 8 --gpu_memory_gb 80   # memory per GPU
    trl-distill cache-teacher --teacher_cache DIR --cache_top_k 64 [the training flags]   # teacher top-k, once
    trl-distill --teacher_cache DIR [the training flags]            # then train students without the teacher
    trl-distill --teacher_server URL [the training flags]           # the teacher served by vLLM (`vllm serve`)
    trl-distill vllm-serve --model STUDENT --port 8000              # the student's rollout server, then:
    trl-distill --lmbda 1 --use_vllm --vllm_server_port 8000 [the training flags]   # on-policy, vLLM samples
    trl-distill report OUT                                          # OUT/report.png and report.md: the curves
    trl-distill build-ops                                           # DeepSpeed's comm op, before the first launch

Runs under `accelerate launch --config_file configs/...yaml`, `torchrun` and plain `python -m trl_distill`. Every
command parses dataclasses with transformers' `HfArgumentParser` (TRL's `TrlParser` for training, so every
`DistillationConfig` field is a flag) and reports bad input through one boundary, `cli.errors.errors_as_messages`.
"""

from __future__ import annotations

import importlib
import sys

from .train import build_trainer, make_parser

__all__ = ["build_trainer", "main", "make_parser"]

# `trl-distill NAME ...`: the tools beside training, each a module of this package with `main(argv)`
SUBCOMMANDS = {"merge": "merge", "plan": "plan", "cache-teacher": "cache_teacher", "vllm-serve": "vllm_serve",
               "report": "report", "build-ops": "build_ops"}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `trl-distill` console script and `python -m trl_distill`."""
    from ..runtime.process_setup import prepare_process

    prepare_process()  # before a subcommand reaches DeepSpeed (a stale build lock removed with one line)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(f"{__name__}.{SUBCOMMANDS[argv[0]]}").main(argv[1:])
    from .train import main as train

    return train(argv)
