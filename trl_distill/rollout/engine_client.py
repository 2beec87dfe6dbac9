"""The rollout server's client: the student's completions sampled by vLLM, and vLLM's weight-transfer routes.

Every request goes through `runtime.http.JsonHttpClient` (pooled keep-alive connections, timeouts, backoff).
Sampling requests are retried; weight-transfer requests never are (each is one side of a collective that a retry
would deadlock), and they may take as long as ``vllm_server_timeout``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import ExternalError
from ..runtime.http import JsonHttpClient, excerpt


class RolloutServerError(ExternalError, ConnectionError):
    """The rollout server did not answer (down, unreachable, too slow) or failed a request."""


class RolloutServerReplyError(RolloutServerError, ValueError):
    """The rollout server answered, but not what our vLLM server answers (another server, model or tokenizer)."""


@dataclass
class Rollout:
    """One sampled completion: its token ids (up to and including EOS, if sampled), the engine's log-prob of each
    (the raw model's, at temperature 1) and whether it ended with EOS."""

    token_ids: list[int]
    logprobs: list[float]
    ended: bool


def server_url(base_url: str | None, host: str, port: int) -> str:
    """TRL's rule: `vllm_server_base_url` if given, else ``http://vllm_server_host:vllm_server_port``."""
    if base_url:
        return base_url.rstrip("/")
    return f"http://{host}:{port}"


class RolloutServerClient:
    """The vLLM server at `url` serving the student (``trl-distill vllm-serve``)."""

    def __init__(self, url: str, timeout: float = 240.0, concurrency: int = 8):
        self.url = url.rstrip("/")
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        kwargs = dict(what="The rollout server", unreachable_error=RolloutServerError,
                      reply_error=RolloutServerReplyError, address_flag="--vllm_server_base_url",
                      timeout_flag="--vllm_server_timeout", command="trl-distill vllm-serve")
        self.http = JsonHttpClient(self.url, timeout=min(timeout, 60.0), retries=3, backoff=1.0, **kwargs)
        self.control = JsonHttpClient(self.url, timeout=timeout, retries=0, **kwargs)  # never retried
        self.concurrency, self._pool = concurrency, None  # request threads, started at the first rollout
        self.model = None

    # ---- set-up checks ----

    def connect(self, tokenizer, probe: str = "Distil the student, token by token: 1 2 3.") -> str:
        """The served model's name; one clear error when the server is not ours (no weight-transfer routes) or
        tokenizes otherwise than the student's tokenizer."""
        models = self.http.get("/v1/models").get("data") or []
        if not models:
            raise RolloutServerReplyError(f"The rollout server {self.url} serves no model (/v1/models is empty).")
        self.model = models[0]["id"]
        try:
            self.control.get("/is_paused")
        except RolloutServerReplyError:
            raise RolloutServerReplyError(
                f"The server at {self.url} serves {self.model} but has no weight-transfer routes: the student's "
                "weights could not be synced. Start it with `trl-distill vllm-serve --model STUDENT` (vLLM with "
                "VLLM_SERVER_DEV_MODE=1 and trl_distill's gloo engine).") from None
        served = self.http.post("/tokenize", {"model": self.model, "prompt": probe}).get("tokens")
        ours = tokenizer(probe, add_special_tokens=False)["input_ids"]
        if not isinstance(served, list) or served[-len(ours):] != ours:
            raise RolloutServerReplyError(
                f"The rollout server {self.url} ({self.model}) tokenizes {probe!r} as {served}; the student's "
                f"tokenizer gives {ours}. Serve the student itself (`trl-distill vllm-serve --model STUDENT`).")
        return self.model

    def world_size(self) -> int:
        return int(self.control.get("/get_world_size")["world_size"])

    # ---- sampling ----

    def sample(self, prompts: list[list[int]], seeds: list[int], *, max_tokens: int, temperature: float,
               top_p: float, top_k: int, stop_token_ids: list[int]) -> list[Rollout]:
        """One completion per prompt (token ids in, token ids out), each request seeded by its own seed."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k if top_k > 0 else -1, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": stop_token_ids, "skip_special_tokens": False}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="trl-distill-rollout")
        futures = [self._pool.submit(self._one, {**body, "prompt": prompt, "seed": seed})
                   for prompt, seed in zip(prompts, seeds)]
        return [future.result() for future in futures]

    def _one(self, body: dict) -> Rollout:
        out = self.http.post("/v1/completions", body)
        try:
            choice = out["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise RolloutServerReplyError(f"The rollout server {self.url} answered /v1/completions without token ids "
                                          f"and log-probs ({excerpt(str(out))}): serve the student with "
                                          "`trl-distill vllm-serve`.") from None
        ended = bool(ids) and ids[-1] in body["stop_token_ids"]
        return Rollout(ids, logprobs[: len(ids)], ended)

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The served model's log-prob of each token of `ids` after its prefix (positions 1..n-1)."""
        out = self.http.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                                 "prompt_logprobs": 0, "temperature": 0.0})
        entries = out["choices"][0]["prompt_logprobs"][1:]
        return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, ids[1:])]

    # ---- vLLM's weight-transfer routes ----

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.control.post("/init_weight_transfer_engine", {"init_info": init_info})

    def pause(self) -> None:
        self.control.post("/pause", params={"mode": "wait"})

    def resume(self) -> None:
        self.control.post("/resume")

    def start_weight_update(self) -> None:
        self.control.post("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.control.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, version: str) -> None:
        self.control.post("/finish_weight_update", {"weight_version": version})

    def weight_version(self) -> str | None:
        return self.control.get("/weight_info").get("weight_version")

    def answers(self, tries: int = 2, timeout: float = 5.0) -> bool:
        """Whether the server still answers its ``/health`` (asked `tries` times, a second apart, not retried with
        backoff): after a failed request, tells a server that is gone from one that refused."""
        import time

        import requests

        for attempt in range(tries):
            try:
                if requests.get(self.url + "/health", timeout=timeout).ok:
                    return True
            except requests.RequestException:
                pass
            if attempt + 1 < tries:
                time.sleep(1.0)
        return False

    def close(self) -> None:
        """Stop the request threads and close the connections; a later request opens new ones."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.http.close()
        self.control.close()
