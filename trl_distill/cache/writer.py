"""Run the teacher once over the prepared training set and store its sparse signal (see `sparse_losses`) on disk.

Works with the teacher as `DistillationTrainer` prepares it, so a ZeRO-3 teacher stays partitioned over the ranks:
each shard's batches are dealt to the ranks, every rank runs every teacher forward (ZeRO-3 gathers are
collective), rank 0 gathers the rows and writes the shard. With a served teacher (``teacher_server``) each rank
sends its batches to the server through the trainer's collator (`served_signal`), several requests in flight.
A killed run is resumed by running it again: complete shards (listed in the manifest, with their size) are kept,
anything else is recomputed, so the finished cache is byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

import torch
from accelerate.utils import broadcast_object_list, gather_object

from ..compat import prepare_inputs
from ..logit_check import probe_inputs, settle_logit_paths
from ..modeling import gathered
from ..signal_batch import SIGNAL
from ..sparse_losses import top_k_teacher_signal
from ..teacher_step import loss_tokens
from .manifest import Manifest, dataset_fingerprint, tokenizer_hash
from .shards import LOG_PROB_DTYPES, file_sha256, shard_name, write_shard

# Loss tokens projected through the teacher's lm_head at a time (bounds the [rows, V] logits)
_ROWS_PER_PROJECTION = 256


def write_teacher_cache(
    trainer,
    directory: str,
    *,
    top_k: int = 64,
    shard_rows: int = 1024,
    batch_size: int | None = None,
    log_prob_dtype: str = "7bit",
    on_shard: Callable[[int], None] | None = None,
) -> Manifest:
    """Cache the teacher of `trainer` (a `DistillationTrainer` with a teacher) over its prepared train dataset:
    `open_teacher_cache` then `fill_teacher_cache`. Collective: call on every rank. Returns the complete manifest."""
    manifest = open_teacher_cache(trainer, directory, top_k=top_k, shard_rows=shard_rows, log_prob_dtype=log_prob_dtype)
    return fill_teacher_cache(trainer, directory, manifest, batch_size=batch_size, on_shard=on_shard)


def open_teacher_cache(trainer, directory: str, *, top_k: int = 64, shard_rows: int = 1024,
                       log_prob_dtype: str = "7bit") -> Manifest:
    """Check the settings and decide what a (re-)run still has to write: the manifest, its ``shards`` the complete
    ones to keep. Bad settings, or a directory holding another cache, raise `ValueError` on every rank before the
    teacher runs. Collective."""
    if log_prob_dtype not in LOG_PROB_DTYPES:
        raise ValueError(f"log_prob_dtype must be one of {', '.join(LOG_PROB_DTYPES)}, got {log_prob_dtype!r}.")
    if top_k < 1 or top_k > trainer.vocab_size:
        raise ValueError(f"top_k must be in [1, the vocabulary size {trainer.vocab_size}], got {top_k}.")
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}.")
    dataset = trainer.train_dataset
    if "labels" not in dataset.column_names:
        raise ValueError("The prepared train dataset has no `labels` column; the cache needs SFT's dataset "
                         "preparation (an SFTConfig / DistillationConfig, not skip_prepare_dataset).")
    args, accelerator = trainer.args, trainer.accelerator
    if trainer.served_teacher is not None:
        teacher_name, revision = trainer.served_teacher.name, None
    else:
        source, revision = trainer.teacher.source, trainer.teacher.init_kwargs.get("revision")
        teacher_name = source if isinstance(source, str) else getattr(source.config, "_name_or_path", "")
    manifest = Manifest(
        teacher=teacher_name, teacher_revision=revision,
        tokenizer_hash=tokenizer_hash(trainer.processing_class), vocab_size=trainer.vocab_size, top_k=top_k,
        temperature=args.temperature, max_length=args.max_length, log_prob_dtype=log_prob_dtype,
        dataset_fingerprint=dataset_fingerprint(dataset), num_rows=len(dataset), shard_rows=shard_rows,
    )  # fmt: skip
    # Rank 0 decides what is already done; every rank learns it (and any error) from it, so none hangs.
    decision = [_resume_point(manifest, directory) if accelerator.is_main_process else None]
    decision = broadcast_object_list(decision, from_process=0)[0]
    if isinstance(decision, str):
        raise ValueError(decision)
    manifest.shards = decision
    return manifest


def fill_teacher_cache(trainer, directory: str, manifest: Manifest, *, batch_size: int | None = None,
                       on_shard: Callable[[int], None] | None = None) -> Manifest:
    """Run the teacher over the rows of every shard `manifest` does not hold yet and write them. Each shard's
    batches are dealt to the ranks; ``on_shard(index)`` runs on every rank after each shard is on disk."""
    args, accelerator = trainer.args, trainer.accelerator
    top_k, log_prob_dtype = manifest.top_k, manifest.log_prob_dtype
    done = {shard["index"] for shard in manifest.shards}
    columns = trainer.train_dataset.select_columns(["input_ids", "labels"])
    served = trainer.served_teacher is not None
    if served:
        trainer.served_teacher.top_k = top_k  # the cache's k, whatever the run's teacher_server_top_k
    if len(done) < manifest.num_shards and not served:
        trainer.prepare_teacher()  # collective
        _settle_teacher_path(trainer, columns)
    batch_size = batch_size or args.per_device_eval_batch_size
    for index in range(manifest.num_shards):
        if index in done:
            continue
        rows = manifest.shard_range(index)
        batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        mine = batches[accelerator.process_index :: accelerator.num_processes]
        steps = 0 if served else -(-len(batches) // accelerator.num_processes)
        records = _served_rows(trainer, columns, mine) if served else []
        for step in range(steps):
            # A rank with no batch left runs the first one again and drops it: every forward is collective.
            batch_rows = mine[step] if step < len(mine) else batches[0]
            out = _teacher_rows(trainer, columns, batch_rows, top_k, args.temperature)
            records += out if step < len(mine) else []
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
    """The complete shards to keep (creating the directory and manifest if new), or an error message."""
    os.makedirs(directory, exist_ok=True)
    for leftover in glob.glob(os.path.join(directory, "*.tmp")):  # written by a killed run: never read
        os.remove(leftover)
    try:
        existing = Manifest.load(directory)
    except ValueError as error:
        return str(error)
    if existing is None:
        if any(name.endswith(".arrow") for name in os.listdir(directory)):
            return f"{directory} holds shards but no manifest.json: pass an empty or new --teacher_cache directory."
        manifest.save(directory)
        return []
    if existing.settings() != manifest.settings():
        differs = [f"{k}: {existing.settings()[k]!r} there, {v!r} now" for k, v in manifest.settings().items()
                   if existing.settings()[k] != v]
        return (f"{directory} holds a teacher cache with other settings ({'; '.join(differs)}). Pass another "
                "--teacher_cache directory, or delete that one to rewrite it.")
    kept = [s for s in existing.shards if _whole(directory, s)]
    if len(kept) < len(existing.shards) or existing.complete != (len(kept) == manifest.num_shards):
        existing.shards, existing.complete = kept, len(kept) == manifest.num_shards
        existing.save(directory)
    return kept


def _whole(directory: str, shard: dict) -> bool:
    path = os.path.join(directory, shard["file"])
    return os.path.exists(path) and os.path.getsize(path) == shard["bytes"]


def _settle_teacher_path(trainer, columns) -> None:
    """Check the teacher's fused logits against its own on the first row (see `trl_distill.logit_check`)."""
    batch = prepare_inputs(trainer, trainer.data_collator([columns[0]]))
    batch.pop("labels")
    batch.pop("shift_labels", None)
    teacher = trainer.teacher
    (path,) = settle_logit_paths([("teacher", teacher.engine, teacher.module)], probe_inputs(batch),
                                 trainer.accelerator)
    if trainer.accelerator.is_main_process:
        print(path.describe(trainer.vocab_size, batch["input_ids"].numel()), flush=True)


