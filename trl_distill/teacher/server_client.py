"""A teacher served by vLLM (an OpenAI-compatible server): its sparse top-k signal, fetched over HTTP.

`TeacherServerClient.top_k` sends a row's token ids as the ``prompt`` of ``/v1/completions`` with ``max_tokens=1`` and
``prompt_logprobs=k``: per position t >= 1 the server returns the teacher's k most likely tokens after the prefix
``ids[:t]`` (ranked, plus the actual token when it is not among them). The tail log mass is what they leave,
``log(1 − Σ p_i)``: the same `loss.sparse.SparseTeacherSignal` the ZeRO-3 teacher writes into a cache.

Temperature 1 only: vLLM's prompt log-probs are the raw model's whatever its ``--logprobs-mode`` (vLLM 0.32
documents that its processed modes apply no sampling processor, temperature included, to prompt tokens), and the
top-k alone cannot be renormalised at another temperature (that needs the whole vocabulary's mass).
Requests go over `runtime.http.JsonHttpClient` (a kept-alive connection per thread), time out and are retried with
backoff; a server that stays unreachable, hangs or answers HTTP 5xx is one `TeacherServerError` naming it, never a
hang, and one that answers something else than vLLM's reply (an HTML page, no or misshapen log-probs) is a
`TeacherServerReplyError` naming what it sent: both are `errors.ExternalError`s, one line from the command line
whenever they happen.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

from ..errors import ExternalError
from ..loss.sparse import SparseTeacherSignal
from ..runtime.http import JsonHttpClient, excerpt


class TeacherServerError(ExternalError, ConnectionError):
    """The teacher server did not answer (down, unreachable or too slow) after every retry, or answered nonsense."""


class TeacherServerReplyError(TeacherServerError, ValueError):
    """The teacher server answered, but not what vLLM answers (a refusal, an HTML page, missing or misshapen
    log-probs): retrying would get the same. A `ValueError` too, so set-up reports it as bad input."""


class TeacherServerClient:
    """The teacher `model` served at `url` (e.g. ``http://host:8000``)."""

    def __init__(self, url: str, model: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        self.http = JsonHttpClient(url, timeout, retries, backoff, what="The teacher server",
                                   unreachable_error=TeacherServerError, reply_error=TeacherServerReplyError,
                                   address_flag="--teacher_server", timeout_flag="--teacher_server_timeout")
        self.url, self.model = self.http.url, model

    def _post(self, path: str, body: dict | None = None, stop: threading.Event | None = None) -> dict:
        """POST `body` as JSON to `path` (GET without a body); the answer's JSON (`runtime.http.JsonHttpClient`:
        retried with backoff, `stop` cancels the retries; a refusal or a reply that is not JSON raises at once)."""
        return self.http.get(path, stop=stop) if body is None else self.http.post(path, body, stop)

    def close(self) -> None:
        """Close the kept-alive connections (the next request opens new ones)."""
        self.http.close()

    def _field(self, out, key: str, path: str):
        """`out[key]`, or one line naming the server and what it answered instead."""
        if not isinstance(out, dict) or key not in out:
            raise TeacherServerReplyError(f"The teacher server {self.url} answered {path} without {key!r} "
                                          f"({excerpt(json.dumps(out))}): --teacher_server must be a vLLM server "
                                          "(`vllm serve`, its OpenAI-compatible API).")
        return out[key]

    def models(self) -> list[dict]:
        """The served models (``/v1/models``): each with its ``id`` and, from vLLM, ``max_model_len``."""
        return self._field(self._post("/v1/models"), "data", "/v1/models")

    def tokenize(self, text: str) -> list[int]:
        """The served model's token ids for `text` (``/tokenize``)."""
        return self._field(self._post("/tokenize", {"model": self.model, "prompt": text}), "tokens", "/tokenize")

    def check_tokenizer(self, tokenizer, text: str = "Distil the teacher, token by token: 1 2 3.") -> None:
        """One clear error when the server tokenizes `text` otherwise than `tokenizer` (another vocabulary)."""
        served, ours = self.tokenize(text), tokenizer(text, add_special_tokens=False)["input_ids"]
        if served[-len(ours):] != ours:
            raise ValueError(f"The teacher served at {self.url} ({self.model}) tokenizes {text!r} as {served}; the "
                             f"student's tokenizer gives {ours}. The served teacher must share the student's "
                             "tokenizer.")

    def top_k(self, ids: list[int], k: int) -> SparseTeacherSignal:
        """The teacher's signal for every position 0 .. len(ids) - 2 (position t predicts ``ids[t + 1]``):
        ``ids`` ``[T - 1, k]`` (most likely first), fp32 ``log_probs`` ``[T - 1, k]`` and ``tail_log_prob``."""
        return self.top_k_rows([ids], k)[0]

    def top_k_rows(self, rows: list[list[int]], k: int, stop: threading.Event | None = None
                   ) -> list[SparseTeacherSignal]:
        """`top_k` of several rows in one request (vLLM batches them); `stop` cancels its retries. Whatever the
        server answers that is not this is one `TeacherServerReplyError` naming the server and what it sent."""
        return [signal_of(arrays) for arrays in self.top_k_arrays(rows, k, stop)]

    def top_k_arrays(self, rows: list[list[int]], k: int, stop: threading.Event | None = None
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`top_k_rows` as numpy arrays (int64 ids, float64 log-probs, float64 tail), no torch: what a request thread
        may call (see `signal_of`)."""
        body = {"model": self.model, "prompt": [list(map(int, ids)) for ids in rows], "max_tokens": 1,
                "prompt_logprobs": k, "temperature": 0}
        try:
            out = self._post("/v1/completions", body, stop)
        except TeacherServerReplyError as error:
            if "max allowed" in str(error):
                raise TeacherServerReplyError(
                    f"The teacher server {self.url} returns fewer than {k} log-probs per token (vLLM's default "
                    f"--max-logprobs is 20): restart it with `vllm serve ... --max-logprobs {k}`, or ask for fewer "
                    "(--cache_top_k / --teacher_server_top_k).") from None
            raise
        choices = self._field(out, "choices", "/v1/completions")
        try:
            choices = sorted(choices, key=lambda choice: choice["index"])
            logprobs = [choice["prompt_logprobs"] for choice in choices]
        except (KeyError, TypeError):
            raise TeacherServerReplyError(f"The teacher server {self.url} answered /v1/completions with choices "
                                          f"vLLM does not send ({excerpt(json.dumps(choices))}): --teacher_server "
                                          "must be a vLLM server (`vllm serve`).") from None
        if len(choices) != len(rows):
            raise TeacherServerReplyError(f"The teacher server {self.url} returned {len(choices)} completions for "
                                          f"{len(rows)} prompts: --teacher_server must be a vLLM server.")
        return [self._arrays(entries, len(ids), k) for entries, ids in zip(logprobs, rows, strict=True)]

    def token_arrays(self, rows: list[list[int]], stop: threading.Event | None = None
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each row's own tokens' log-probs only (``prompt_logprobs=0``: what the sampled-token objective reads), as
        `top_k_arrays` gives a top-1: the ids are the row's tokens, the tail the rest of the mass."""
        body = {"model": self.model, "prompt": [list(map(int, ids)) for ids in rows], "max_tokens": 1,
                "prompt_logprobs": 0, "temperature": 0}
        choices = sorted(self._field(self._post("/v1/completions", body, stop), "choices", "/v1/completions"),
                         key=lambda choice: choice.get("index", 0) if isinstance(choice, dict) else 0)
        if len(choices) != len(rows):
            raise TeacherServerReplyError(f"The teacher server {self.url} returned {len(choices)} completions for "
                                          f"{len(rows)} prompts: --teacher_server must be a vLLM server.")
        out = []
        for choice, ids in zip(choices, rows, strict=True):
            entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise TeacherServerReplyError(f"The teacher server {self.url} returned no prompt_logprobs of each "
                                              f"token ({excerpt(json.dumps(entries))}): serve the teacher with vLLM.")
            try:
                own = [float(entry[str(token)]["logprob"]) for entry, token in zip(entries[1:], ids[1:], strict=True)]
            except (KeyError, TypeError, ValueError):
                raise TeacherServerReplyError(f"The teacher server {self.url} returned prompt_logprobs without the "
                                              "prompt's own tokens: serve the teacher with vLLM.") from None
            log_probs = np.asarray(own, dtype=np.float64).reshape(-1, 1)
            with np.errstate(divide="ignore"):
                tail = np.log1p(-np.minimum(np.exp(log_probs[:, 0]), 1.0))
            out.append((np.asarray(ids[1:], dtype=np.int64).reshape(-1, 1), log_probs, tail))
        return out

    def _arrays(self, prompt_logprobs: list | None, length: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(prompt_logprobs, list):
            got = "null" if prompt_logprobs is None else excerpt(json.dumps(prompt_logprobs))
            raise TeacherServerReplyError(
                f"The teacher server {self.url} returned no prompt_logprobs (got {got}) for a prompt: it ignores the "
                "request's prompt_logprobs field. Serve the teacher with vLLM (`vllm serve`), whose completions API "
                "returns them.")
        positions = prompt_logprobs[1:]
        if len(positions) != length - 1:
            raise TeacherServerReplyError(
                f"The teacher server {self.url} returned prompt_logprobs for {len(positions) + 1} positions of a "
                f"{length}-token prompt (one per token expected): serve the teacher with vLLM (`vllm serve`) and "
                "no option that truncates or rewrites prompts.")
        top_ids = np.zeros((len(positions), k), dtype=np.int64)
        top_log_probs = np.zeros((len(positions), k), dtype=np.float64)
        for t, entries in enumerate(positions):
            try:
                ranked = sorted((entry["rank"], int(token), float(entry["logprob"]))
                                for token, entry in entries.items())[:k]
            except (AttributeError, KeyError, TypeError, ValueError):
                raise TeacherServerReplyError(
                    f"The teacher server {self.url} returned prompt_logprobs at position {t + 1} in a shape vLLM "
                    f"does not send ({excerpt(json.dumps(entries))}): serve the teacher with vLLM.") from None
            if len(ranked) < k:
                raise TeacherServerReplyError(f"The teacher server {self.url} returned {len(ranked)} log-probs at "
                                              f"position {t + 1}, not {k}.")
            top_ids[t] = [token for _, token, _ in ranked]
            top_log_probs[t] = [log_prob for _, _, log_prob in ranked]
        kept = np.exp(top_log_probs).sum(axis=1)
        if top_log_probs.size and (top_log_probs.max() > 1e-4 or kept.max() > 1 + 1e-3):
            raise TeacherServerReplyError(
                f"The teacher server {self.url} returns logits, not log-probabilities (top-k mass {kept.max():.3g} > "
                "1): restart it without `--logprobs-mode raw_logits`.")
        with np.errstate(divide="ignore"):
            tail = np.log1p(-np.minimum(kept, 1.0))  # -inf when the top-k hold all the mass
        return top_ids, top_log_probs, tail


def signal_of(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> SparseTeacherSignal:
    """The `SparseTeacherSignal` (fp32 log-probs) of `TeacherServerClient.top_k_arrays`' numpy arrays. Call it on the
    thread that reads the signal, never on a daemon request thread: torch's bindings release the GIL inside an op,
    and a daemon thread that takes it back while the interpreter exits is ended by `pthread_exit` inside C++, which
    aborts the whole process ("terminate called without an active exception", exit status -6; torch 2.13,
    Python 3.11). numpy's C code is not affected (`tests/teacher/test_served_teacher.py`)."""
    ids, log_probs, tail = arrays
    return SparseTeacherSignal(torch.from_numpy(ids), torch.from_numpy(log_probs).float(),
                               torch.from_numpy(tail).float())
