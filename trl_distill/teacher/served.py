"""Distil from a teacher served by vLLM: no teacher in the training processes, its top-k fetched over HTTP.

`ServedTeacher` wraps the collator (`ServedTeacherCollator`): when a batch is collated, a request for its
loss tokens' top-k goes to the server on a thread pool, and the batch carries the future (`signal_batch`). The
Trainer collates the micro-batches of an optimizer step before it trains on the first, and accelerate's dataloader
collates one batch ahead, so the answers arrive while the student computes. `compute_loss` then runs the same
sparse loss as from a teacher cache. `trl-distill cache-teacher --teacher_server URL` writes a cache through this
same collator.

A fault of the server (down, hung, HTTP 5xx, a reply vLLM would not send) is a `TeacherServerError` raised on a
request's thread; it surfaces where the batch's signal is read, in `pop_batch`, which every rank reaches for every
micro-batch: there the ranks agree (one scalar all-reduce), cancel what they have queued and raise it together, so
every rank stops with the same one line. The requests run on daemon threads: one still waiting on a hung server
never holds the process at exit. Those threads touch no torch (`server_client.signal_of` says why): the reply's
numpy arrays become tensors where the signal is read.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from functools import partial

import numpy as np
import torch

from ..data.batch import SIGNAL, SignalHolder, loss_tokens, pop_signal, put_signal, take_signal
from ..errors import ExternalError
from ..loss.sparse import SparseTeacherSignal
from ..runtime.distributed import first_failure
from .base import TeacherSource
from .capabilities import ChecksArgs, OwnBatch, OwnRows, SamplingServer, ScoresSamples, WritesCache
from .rows import SparseRows
from .server_client import TeacherServerClient, TeacherServerError, TeacherServerReplyError, signal_of

logger = logging.getLogger(__name__)

_PROBE = "Distil the teacher, token by token: 1 2 3."


class ServedTeacher(TeacherSource, OwnBatch, ScoresSamples, SamplingServer, WritesCache, OwnRows, ChecksArgs):
    """The teacher `model` served at `url` (OpenAI-compatible vLLM), as the source of each batch's top-`top_k`.

    Args:
        url: the server's base URL, e.g. ``http://teacher-host:8000``.
        model: the served model's name (vLLM's ``--served-model-name``); None: the one model the server serves.
        top_k: teacher token ids and log-probs per loss token (the server needs ``--max-logprobs`` >= top_k).
        timeout: seconds per request (each is retried 3 times with backoff, then training stops with the error).
        concurrency: requests in flight per process.
    """

    refused = {
        "packing": "A served teacher scores one unpacked row per example: set packing=False and padding_free=False "
        "with --teacher_server.",
        "cross-tokenizer": "A served teacher's top-k comes in the server's token ids, compared id by id with the "
        "student's: a teacher with another tokenizer needs the local teacher (--teacher_model_name_or_path). Drop "
        "teacher_tokenizer_name_or_path and cross_tokenizer with --teacher_server.",
    }

    signal_key = SIGNAL  # its batch key (one per teacher when several teach)
    columns = ()  # its collator asks for each batch's signal: it reads no column of its own
    revision = None
    routes_own_rows = True  # routed among several: the panel asks it for its own rows only (`request`, `no_rows`)

    def __init__(self, url: str, model: str | None, top_k: int = 64, timeout: float = 120.0, concurrency: int = 4):
        self.client = TeacherServerClient(url, model or "", timeout=timeout)
        self.top_k, self.concurrency = top_k, concurrency
        self.vocab_size = None  # the student's, once `check` has run
        self._pool, self._pool_pid = None, None  # a `RequestPool` of this process

    @property
    def name(self) -> str:
        return self.client.model

    def describe(self) -> str:
        return f"served at {self.client.url}"

    @staticmethod
    def check_args(args) -> None:
        """The settings a served teacher cannot take whatever the mode: one clear error as the config is built."""
        if args.temperature != 1.0:
            raise ValueError(f"A served teacher gives its log-probs at temperature 1 only (vLLM applies no temperature "
                             f"to prompt log-probs, and the top-k cannot be renormalised without the whole "
                             f"vocabulary); got --temperature {args.temperature}. Train at --temperature 1, or use "
                             "the local teacher (--teacher_model_name_or_path, or a cache written from it).")
        if args.teacher_server_top_k < 1 or args.teacher_server_concurrency < 1 or not args.teacher_server_timeout > 0:
            raise ValueError("teacher_server_top_k and teacher_server_concurrency must be >= 1 and "
                             f"teacher_server_timeout > 0; got {args.teacher_server_top_k}, "
                             f"{args.teacher_server_concurrency}, {args.teacher_server_timeout}.")

    def attach(self, context) -> None:
        """Check the server fits the run (its collator fetches every batch's signal)."""
        super().attach(context)
        self.check(context.processing_class, context.vocab_size, context.plan.teacher_settings.max_length)
        if context.accelerator.is_main_process:
            logger.info("Distilling from the teacher %r served at %s: top-%d per loss token, %d requests in flight.",
                        self.name, self.client.url, self.top_k, self.concurrency)

    def collator(self, base) -> ServedTeacherCollator:
        return ServedTeacherCollator(base, self)

    def pop_batch(self, inputs: dict):
        """The batch's signal (waited for here); a server fault met on any rank stops every rank, with its line."""
        try:
            signal, failure = pop_signal(inputs, self.signal_key), None
        except ExternalError as error:  # raised on the request's thread (or in a DataLoader worker)
            signal, failure = None, error
        first = first_failure(None if failure is None else str(failure), self.context.accelerator)
        if first is None:
            return signal
        self.close()  # what is queued is cancelled, what is in flight stops retrying
        rank, message = first
        whose = "" if failure is not None else f" (met by rank {rank}; every rank stopped)"
        error = type(failure) if failure is not None else TeacherServerError
        raise error(f"{message}{whose} Stopped at step {self.context.step + 1}: resume from the last "
                    "complete checkpoint with --resume_from_checkpoint true once the server is fixed.") from failure

    def sampling_server(self):
        """The teacher's own server samples its completions (`seq_kd`), through the rollout client."""
        from ..rollout.engine_client import RolloutServerClient

        if getattr(self, "_sampler", None) is None:
            self._sampler = RolloutServerClient(self.client.url, timeout=self.client.http.timeout)
            self._sampler.model = self.client.model
        return self._sampler

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """The sampled rows' top-k, asked for at once; under the sampled-token objective only the sampled tokens'
        own log-probs (``prompt_logprobs=0``: a fraction of the bytes)."""
        sampled_only = self.context is not None and self.context.plan.on_policy.objective == "sampled_token"
        put_signal(batch, self.signal_key, self.request(batch, sampled_only))

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> SparseRows:
        return SparseRows(extras)

    def release(self) -> None:
        self.close()  # requests for batches collated ahead and never trained on

    # ---- cache-teacher ----

    def open_for_cache(self, columns, top_k: int) -> None:
        self.top_k = top_k  # the cache's k, whatever the run's teacher_server_top_k

    def cache_records(self, columns, mine: list[range], steps: int, filler: range, top_k: int,
                      temperature: float) -> list[dict]:
        """Every batch is collated (which sends its request) before the first answer is awaited, so
        `teacher_server_concurrency` requests are in flight. What a record holds is read back to the host (a
        collator may hand its batch over on the GPU)."""
        pending = []
        for rows in mine:
            examples = [columns[i] for i in rows]
            batch = self.context.collate(examples)
            pending.append((rows, examples, loss_tokens(batch)[1], take_signal(batch, self.signal_key)))
        records = []
        for rows, examples, mask, holder in pending:
            signal = holder.signal
            ends = mask.sum(1).cumsum(0).tolist()
            for b, row in enumerate(rows):
                part = slice(ends[b - 1] if b else 0, ends[b])
                records.append({"row": row, "input_ids": examples[b]["input_ids"],
                                "positions": mask[b].nonzero().squeeze(1).cpu().numpy(),
                                "top_k_ids": signal.ids[part].cpu().numpy(),
                                "top_k_log_probs": signal.log_probs[part].cpu().numpy(),
                                "tail_log_prob": signal.tail_log_prob[part].cpu().numpy()})
        return records

    def __getstate__(self):  # DataLoader workers get a copy without the pool (and fetch synchronously)
        return {**self.__dict__, "_pool": None, "_pool_pid": None, "_sampler": None}

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
        check_ids(probe.ids, vocab_size, url)
        self.vocab_size = vocab_size

    def request(self, batch: dict, sampled_only: bool = False) -> SignalHolder:
        """Ask for the signal of a collated batch's loss tokens (`sampled_only`: the log-prob of each token itself,
        not the top-k); in the main process it arrives on a thread."""
        rows, positions = loss_rows(batch)
        if torch.utils.data.get_worker_info() is not None:  # a DataLoader worker: it is ahead of training already
            try:
                return SignalHolder(self.fetch(rows, positions))
            except ExternalError as error:  # raised where the loss reads it, as from a thread (not as the
                return SignalHolder(None, error=error)  # DataLoader's "Caught ... in DataLoader worker" wrapper)
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool, self._pool_pid = RequestPool(self.concurrency), os.getpid()
        fetch = partial(self.fetch_arrays, sampled_only=sampled_only)
        return SignalHolder(self._pool.submit(fetch, rows, positions), build=signal_of)

    def no_rows(self) -> SignalHolder:
        """The signal of no rows (routed: a batch with none of this teacher's rows), asked of no one."""
        k = self.top_k
        return SignalHolder(SparseTeacherSignal(torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k), torch.zeros(0)))

    def fetch(self, rows: list[list[int]], positions: list[np.ndarray],
              stop: threading.Event | None = None) -> SparseTeacherSignal:
        """The signal at `positions` of each row (a position t predicts the row's token t + 1), row-major: the
        order in which the loss selects its tokens. `stop` cancels the request's retries."""
        return signal_of(self.fetch_arrays(rows, positions, stop))

    def fetch_arrays(self, rows: list[list[int]], positions: list[np.ndarray], stop: threading.Event | None = None,
                     sampled_only: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`fetch` as numpy arrays: what the request threads run (HTTP, JSON and numpy, no torch: see
        `server_client.signal_of`)."""
        signals = (self.client.token_arrays(rows, stop) if sampled_only else
                   self.client.top_k_arrays(rows, self.top_k, stop))
        parts = [[array[np.asarray(where)] for array in signal] for signal, where in zip(signals, positions,
                                                                                          strict=True)]
        ids, log_probs, tail = (np.concatenate(column) for column in zip(*parts, strict=True))
        check_ids(ids, self.vocab_size, self.client.url)
        return ids, log_probs, tail

    def close(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.close()
        self._pool = None


class RequestPool:
    """`size` daemon threads running the requests `submit` queues, each answered in a `Future`. Unlike a
    `ThreadPoolExecutor` (whose threads Python joins at exit), a request still waiting on a hung server never
    holds the process once training has stopped; `close` cancels the queued requests and stops the retries of
    those in flight. At exit every pool is closed and its threads are given `EXIT_WAIT_S` to end: a daemon thread
    still running Python as the interpreter finalizes aborts the process ("terminate called without an active
    exception", exit -6, with torch loaded), where a run stopping on a server fault must leave with its line and
    status 1. A thread blocked on a hung server's answer waits in C, harmlessly, and is not waited for."""

    EXIT_WAIT_S = 3.0

    def __init__(self, size: int):
        self.stop, self._queue = threading.Event(), queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"served-teacher-{i}", daemon=True)
                        for i in range(size)]
        for thread in self.threads:
            thread.start()
        self._pid = os.getpid()
        _open_pools.add(self)

    def submit(self, fetch, *args) -> Future:
        future = Future()
        self._queue.put((future, fetch, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fetch, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fetch(*args, stop=self.stop))
            except BaseException as error:  # handed to whoever reads the future
                future.set_exception(error)

    def close(self) -> None:
        self.stop.set()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self.threads:
            self._queue.put(None)


_open_pools: weakref.WeakSet[RequestPool] = weakref.WeakSet()


@atexit.register
def _end_pools_at_exit() -> None:
    pools = [pool for pool in list(_open_pools) if pool.threads and pool._pid == os.getpid()]
    for pool in pools:
        pool.close()
    deadline = time.monotonic() + RequestPool.EXIT_WAIT_S
    for pool in pools:
        for thread in pool.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class ServedTeacherCollator:
    """Wraps the trainer's collator: each batch it collates gets its loss tokens' served top-k (a future)."""

    def __init__(self, collator, source: ServedTeacher):
        self.collator, self.source = collator, source

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        put_signal(batch, self.source.signal_key, self.source.request(batch))
        return batch


def loss_rows(batch: dict) -> tuple[list[list[int]], list[np.ndarray]]:
    """Each row's tokens (without padding) and its loss positions (`data.batch.loss_tokens`)."""
    _, mask = loss_tokens(batch)
    ids, attention = batch["input_ids"], batch.get("attention_mask")
    rows, positions = [], []
    for b in range(ids.shape[0]):
        length = ids.shape[1] if attention is None else int(attention[b].sum())
        if attention is not None and not bool(attention[b, :length].all()):
            raise ValueError("A served teacher needs right-padded rows (the collator padded on the left).")
        rows.append(ids[b, :length].tolist())
        positions.append(mask[b].nonzero().squeeze(1).cpu().numpy())
    return rows, positions


def check_ids(ids, vocab_size: int | None, url: str) -> None:
    """One clear error for a served token id (numpy or torch `ids`) the student's vocabulary does not have."""
    ids = np.asarray(ids)
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise TeacherServerReplyError(f"The teacher server {url} returned token id {int(ids.max())}, outside "
                                      f"the student's vocabulary of {vocab_size}: the served model must share the "
                                      "student's tokenizer.")
