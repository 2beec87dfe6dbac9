"""A teacher served by vLLM (an OpenAI-compatible server): its sparse top-k signal, fetched over HTTP.

`TeacherServerClient.top_k` sends a row's token ids as the ``prompt`` of ``/v1/completions`` with ``max_tokens=1`` and
``prompt_logprobs=k``: per position t >= 1 the server returns the teacher's k most likely tokens after the prefix
``ids[:t]`` (ranked, plus the actual token when it is not among them). The tail log mass is what they leave,
``log(1 − Σ p_i)``: the same `loss.sparse.SparseTeacherSignal` the ZeRO-3 teacher writes into a cache.

Temperature 1 only: vLLM's prompt log-probs are the raw model's whatever its ``--logprobs-mode`` (vLLM 0.32
documents that its processed modes apply no sampling processor, temperature included, to prompt tokens), and the
top-k alone cannot be renormalised at another temperature (that needs the whole vocabulary's mass).
Requests time out and are retried with backoff; a server that stays unreachable, hangs or answers HTTP 5xx is one
`TeacherServerError` naming it, never a hang, and one that answers something else than vLLM's reply (an HTML page,
no or misshapen log-probs) is a `TeacherServerReplyError` naming what it sent: both are `errors.ExternalError`s, one
line from the command line whenever they happen.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from ..errors import ExternalError
from ..loss.sparse import SparseTeacherSignal


class TeacherServerError(ExternalError, ConnectionError):
    """The teacher server did not answer (down, unreachable or too slow) after every retry, or answered nonsense."""


class TeacherServerReplyError(TeacherServerError, ValueError):
    """The teacher server answered, but not what vLLM answers (a refusal, an HTML page, missing or misshapen
    log-probs): retrying would get the same. A `ValueError` too, so set-up reports it as bad input."""


def excerpt(raw: bytes | str, limit: int = 160) -> str:
    """The start of a reply on one line, for a message."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


class TeacherServerClient:
    """The teacher `model` served at `url` (e.g. ``http://host:8000``)."""

    def __init__(self, url: str, model: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        self.url, self.model = url.rstrip("/"), model
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def _post(self, path: str, body: dict | None = None, stop: threading.Event | None = None) -> dict:
        """POST `body` as JSON to `path` (GET without a body); the answer's JSON. A server that is down, resets
        the connection, answers HTTP 5xx or not within `timeout` is tried again (`retries` times, with backoff),
        unless `stop` is set meanwhile; one that refuses the request (4xx) or answers something else than JSON
        is a `TeacherServerReplyError` at once."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        failure, answered = None, False
        for attempt in range(self.retries + 1):
            if attempt and _wait(stop, self.backoff * 2 ** (attempt - 1)):
                raise TeacherServerError(f"The request to the teacher server {self.url}{path} was cancelled.")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw, kind = response.read(), response.headers.get_content_type()
            except urllib.error.HTTPError as http_error:
                detail = excerpt(http_error.read(), 500)
                if http_error.code < 500:  # the request is wrong: retrying will not help
                    raise TeacherServerReplyError(f"The teacher server {self.url} refused {path}: HTTP "
                                                  f"{http_error.code}: {detail}") from None
                failure, answered = f"HTTP {http_error.code} {http_error.reason} {detail}", True
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as error:
                reason = getattr(error, "reason", error)
                failure = ("timed out (accepted, no answer within --teacher_server_timeout)"
                           if isinstance(reason, TimeoutError) else f"{type(reason).__name__}: {reason}")
                answered = False
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise TeacherServerReplyError(
                    f"The teacher server {self.url} answered {path} with HTTP 200 but not JSON ({kind}: "
                    f"{excerpt(raw)}): --teacher_server must be the address of the vLLM server itself "
                    "(http://host:port, as `vllm serve` prints it), not a proxy, login or web page.") from None
        if answered:
            raise TeacherServerError(f"The teacher server {self.url} answered {path} with {failure} on all "
                                     f"{self.retries + 1} attempts: it fails on this request (see its log); fix or "
                                     "restart it.")
        raise TeacherServerError(f"The teacher server {self.url} did not answer {path} after {self.retries + 1} "
                                 f"attempts ({self.timeout:g} s timeout each): {failure}. Is `vllm serve` running "
                                 "there? Check its log; raise --teacher_server_timeout if it is only slow.")

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
        return [self._signal(entries, len(ids), k) for entries, ids in zip(logprobs, rows, strict=True)]

    def _signal(self, prompt_logprobs: list | None, length: int, k: int) -> SparseTeacherSignal:
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
        return SparseTeacherSignal(torch.from_numpy(top_ids), torch.from_numpy(top_log_probs).float(),
                                   torch.from_numpy(tail).float())


def _wait(stop: threading.Event | None, seconds: float) -> bool:
    """Sleep `seconds`; True, at once, if `stop` is set meanwhile."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)
