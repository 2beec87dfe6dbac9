"""Run the teacher once over the prepared training set and store its sparse signal (see `loss.sparse`) on disk.

Works with any kind of teacher that writes a top-k (`teacher.capabilities.WritesCache`): each shard's batches are dealt
to the ranks, rank 0 gathers the rows and writes the shard. A ZeRO-3 teacher stays partitioned over the ranks and
every rank runs every forward (its gathers are collective); a served teacher gets each rank's batches through the
run's collator (`teacher.served`), several requests in flight.
A killed run is resumed by running it again: complete shards (listed in the manifest, with their size) are kept,
anything else is recomputed, so the finished cache is byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from accelerate.utils import broadcast_object_list, gather_object

from ..runtime.run_lock import LOCK_NAME
from ..teacher.capabilities import CACHE_REFUSAL, WritesCache, required
from .manifest import MANIFEST, Manifest, dataset_fingerprint, tokenizer_hash
from .shards import LOG_PROB_DTYPES, file_sha256, is_partial_shard, is_shard, shard_name, write_shard


def open_teacher_cache(context, teacher, dataset, directory: str, *, top_k: int = 64, shard_rows: int = 1024,
                       log_prob_dtype: str = "7bit", run_lock=None) -> Manifest:
    """Check the settings and decide what a (re-)run still has to write of `teacher`'s top-k over the prepared
    `dataset` (the run's `RunContext`: its arguments, tokenizer, vocabulary): the manifest, its ``shards`` the
    complete ones to keep. Bad settings, or a directory holding another cache, raise `ValueError` on every rank
    before the teacher runs (a `run_lock` on `directory` released first). Collective."""
    if log_prob_dtype not in LOG_PROB_DTYPES:
        raise ValueError(f"log_prob_dtype must be one of {', '.join(LOG_PROB_DTYPES)}, got {log_prob_dtype!r}.")
    if top_k < 1 or top_k > context.vocab_size:
        raise ValueError(f"top_k must be in [1, the vocabulary size {context.vocab_size}], got {top_k}.")
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}.")
    writer = required(teacher, WritesCache, CACHE_REFUSAL)  # a teacher model or server writes its top-k
    if "labels" not in dataset.column_names:
        raise ValueError("The prepared train dataset has no `labels` column; the cache needs SFT's dataset "
                         "preparation (an SFTConfig / DistillationConfig, not skip_prepare_dataset).")
    args, accelerator = context.args, context.accelerator
    manifest = Manifest(
        teacher=teacher.name, teacher_revision=writer.revision,
        tokenizer_hash=tokenizer_hash(context.processing_class), vocab_size=context.vocab_size, top_k=top_k,
        temperature=args.temperature, max_length=args.max_length, log_prob_dtype=log_prob_dtype,
        dataset_fingerprint=dataset_fingerprint(dataset), num_rows=len(dataset), shard_rows=shard_rows,
    )  # fmt: skip
    # Rank 0 decides what is already done; every rank learns it (and any error) from it, so none hangs.
    decision = [_resume_point(manifest, directory) if accelerator.is_main_process else None]
    decision = broadcast_object_list(decision, from_process=0)[0]
    if isinstance(decision, str):
        # cache-teacher's lock, on this directory: leave it as it was found
        if run_lock is not None and os.path.realpath(run_lock.output_dir) == os.path.realpath(directory):
            run_lock.release()
        raise ValueError(decision)
    manifest.shards = decision
    return manifest


def fill_teacher_cache(context, teacher, dataset, directory: str, manifest: Manifest, *,
                       batch_size: int | None = None, on_shard: Callable[[int], None] | None = None) -> Manifest:
    """Run `teacher` over the rows of `dataset` in every shard `manifest` does not hold yet and write them. Each
    shard's batches are dealt to the ranks; ``on_shard(index)`` runs on every rank after each shard is on disk."""
    args, accelerator = context.args, context.accelerator
    top_k, log_prob_dtype = manifest.top_k, manifest.log_prob_dtype
    done = {shard["index"] for shard in manifest.shards}
    columns = dataset.select_columns(["input_ids", "labels"])
    writer = required(teacher, WritesCache, CACHE_REFUSAL)
    if len(done) < manifest.num_shards:
        writer.open_for_cache(columns, top_k)  # collective for a teacher model
    batch_size = batch_size or args.per_device_eval_batch_size
    for index in range(manifest.num_shards):
        if index in done:
            continue
        rows = manifest.shard_range(index)
        batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        mine = batches[accelerator.process_index :: accelerator.num_processes]
        steps = -(-len(batches) // accelerator.num_processes)  # what every rank runs, for a collective teacher
        records = writer.cache_records(columns, mine, steps, batches[0], top_k, args.temperature)
        records = gather_object(records) if accelerator.num_processes > 1 else records
        if accelerator.is_main_process:
            records.sort(key=lambda r: r["row"])
            path = os.path.join(directory, shard_name(index))
            size = write_shard(path, records, log_prob_dtype, manifest.vocab_size)
            tokens = sum(len(r["positions"]) for r in records)
            manifest.shards.append({"index": index, "file": shard_name(index), "rows": [rows.start, rows.stop],
                                    "tokens": tokens, "bytes": size, "sha256": file_sha256(path)})
            manifest.complete = len(manifest.shards) == manifest.num_shards
            manifest.save(directory)
        accelerator.wait_for_everyone()
        if on_shard is not None:
            on_shard(index)
    manifest.complete = True
    if accelerator.is_main_process:
        manifest.save(directory)
    accelerator.wait_for_everyone()
    return manifest


def _resume_point(manifest: Manifest, directory: str) -> list[dict] | str:
    """The complete shards to keep (creating the directory and manifest if new), or an error message. Touches only
    what a cache writer makes: a directory holding other files and no manifest is refused as it is."""
    os.makedirs(directory, exist_ok=True)
    names = os.listdir(directory)
    theirs = sorted(name for name in names if not ours(name))
    if theirs and not os.path.exists(os.path.join(directory, MANIFEST)):
        shown = ", ".join(repr(n) for n in theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        return (f"{directory} is not empty and holds no teacher cache ({shown}): pass an empty or new "
                "--teacher_cache directory; nothing there was touched.")
    try:
        existing = Manifest.load(directory)
    except ValueError as error:
        return str(error)
    if existing is None and any(is_shard(name) for name in names):
        return f"{directory} holds shards but no manifest.json: pass an empty or new --teacher_cache directory."
    if existing is not None and existing.settings() != manifest.settings():
        differs = [f"{k}: {existing.settings()[k]!r} there, {v!r} now" for k, v in manifest.settings().items()
                   if existing.settings()[k] != v]
        return (f"{directory} holds a teacher cache with other settings ({'; '.join(differs)}). Pass another "
                "--teacher_cache directory, or delete that one to rewrite it.")
    for leftover in names:  # a shard a killed run of this cache was writing: never read, rewritten whole
        if is_partial_shard(leftover):
            os.remove(os.path.join(directory, leftover))
    if existing is None:
        manifest.save(directory)
        return []
    kept = [s for s in existing.shards if _whole(directory, s)]
    if len(kept) < len(existing.shards) or existing.complete != (len(kept) == manifest.num_shards):
        existing.shards, existing.complete = kept, len(kept) == manifest.num_shards
        existing.save(directory)
    return kept


def ours(name: str) -> bool:
    """Whether a file named `name` in a cache directory is one trl_distill writes there: the manifest (and its
    temporary), shards and partial shards, the run's lock and write probe."""
    return (name in (MANIFEST, MANIFEST + ".tmp") or is_shard(name) or is_partial_shard(name)
            or name.startswith((LOCK_NAME, ".trl_distill_write_probe_")))


def _whole(directory: str, shard: dict) -> bool:
    path = os.path.join(directory, shard["file"])
    return os.path.exists(path) and os.path.getsize(path) == shard["bytes"]
