"""A teacher cache's shards on disk: Arrow IPC stream files, one row per prepared training row.

Columns: ``row`` (index in the prepared dataset) and ``tail_log_prob`` (float32, one per loss token: the hidden-state
positions with ``labels[t + 1] != -100``, in order), then by encoding (`Manifest.log_prob_dtype`):

- ``"7bit"`` (the default): ``packed``, the row's top-k entries bit-packed (ids in ``ceil(log2 V)`` bits, log-probs as
  7-bit codes; see `cache.packing`). Input ids and positions are not stored: the dataset's fingerprint in the
  manifest pins them.
- ``"float32"`` / ``"float16"`` (the first format, still read): ``input_ids`` (the token ids the teacher saw),
  ``positions``, and per loss token, flattened in order, ``top_k_ids`` (int32, k each) and ``top_k_log_probs`` (k each).

Shards are written to ``NAME.trl_distill.tmp`` and renamed when whole, so a killed writer never leaves a readable
partial one; a re-run deletes those (`is_partial_shard`: only names this writer makes, never another ``*.tmp``).
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pyarrow as pa

from . import packing

PACKED = "7bit"
ARROW_TYPES = {"float32": pa.float32(), "float16": pa.float16()}
LOG_PROB_DTYPES = (PACKED, *ARROW_TYPES)


_SHARD = re.compile(r"^shard-\d{5,}\.arrow$")
PARTIAL_SUFFIX = ".trl_distill.tmp"
_PARTIAL = re.compile(r"^shard-\d{5,}\.arrow(\.trl_distill)?\.tmp$")  # ``.tmp`` alone: earlier versions


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def is_shard(name: str) -> bool:
    """Whether a file named `name` is a shard `write_shard` wrote."""
    return bool(_SHARD.match(name))


def is_partial_shard(name: str) -> bool:
    """Whether a file named `name` is a shard `write_shard` was writing when its run was killed."""
    return bool(_PARTIAL.match(name))


def schema(log_prob_dtype: str) -> pa.Schema:
    if log_prob_dtype == PACKED:
        return pa.schema([("row", pa.int64()), ("packed", pa.binary()), ("tail_log_prob", pa.list_(pa.float32()))])
    return pa.schema([
        ("row", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("positions", pa.list_(pa.int32())),
        ("top_k_ids", pa.list_(pa.int32())),
        ("top_k_log_probs", pa.list_(ARROW_TYPES[log_prob_dtype])),
        ("tail_log_prob", pa.list_(pa.float32())),
    ])  # fmt: skip


def _columns(records: list[dict], log_prob_dtype: str, vocab_size: int) -> dict:
    columns = {"row": [r["row"] for r in records],
               "tail_log_prob": [np.asarray(r["tail_log_prob"], dtype=np.float32) for r in records]}
    if log_prob_dtype == PACKED:
        columns["packed"] = [packing.encode(np.asarray(r["top_k_ids"]), np.asarray(r["top_k_log_probs"]), vocab_size)
                             for r in records]
        return columns
    np_dtype = np.dtype(log_prob_dtype)
    columns.update({
        "input_ids": [np.asarray(r["input_ids"], dtype=np.int32) for r in records],
        "positions": [np.asarray(r["positions"], dtype=np.int32) for r in records],
        "top_k_ids": [np.asarray(r["top_k_ids"], dtype=np.int32).reshape(-1) for r in records],
        "top_k_log_probs": [np.asarray(r["top_k_log_probs"], dtype=np_dtype).reshape(-1) for r in records],
    })  # fmt: skip
    return columns


def write_shard(path: str, records: list[dict], log_prob_dtype: str, vocab_size: int) -> int:
    """Write `records` (dicts of numpy arrays, sorted by row) to `path` atomically; returns the file's size."""
    table = pa.Table.from_pydict(_columns(records, log_prob_dtype, vocab_size), schema=schema(log_prob_dtype))
    partial = path + PARTIAL_SUFFIX
    with pa.OSFile(partial, "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)
    return os.path.getsize(path)


def file_sha256(path: str) -> str:
    """The hex sha256 of a file's bytes (a shard's checksum in the manifest)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_shard(path: str) -> pa.Table:
    """The shard's table, memory-mapped (nothing is copied until a row is used)."""
    return pa.ipc.open_stream(pa.memory_map(path)).read_all()


def flat(column: pa.ChunkedArray) -> np.ndarray:
    """A list column's values, every row's list concatenated in row order."""
    return column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
