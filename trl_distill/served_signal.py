"""Distil from a teacher served by vLLM: no teacher in the training processes, its top-k fetched over HTTP.

`ServedTeacherSignal` wraps the collator (`ServedTeacherCollator`): when a batch is collated, a request for its
loss tokens' top-k goes to the server on a thread pool, and the batch carries the future (`signal_batch`). The
Trainer collates the micro-batches of an optimizer step before it trains on the first, and accelerate's dataloader
collates one batch ahead, so the answers arrive while the student computes. `compute_loss` then runs the same
sparse loss as from a teacher cache. `trl-distill cache-teacher --teacher_server URL` writes a cache through this
same collator.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .served_teacher import ServedTeacher
from .signal_batch import SIGNAL, SignalHolder
from .sparse_losses import SparseTeacherSignal
from .teacher_step import loss_tokens

logger = logging.getLogger(__name__)

_PROBE = "Distil the teacher, token by token: 1 2 3."


class ServedTeacherSignal:
    """The teacher `model` served at `url` (OpenAI-compatible vLLM), as the source of each batch's top-`top_k`.

    Args:
        url: the server's base URL, e.g. ``http://teacher-host:8000``.
        model: the served model's name (vLLM's ``--served-model-name``); None: the one model the server serves.
        top_k: teacher token ids and log-probs per loss token (the server needs ``--max-logprobs`` >= top_k).
        timeout: seconds per request (each is retried 3 times with backoff, then training stops with the error).
        concurrency: requests in flight per process.
    """

    def __init__(self, url: str, model: str | None, top_k: int = 64, timeout: float = 120.0, concurrency: int = 4):
        self.client = ServedTeacher(url, model or "", timeout=timeout)
        self.top_k, self.concurrency = top_k, concurrency
        self.vocab_size = None  # the student's, once `check` has run
        self._pool, self._pool_pid = None, None

    @property
    def name(self) -> str:
        return self.client.model

    def __getstate__(self):  # DataLoader workers get a copy without the pool (and fetch synchronously)
        return {**self.__dict__, "_pool": None, "_pool_pid": None}

    def check(self, tokenizer, vocab_size: int, max_length: int | None) -> None:
        """Before anything trains or is written: the server answers, serves the model, takes rows of `max_length`
        tokens, tokenizes like `tokenizer` and returns top-`top_k` log-probabilities. One clear error otherwise."""
        url, served = self.client.url, self.client.models()
        names = [entry["id"] for entry in served]
        if not self.client.model:
            if len(names) != 1:
                raise ValueError(f"The teacher server {url} serves {names}: name one with "
                                 "--teacher_model_name_or_path (its --served-model-name).")
            self.client.model = names[0]
        if self.client.model not in names:
            raise ValueError(f"The teacher server {url} serves {names}, not {self.client.model!r}: pass the served "
                             "name (vLLM's --served-model-name) as --teacher_model_name_or_path.")
        limit = next(entry for entry in served if entry["id"] == self.client.model).get("max_model_len")
        if limit is not None and max_length is not None and limit <= max_length:
            raise ValueError(f"The teacher server {url} takes at most {limit} tokens per request (its --max-model-len);"
                             f" this run's rows have up to max_length {max_length}, and vLLM generates one token "
                             f"after each: restart it with --max-model-len {max_length + 1} (past the model's own "
                             "context vLLM wants VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; that position only holds the token "
                             f"we discard), or train with --max_length {limit - 1}.")
        if not 1 <= self.top_k <= vocab_size:
            raise ValueError(f"The served teacher's top_k must be in [1, the vocabulary size {vocab_size}], got "
                             f"{self.top_k}.")
        self.client.check_tokenizer(tokenizer, _PROBE)
        probe = self.client.top_k(tokenizer(_PROBE)["input_ids"], self.top_k)  # --max-logprobs, --logprobs-mode
        check_ids(probe, vocab_size, url)
        self.vocab_size = vocab_size

    def collator(self, collator) -> ServedTeacherCollator:
        return ServedTeacherCollator(collator, self)

    def request(self, batch: dict) -> SignalHolder:
        """Ask for the signal of a collated batch's loss tokens; in the main process it arrives on a thread."""
        rows, positions = loss_rows(batch)
        if torch.utils.data.get_worker_info() is not None:  # a DataLoader worker: it is ahead of training already
            return SignalHolder(self.fetch(rows, positions))
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="served-teacher")
            self._pool_pid = os.getpid()
        return SignalHolder(self._pool.submit(self.fetch, rows, positions))

    def fetch(self, rows: list[list[int]], positions: list[torch.Tensor]) -> SparseTeacherSignal:
        """The signal at `positions` of each row (a position t predicts the row's token t + 1), row-major: the
        order in which the loss selects its tokens."""
        signals = self.client.top_k_rows(rows, self.top_k)
        parts = [SparseTeacherSignal(*(t[where] for t in signal)) for signal, where in zip(signals, positions,
                                                                                             strict=True)]
        signal = SparseTeacherSignal(*(torch.cat(column) for column in zip(*parts, strict=True)))
        check_ids(signal, self.vocab_size, self.client.url)
        return signal

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class ServedTeacherCollator:
    """Wraps the trainer's collator: each batch it collates gets its loss tokens' served top-k (a future)."""

    def __init__(self, collator, source: ServedTeacherSignal):
        self.collator, self.source = collator, source

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        batch[SIGNAL] = self.source.request(batch)
        return batch


def loss_rows(batch: dict) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each row's tokens (without padding) and its loss positions (`teacher_step.loss_tokens`)."""
    _, mask = loss_tokens(batch)
    ids, attention = batch["input_ids"], batch.get("attention_mask")
    rows, positions = [], []
    for b in range(ids.shape[0]):
        length = ids.shape[1] if attention is None else int(attention[b].sum())
        if attention is not None and not bool(attention[b, :length].all()):
            raise ValueError("A served teacher needs right-padded rows (the collator padded on the left).")
        rows.append(ids[b, :length].tolist())
        positions.append(mask[b].nonzero().squeeze(1).cpu())
    return rows, positions


def check_ids(signal: SparseTeacherSignal, vocab_size: int | None, url: str) -> None:
    """One clear error for a served token id the student's vocabulary does not have."""
    if vocab_size is not None and signal.ids.numel() and int(signal.ids.max()) >= vocab_size:
        raise ValueError(f"The teacher server {url} returned token id {int(signal.ids.max())}, outside the student's "
                         f"vocabulary of {vocab_size}: the served model must share the student's tokenizer.")


def train_from_server(trainer, source: ServedTeacherSignal) -> None:
    """Make `trainer` (a `DistillationTrainer` without a local teacher) distil from the served teacher: check the
    server fits the run, then wrap the collator to fetch every batch's signal."""
    args = trainer.args
    source.check(trainer.processing_class, trainer.vocab_size, args.max_length)
    trainer.data_collator = source.collator(trainer.data_collator)
    if trainer.accelerator.is_main_process:
        logger.info("Distilling from the teacher %r served at %s: top-%d per loss token, %d requests in flight.",
                    source.name, source.client.url, source.top_k, source.concurrency)
