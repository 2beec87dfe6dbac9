"""A teacher served by vLLM (an OpenAI-compatible server): its sparse top-k signal, fetched over HTTP.

`TeacherServerClient.top_k` sends a row's token ids as the ``prompt`` of ``/v1/completions`` with ``max_tokens=1`` and
``prompt_logprobs=k``: per position t >= 1 the server returns the teacher's k most likely tokens after the prefix
``ids[:t]`` (ranked, plus the actual token when it is not among them). The tail log mass is what they leave,
``log(1 − Σ p_i)``: the same `loss.sparse.SparseTeacherSignal` the ZeRO-3 teacher writes into a cache.

Temperature 1 only: vLLM's prompt log-probs are the raw model's whatever its ``--logprobs-mode`` (vLLM 0.32
documents that its processed modes apply no sampling processor, temperature included, to prompt tokens), and the
top-k alone cannot be renormalised at another temperature (that needs the whole vocabulary's mass).
Requests time out and are retried with backoff; a server that stays unreachable is one `TeacherServerError`
naming it, never a hang.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from ..errors import ExternalError
from ..loss.sparse import SparseTeacherSignal


class TeacherServerError(ExternalError, ConnectionError):
    """The teacher server did not answer (down, unreachable or too slow) after every retry, or answered nonsense."""


class TeacherServerClient:
    """The teacher `model` served at `url` (e.g. ``http://host:8000``)."""

    def __init__(self, url: str, model: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        self.url, self.model = url.rstrip("/"), model
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def _post(self, path: str, body: dict | None = None) -> dict:
        """POST `body` as JSON to `path` (GET without a body); the answer's JSON."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as http_error:
                if http_error.code < 500:  # the request is wrong: retrying will not help
                    detail = http_error.read().decode(errors="replace")[:500]
                    raise ValueError(f"The teacher server {self.url} refused {path}: HTTP {http_error.code}: "
                                     f"{detail}") from None
                error = http_error
            except (urllib.error.URLError, TimeoutError, ConnectionError) as network_error:
                error = network_error
        raise TeacherServerError(f"The teacher server {self.url} did not answer {path} after {self.retries + 1} "
                                 f"attempts ({self.timeout:g} s timeout each): {error}. Is `vllm serve` running "
                                 "there?")

    def models(self) -> list[dict]:
        """The served models (``/v1/models``): each with its ``id`` and, from vLLM, ``max_model_len``."""
        return self._post("/v1/models")["data"]

    def tokenize(self, text: str) -> list[int]:
        """The served model's token ids for `text` (``/tokenize``)."""
        return self._post("/tokenize", {"model": self.model, "prompt": text})["tokens"]

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

    def top_k_rows(self, rows: list[list[int]], k: int) -> list[SparseTeacherSignal]:
        """`top_k` of several rows in one request (vLLM batches them)."""
        body = {"model": self.model, "prompt": [list(map(int, ids)) for ids in rows], "max_tokens": 1,
                "prompt_logprobs": k, "temperature": 0}
        try:
            out = self._post("/v1/completions", body)
        except ValueError as error:
            if "max allowed" in str(error):
                raise ValueError(f"The teacher server {self.url} returns fewer than {k} log-probs per token (vLLM's "
                                 f"default --max-logprobs is 20): restart it with `vllm serve ... --max-logprobs {k}`, "
                                 "or ask for fewer (--cache_top_k / --teacher_server_top_k).") from None
            raise
        choices = sorted(out["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(rows):
            raise ValueError(f"The teacher server returned {len(choices)} completions for {len(rows)} prompts.")
        return [self._signal(choice["prompt_logprobs"], len(ids), k) for choice, ids in zip(choices, rows, strict=True)]

    def _signal(self, prompt_logprobs: list, length: int, k: int) -> SparseTeacherSignal:
        positions = prompt_logprobs[1:]
        if len(positions) != length - 1:
            raise ValueError(f"The teacher server returned {len(positions) + 1} positions for {length} tokens.")
        top_ids = np.zeros((len(positions), k), dtype=np.int64)
        top_log_probs = np.zeros((len(positions), k), dtype=np.float64)
        for t, entries in enumerate(positions):
            ranked = sorted(((entry["rank"], int(token), entry["logprob"]) for token, entry in entries.items()))[:k]
            if len(ranked) < k:
                raise ValueError(f"The teacher server returned {len(ranked)} log-probs at position {t + 1}, not {k}.")
            top_ids[t] = [token for _, token, _ in ranked]
            top_log_probs[t] = [log_prob for _, _, log_prob in ranked]
        kept = np.exp(top_log_probs).sum(axis=1)
        if top_log_probs.size and (top_log_probs.max() > 1e-4 or kept.max() > 1 + 1e-3):
            raise ValueError(f"The teacher server {self.url} returns logits, not log-probabilities (top-k mass "
                             f"{kept.max():.3g} > 1): restart it without `--logprobs-mode raw_logits`.")
        with np.errstate(divide="ignore"):
            tail = np.log1p(-np.minimum(kept, 1.0))  # -inf when the top-k hold all the mass
        return SparseTeacherSignal(torch.from_numpy(top_ids), torch.from_numpy(top_log_probs).float(),
                                   torch.from_numpy(tail).float())
