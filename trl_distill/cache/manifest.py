"""The manifest of a teacher cache: what it was computed from, and the checks that it fits a training run.

``manifest.json`` in the cache directory holds the settings (teacher, tokenizer hash, k, temperature, max length,
dtype, dataset fingerprint) and the list of complete shards; ``complete`` turns true after the last shard.
It is always replaced atomically, so a reader sees the old or the new version, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

FORMAT = "trl_distill.teacher_cache/1"
MANIFEST = "manifest.json"
# Settings that must equal between a cache and a run that resumes writing it
SETTINGS = ("format", "teacher", "teacher_revision", "tokenizer_hash", "vocab_size", "top_k", "temperature",
            "max_length", "log_prob_dtype", "dataset_fingerprint", "num_rows", "shard_rows")
SHARD_KEYS = {"index", "file", "rows", "tokens", "bytes"}  # what each entry of `shards` holds (and "sha256")


@dataclass
class Manifest:
    teacher: str
    teacher_revision: str | None
    tokenizer_hash: str
    vocab_size: int
    top_k: int
    temperature: float
    max_length: int | None
    log_prob_dtype: str
    dataset_fingerprint: str
    num_rows: int
    shard_rows: int
    format: str = FORMAT
    shards: list[dict] = field(default_factory=list)  # {"file", "rows": [start, stop], "tokens", "bytes", "sha256"}
    complete: bool = False

    @property
    def num_shards(self) -> int:
        return -(-self.num_rows // self.shard_rows)

    def shard_range(self, index: int) -> range:
        return range(index * self.shard_rows, min(self.num_rows, (index + 1) * self.shard_rows))

    def settings(self) -> dict:
        return {key: getattr(self, key) for key in SETTINGS}

    def save(self, directory: str) -> None:
        """Write ``manifest.json`` atomically (a temporary file, then a rename)."""
        path = os.path.join(directory, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, directory: str) -> Manifest | None:
        """The manifest in `directory`, None when there is none; one `ValueError` naming the file and the fix when it
        is not one this code wrote (cut short, edited, another format)."""
        path = os.path.join(directory, MANIFEST)
        if not os.path.exists(path):
            return None
        damaged = (f"Delete {directory} (or pass another --teacher_cache directory) and run `trl-distill "
                   "cache-teacher` again to rewrite the cache.")
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            where = f"{error.msg}, line {error.lineno}" if isinstance(error, json.JSONDecodeError) else "not UTF-8"
            raise ValueError(f"{path} is damaged: not valid JSON ({where}; cut short?). {damaged}") from error
        if not isinstance(values, dict):
            raise ValueError(f"{path} is damaged: it holds {type(values).__name__}, not a manifest. {damaged}")
        if values.get("format") != FORMAT:
            raise ValueError(f"{path} is not a trl_distill teacher cache of format {FORMAT!r}.")
        names = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                         and f.name not in values)
        shards = values.get("shards", [])
        if missing or not isinstance(shards, list) or not all(
                isinstance(s, dict) and SHARD_KEYS <= set(s) for s in shards):
            what = f"no {', '.join(missing)}" if missing else f"shard entries without {', '.join(sorted(SHARD_KEYS))}"
            raise ValueError(f"{path} is damaged: {what}. {damaged}")
        return cls(**{key: value for key, value in values.items() if key in names})


def tokenizer_hash(tokenizer) -> str:
    """A hash of the vocabulary and the special tokens (what decides the ids a cache stores)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    content = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens)}
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:16]


def dataset_fingerprint(dataset) -> str:
    """A hash of a prepared (tokenized) dataset's rows: ``input_ids`` and ``labels``, in order."""
    digest = hashlib.sha256()
    for batch in dataset.select_columns(["input_ids", "labels"]).iter(batch_size=1024):
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
            digest.update(b"|")
            digest.update(np.asarray(labels, dtype=np.int64).tobytes())
            digest.update(b"\n")
    return digest.hexdigest()[:16]


def check_fits(manifest: Manifest, directory: str, *, tokenizer_hash: str, vocab_size: int, temperature: float,
               max_length: int | None, dataset) -> None:
    """Raise one clear `ValueError` when the cache in `directory` cannot serve training on the prepared `dataset`."""
    fix = "Re-run `trl-distill cache-teacher` with this run's flags into another --teacher_cache directory."
    if not manifest.complete:
        raise ValueError(
            f"The teacher cache {directory} is incomplete ({len(manifest.shards)} of {manifest.num_shards} shards): "
            "run `trl-distill cache-teacher` again with the same flags to finish it."
        )
    if manifest.tokenizer_hash != tokenizer_hash or manifest.vocab_size != vocab_size:
        raise ValueError(
            f"The teacher cache {directory} was written with another tokenizer (hash {manifest.tokenizer_hash}, "
            f"{manifest.vocab_size} tokens); the student's is {tokenizer_hash} with {vocab_size} tokens. {fix}"
        )
    if manifest.max_length != max_length:
        raise ValueError(
            f"The teacher cache {directory} was written with max_length {manifest.max_length}; this run uses "
            f"{max_length}. {fix}"
        )
    if manifest.temperature != temperature:
        raise ValueError(
            f"The teacher cache {directory} holds the teacher at temperature {manifest.temperature}; this run uses "
            f"temperature {temperature}. Train at {manifest.temperature}, or re-run `trl-distill cache-teacher "
            f"--temperature {temperature}`."
        )
    fingerprint = dataset_fingerprint(dataset)
    if manifest.dataset_fingerprint != fingerprint or manifest.num_rows != len(dataset):
        raise ValueError(
            f"The teacher cache {directory} was written for other data: {manifest.num_rows} prepared rows with "
            f"fingerprint {manifest.dataset_fingerprint}; this run's train split has {len(dataset)} rows with "
            f"fingerprint {fingerprint} (same dataset, split, max_length and chat template?). {fix}"
        )
