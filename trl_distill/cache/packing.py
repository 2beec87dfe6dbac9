"""The packed encoding of a teacher cache's top-k signal (``log_prob_dtype="7bit"``): about 3 bytes per entry.

Per loss token the cache keeps k entries (a token id and its log-probability, most likely first) and the log of the
tail mass. Packed, each entry is its id in ``id_bits = ceil(log2(vocab))`` bits followed by a 7-bit code of how far
its log-probability lies below the token's most likely one, ``Δ = log p_1 − log p_i`` (``Δ_1 = 0``), on a square-root
scale: code ``c`` stands for ``Δ = DELTA_MAX · (c / 127)²``. The steps are fine where the probability mass is
(0.001 nats next to the top-1, 0.06 at Δ = 1) and coarse where it is not (0.25 nats at Δ = 16, where
``p_i < 1.2e-7 p_1``); Δ beyond `DELTA_MAX` is stored as `DELTA_MAX`. The tail's log mass stays float32. The entries
of a row's tokens are bit-packed with `numpy.packbits` into one byte string.

Decoding (in the data path, `TeacherCache.signal`) rebuilds ``log p_i = −Δ̂_i + log((1 − r) / Σ_j exp(−Δ̂_j))`` with
``r`` the stored tail mass: the k buckets hold exactly the mass ``1 − r``, the tail exactly ``r``. So each decoded
log-probability is off by its own rounding ``ε_i = Δ_i − Δ̂_i`` (at most half a step, `half_step`) plus one shared
shift, the log of the ``p``-weighted mean of ``exp(ε_j)`` (at most ``max_j |ε_j|``). Ids are exact.

At a 128k vocabulary (17-bit ids) k = 64 takes 64 · 24 bits + 4 bytes = 196 bytes per loss token, against
``64 · (4 + 4) + 4 = 516`` with float32 lists (`bytes_per_token`).
"""

from __future__ import annotations

import math

import numpy as np

CODE_BITS = 7
CODE_MAX = (1 << CODE_BITS) - 1
DELTA_MAX = 16.0  # nats below the top-1 that the codes span


def id_bits(vocab_size: int) -> int:
    """Bits per token id: enough for ids ``0 .. vocab_size - 1``."""
    return max(1, math.ceil(math.log2(vocab_size)))


def bytes_per_token(top_k: int, vocab_size: int, encoding: str) -> float:
    """The signal's bytes per loss token of one encoding (``"7bit"``, ``"float16"`` or ``"float32"``), without the
    per-row overhead: k entries and the tail."""
    if encoding == "7bit":
        return top_k * (id_bits(vocab_size) + CODE_BITS) / 8 + 4
    return top_k * (4 + np.dtype(encoding).itemsize) + 4


def codes_of(deltas: np.ndarray) -> np.ndarray:
    """Δ >= 0 -> the nearest 7-bit code on the square-root scale."""
    scaled = np.sqrt(np.clip(deltas, 0.0, DELTA_MAX) / DELTA_MAX) * CODE_MAX
    return np.rint(scaled).astype(np.uint8)


def deltas_of(codes: np.ndarray) -> np.ndarray:
    """7-bit codes -> Δ̂ (float64)."""
    return DELTA_MAX * (codes.astype(np.float64) / CODE_MAX) ** 2


def half_step(deltas: np.ndarray) -> np.ndarray:
    """The largest rounding error ``|Δ − Δ̂|`` of an entry at Δ <= `DELTA_MAX`: codes round in the square-root
    domain by at most 1/2, so with c its code, ``Δ`` lies within ``DELTA_MAX · ((c + ½)² − c²) / 127²`` of ``Δ̂``.
    (Δ beyond `DELTA_MAX` is clamped: its error is ``Δ − DELTA_MAX`` more.)"""
    return DELTA_MAX * (codes_of(deltas).astype(np.float64) + 0.25) / CODE_MAX**2


def encode(ids: np.ndarray, log_probs: np.ndarray, vocab_size: int) -> bytes:
    """One row's ``[n, k]`` ids and log-probabilities (most likely first) -> its packed bytes."""
    n, k = ids.shape
    if n == 0:
        return b""
    deltas = log_probs[:, :1].astype(np.float64) - log_probs.astype(np.float64)
    bits = id_bits(vocab_size)
    fields = [(ids.astype(np.uint32), bits), (codes_of(deltas).astype(np.uint32), CODE_BITS)]
    columns = [(value[..., None] >> np.arange(width - 1, -1, -1, dtype=np.uint32)) & 1 for value, width in fields]
    return np.packbits(np.concatenate(columns, axis=-1).astype(np.uint8).reshape(-1)).tobytes()


def decode(packed: bytes, tail_log_prob: np.ndarray, top_k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's packed bytes and its ``[n]`` tail log masses -> ids ``[n, k]`` (int64) and log-probs ``[n, k]``
    (float32), the k buckets renormalised to hold ``1 − exp(tail)``."""
    n, bits = len(tail_log_prob), id_bits(vocab_size)
    if n == 0:
        return np.zeros((0, top_k), dtype=np.int64), np.zeros((0, top_k), dtype=np.float32)
    width = bits + CODE_BITS
    flat = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=n * top_k * width)
    entries = flat.reshape(n, top_k, width).astype(np.int64)
    ids = entries[..., :bits] @ (1 << np.arange(bits - 1, -1, -1, dtype=np.int64))
    codes = entries[..., bits:] @ (1 << np.arange(CODE_BITS - 1, -1, -1, dtype=np.int64))
    deltas = deltas_of(codes)
    tail = np.asarray(tail_log_prob, dtype=np.float64)
    kept_mass = -np.expm1(np.minimum(tail, 0.0))  # 1 − r, exact where r is tiny
    with np.errstate(divide="ignore"):  # a token whose tail holds everything: its buckets are empty (-inf)
        top1 = np.log(kept_mass) - np.log(np.exp(-deltas).sum(axis=1))
    return ids, (top1[:, None] - deltas).astype(np.float32)