def _served_rows(trainer, columns, batches: list[range]) -> list[dict]:
    """The records of `batches` from the served teacher: every batch is collated (which sends its request) before
    the first answer is awaited, so `teacher_server_concurrency` requests are in flight."""
    pending = []
    for rows in batches:
        examples = [columns[i] for i in rows]
        batch = trainer.data_collator(examples)
        pending.append((rows, examples, loss_tokens(batch)[1], batch.pop(SIGNAL)))
    records = []
    for rows, examples, mask, holder in pending:
        signal = holder.signal
        ends = mask.sum(1).cumsum(0).tolist()
        for b, row in enumerate(rows):
            part = slice(ends[b - 1] if b else 0, ends[b])
            records.append({"row": row, "input_ids": examples[b]["input_ids"],
                            "positions": mask[b].nonzero().squeeze(1).numpy(),
                            "top_k_ids": signal.ids[part].numpy(), "top_k_log_probs": signal.log_probs[part].numpy(),
                            "tail_log_prob": signal.tail_log_prob[part].numpy()})
    return records


@torch.no_grad()
def _teacher_rows(trainer, columns, rows: range, top_k: int, temperature: float) -> list[dict]:
    """The sparse teacher signal of the prepared rows `rows`, one record per row."""
    examples = [columns[i] for i in rows]
    batch = prepare_inputs(trainer, trainer.data_collator(examples))
    _, mask = loss_tokens(batch)  # position t predicts labels[t + 1], as in training
    batch.pop("labels")
    batch.pop("shift_labels", None)
    keep = mask.any(0).nonzero().squeeze(1)
    features, vocab = trainer.teacher.features(batch, keep), trainer.vocab_size
    records = []
    with gathered(*(features.head.params if features.head is not None else ())):
        for b, row in enumerate(rows):
            kept = mask[b, keep].nonzero().squeeze(1)
            parts = []
            for start in range(0, kept.numel(), _ROWS_PER_PROJECTION):
                states = features.states[b, kept[start : start + _ROWS_PER_PROJECTION]]
                logits = states.float() if features.head is None else features.head.logits(states)
                parts.append(top_k_teacher_signal(logits[:, :vocab], top_k, temperature))
            positions = keep[kept]
            if parts:
                ids, log_probs, tail = (torch.cat(x) for x in zip(*parts, strict=True))
            else:
                ids, log_probs, tail = torch.empty(0, top_k), torch.empty(0, top_k), torch.empty(0)
            records.append({"row": row, "input_ids": examples[b]["input_ids"], "positions": positions.cpu().numpy(),
                            "top_k_ids": ids.cpu().numpy(), "top_k_log_probs": log_probs.cpu().numpy(),
                            "tail_log_prob": tail.cpu().numpy()})
    return records
