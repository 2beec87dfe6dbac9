"""A teacher cache on disk: open it, check it fits the run, read the teacher signal of given rows."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import torch

from ..loss.sparse import SparseTeacherSignal
from . import packing
from .manifest import Manifest, check_fits, tokenizer_hash
from .shards import PACKED, file_sha256, flat, read_shard


class TeacherCache:
    """A complete teacher cache written by `trl-distill cache-teacher`, memory-mapped."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"teacher_cache {self.directory!r} is not a directory. Write the cache first with "
                                    "`trl-distill cache-teacher --teacher_cache DIR ...`.")
        manifest = Manifest.load(self.directory)
        if manifest is None:
            raise ValueError(f"{self.directory} has no manifest.json: it is not a teacher cache. Write one with "
                             "`trl-distill cache-teacher --teacher_cache DIR ...`.")
        self.manifest = manifest
        self.table = None

    def check_fits(self, tokenizer, vocab_size: int, temperature: float, max_length: int | None, dataset) -> None:
        """One clear error when this cache was written for another tokenizer, data, max length or temperature;
        otherwise map its shards for `signal`."""
        check_fits(self.manifest, self.directory, tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=vocab_size,
                   temperature=temperature, max_length=max_length, dataset=dataset)
        shards = sorted(self.manifest.shards, key=lambda s: s["index"])
        redo = "delete it and run `trl-distill cache-teacher` again with the same flags to rewrite it."
        for shard in shards:  # every byte read once (sha256), before any training step
            path = os.path.join(self.directory, shard["file"])
            if not os.path.exists(path) or os.path.getsize(path) != shard["bytes"]:
                raise ValueError(f"The teacher cache shard {path} is missing or was changed since it was written; "
                                 f"{redo}")
            if "sha256" in shard and file_sha256(path) != shard["sha256"]:
                raise ValueError(f"The teacher cache shard {path} is damaged (its checksum differs from the "
                                 f"manifest's); {redo}")
        self.table = pa.concat_tables([read_shard(os.path.join(self.directory, s["file"])) for s in shards])
        self._check_values(redo)

    def _check_values(self, redo: str) -> None:
        """Cheap sanity on what was read: log-probabilities are numbers <= 0 (-inf is an empty bucket)."""
        for name in ("top_k_log_probs", "tail_log_prob"):
            if name not in self.table.column_names:  # packed: codes, which decode to log-probabilities by design
                continue
            values = flat(self.table.column(name)).astype(np.float32)
            if values.size and (np.isnan(values).any() or values.max() > 1e-3):
                raise ValueError(f"The teacher cache {self.directory} holds {name} values that are no "
                                 f"log-probabilities; {redo}")

    def signal(self, rows: list[int]) -> SparseTeacherSignal:
        """The signal of the loss tokens of `rows`, concatenated in order (row-major, as the loss selects them)."""
        part = self.table.take(pa.array(rows, type=pa.int64()))
        stored = part.column("row").to_numpy()
        if not np.array_equal(stored, np.asarray(rows)):
            raise ValueError(f"The teacher cache {self.directory} is out of order (rows {stored[:4]}... for "
                             f"{rows[:4]}...); rewrite it with `trl-distill cache-teacher`.")
        k = self.manifest.top_k
        tail = np.array(flat(part.column("tail_log_prob")))  # copies: torch wants writable arrays
        if self.manifest.log_prob_dtype == PACKED:  # decoded here, in the data path, not in the loss
            ends = np.cumsum([0, *part.column("tail_log_prob").combine_chunks().value_lengths().to_numpy()])
            decoded = [packing.decode(blob, tail[start:end], k, self.manifest.vocab_size)
                       for blob, start, end in zip(part.column("packed").to_pylist(), ends, ends[1:], strict=False)]
            ids = np.concatenate([d[0] for d in decoded]) if decoded else np.zeros((0, k), dtype=np.int64)
            log_probs = np.concatenate([d[1] for d in decoded]) if decoded else np.zeros((0, k), dtype=np.float32)
        else:
            ids, log_probs = (np.array(flat(part.column(name))).reshape(-1, k)
                              for name in ("top_k_ids", "top_k_log_probs"))
        return SparseTeacherSignal(torch.from_numpy(ids), torch.from_numpy(log_probs), torch.from_numpy(tail))
