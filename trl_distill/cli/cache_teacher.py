"""`trl-distill cache-teacher`: run the teacher once over the training set and store its top-k distribution.

    accelerate launch --config_file configs/accelerate/zero2_student_zero3_teacher.yaml -m trl_distill cache-teacher \
        --teacher_cache DIR --cache_top_k 64 [every flag of the training command: --config, --dataset_name, ...]

Takes the training command's flags, so the data is prepared exactly as training will prepare it (the student is
loaded for its tokenizer and that preparation only; it is not run). With DeepSpeed the teacher is ZeRO-3,
partitioned across the ranks. Run it again after a crash: it continues from the last complete shard.
Then train with ``--teacher_cache DIR`` instead of ``--teacher_model_name_or_path``.

With ``--teacher_server URL`` the top-k comes from a vLLM server of the teacher instead (``vllm serve TEACHER
--max-logprobs K``; ``--teacher_model_name_or_path`` then names the served model), each process sending its rows
with ``--teacher_server_concurrency`` requests in flight; no teacher is loaded here and DeepSpeed is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.trainer_utils import IntervalStrategy


@dataclass
class CacheArguments:
    cache_top_k: int = field(default=64, metadata={"help": "Teacher token ids (and log-probs) kept per loss token."})
    cache_shard_rows: int = field(default=1024, metadata={"help": "Training rows per shard file (the unit of resume)."})
    cache_log_prob_dtype: str = field(
        default="7bit",
        metadata={"help": "Storage of the top-k: 7bit (ids bit-packed, log-probs as 7-bit codes below the top-1, the "
                  "tail mass exact: ~3 bytes per entry, see trl_distill/cache/packing.py), float16 or float32 "
                  "(int32 ids and exact log-probs: 6 or 8 bytes per entry).",
                  "choices": ["7bit", "float16", "float32"]},
    )
    cache_batch_size: int | None = field(
        default=None, metadata={"help": "Rows per teacher forward and rank (default: per_device_eval_batch_size)."}
    )


def main(argv: list[str]) -> None:
    from trl import ModelConfig, ScriptArguments, TrlParser

    from ..cache.writer import fill_teacher_cache, open_teacher_cache
    from ..config import DistillationConfig
    from ..run_plan import resolve
    from ..teacher.resolve import check_cacheable_teacher
    from .errors import errors_as_messages, faults_as_messages, sigterm_raises
    from .train import build_trainer, check_student_eos, parse_recipe

    parser = TrlParser((ScriptArguments, DistillationConfig, ModelConfig, CacheArguments),
                       prog="trl-distill cache-teacher")
    with sigterm_raises():
        with errors_as_messages("trl-distill cache-teacher"):
            script_args, training_args, model_args, cache_args = parse_recipe(parser, argv)
            resolve(training_args)  # how the fields combine: one line before anything loads
            check_student_eos(script_args, training_args, model_args)
            directory = training_args.teacher_cache
            if not directory:
                raise ValueError("Pass the directory to write the cache to with --teacher_cache DIR.")
            check_cacheable_teacher(training_args)
            if training_args.teacher_server:  # the server's top-k: as many as the cache keeps
                training_args.teacher_server_top_k = cache_args.cache_top_k
            training_args.teacher_cache = None  # this run has the live (or served) teacher; DIR is its output
            training_args.eval_strategy = IntervalStrategy.NO  # only the train split is cached
            training_args.output_dir = directory
            trainer = build_trainer(script_args, training_args, model_args)
            run = (trainer.context, trainer.teacher, trainer.train_dataset, directory)
            manifest = open_teacher_cache(*run, top_k=cache_args.cache_top_k, shard_rows=cache_args.cache_shard_rows,
                                          log_prob_dtype=cache_args.cache_log_prob_dtype, run_lock=trainer.run_lock)
        kept = len(manifest.shards)  # complete shards an earlier run wrote
        with faults_as_messages("trl-distill cache-teacher",
                                kept=lambda: f"the complete shards in {directory} are kept: the same command goes on "
                                "from them."):
            manifest = fill_teacher_cache(*run, manifest, batch_size=cache_args.cache_batch_size)
    if trainer.accelerator.is_main_process:
        print(cache_line(manifest, directory, kept))


def cache_line(manifest, directory: str, kept: int) -> str:
    """The end of a `cache-teacher` run, said as it is: written, partly kept from an earlier run, or already whole."""
    tokens = sum(s["tokens"] for s in manifest.shards)
    size = sum(s["bytes"] for s in manifest.shards)
    totals = (f"{manifest.num_rows} rows, {tokens} loss tokens, top-{manifest.top_k}, {size} bytes "
              f"({size / max(tokens, 1):.1f} per token)")
    if kept == manifest.num_shards:
        return f"Teacher cache in {directory} was already complete, nothing written: {totals}"
    resumed = f" ({kept} of its {manifest.num_shards} shards kept from an earlier run)" if kept else ""
    return f"Teacher cache written to {directory}{resumed}: {totals}"
