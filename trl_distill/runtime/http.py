"""The one HTTP client for the servers the project talks to (vLLM's: the served teacher, a rollout server): JSON in
and out over `requests`, with keep-alive, a timeout per request, retries with backoff, and one-line errors.

Connections: one `requests.Session` per thread (a `threading.local`; a Session shared by threads is common but not
documented thread-safe), each with an `HTTPAdapter` of one kept-alive connection, since a thread sends one request
at a time: N threads hold N connections to the server, reused request after request. The Sessions are kept until
`close` (not freed with their threads); a forked or unpickled copy of the client opens its own (a child never writes
on its parent's sockets).

Retries: the adapter's urllib3 `Retry` is set to none, and `JsonHttpClient` retries itself, because urllib3 sleeps
between its retries where nothing can interrupt it: here the wait is `stop.wait(...)`, so setting `stop` (training
stopping) ends the retries at once. What is retried (`retries` times, waiting ``backoff * 2 ** (n - 1)`` s before
the n-th retry): no connection (refused, reset, closed), no answer within `timeout` seconds (per connect and per
read), HTTP 5xx. What is not (retrying would get the same): HTTP 4xx, a reply that is not JSON, a URL that is not
http(s); these are the caller's `reply_error` at once (the last the caller's `unreachable_error`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # requests is imported where it is used: `import trl_distill` does without it
    import requests


def excerpt(raw: bytes | str, limit: int = 160) -> str:
    """The start of a reply on one line, for a message."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


class JsonHttpClient:
    """JSON requests to the server at `url` (e.g. ``http://host:8000``), safe to use from several threads at once.

    Args:
        url: the server's base URL; paths are appended to it.
        timeout: seconds to connect, and seconds for each read of the answer.
        retries: attempts after the first for a request the server did not answer or answered with HTTP 5xx.
        backoff: seconds before the first retry, doubled before each next one.
        what: the server in messages, capitalised (``"The teacher server"``).
        unreachable_error: raised (with the message) when every attempt failed, or on cancellation.
        reply_error: raised at once when the server refused the request (4xx) or answered something else than JSON.
        address_flag / timeout_flag: the options that set the address and the timeout, named in the advice.
        command: what serves there, named in the advice (``"vllm serve"``).
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0, *,
                 what: str = "The server", unreachable_error: type[Exception] = ConnectionError,
                 reply_error: type[Exception] = ValueError, address_flag: str = "the address",
                 timeout_flag: str = "the timeout", command: str = "vllm serve"):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.what, self.unreachable_error, self.reply_error = what, unreachable_error, reply_error
        self.address_flag, self.timeout_flag, self.command = address_flag, timeout_flag, command
        self._open()

    def _open(self) -> None:
        self._local, self._lock, self._pid = threading.local(), threading.Lock(), os.getpid()
        # Every thread's, held here until `close`: a Session freed as its thread ends runs urllib3's weakref
        # finalizers on that thread, which can race the interpreter's own exit ("dictionary changed size during
        # iteration" in weakref's atexit hook, after a run stopped on a server fault).
        self._sessions = []

    def __getstate__(self) -> dict:  # sessions and locks stay in this process
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "_pid", "_sessions")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def _session(self) -> requests.Session:
        """This thread's Session (a new one in a forked child: the parent's sockets are the parent's)."""
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        if self._pid != os.getpid():
            self._open()
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=Retry(0, read=False))
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            with self._lock:
                self._local.session = session
                self._sessions.append(session)
        return session

    def get(self, path: str, params: dict | None = None, stop: threading.Event | None = None):
        """GET `path` (with query `params`); the answer's JSON."""
        return self._request("GET", path, None, params, stop)

    def post(self, path: str, body=None, stop: threading.Event | None = None, params: dict | None = None):
        """POST `body` as JSON (no body when None) to `path`; the answer's JSON. `stop` cancels the retries."""
        return self._request("POST", path, body, params, stop)

    def close(self) -> None:
        """Close every thread's connections; the next request opens new ones."""
        with self._lock:
            sessions, self._sessions, self._local = self._sessions, [], threading.local()
        for session in sessions:
            session.close()

    def _request(self, method: str, path: str, body, params: dict | None, stop: threading.Event | None):
        import requests

        what, attempts = f"{self.what} {self.url}", self.retries + 1
        failure, answered = None, False
        for attempt in range(attempts):  # `stop` set before the first attempt: none is made
            if _wait(stop, self.backoff * 2 ** (attempt - 1) if attempt else 0):
                raise self.unreachable_error(f"The request to {self.what[:1].lower()}{self.what[1:]} "
                                             f"{self.url}{path} was cancelled.")
            try:
                response = self._session().request(method, self.url + path, params=params, timeout=self.timeout,
                                                   json=body)
            except requests.Timeout:
                failure, answered = f"timed out (accepted, no answer within {self.timeout_flag})", False
                continue
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as error:
                cause = _cause(error)
                failure, answered = f"{type(cause).__name__}: {cause}", False
                continue
            except (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
                    requests.exceptions.MissingSchema) as error:
                raise self.unreachable_error(f"{what} cannot be asked for {path} ({error}): {self.address_flag} "
                                             "must be an http:// or https:// address.") from None
            except requests.RequestException as error:  # (too many redirects, an undecodable body): not retried
                raise self.unreachable_error(f"{what} failed on {path}: {type(error).__name__}: {error}") from None
            raw, status = response.content, response.status_code
            if status >= 500:
                failure, answered = f"HTTP {status} {response.reason} {excerpt(raw, 500)}", True
                continue
            if status >= 400:  # the request is wrong: retrying will not help
                raise self.reply_error(f"{what} refused {path}: HTTP {status}: {excerpt(raw, 500)}")
            try:
                return json.loads(raw)
            except ValueError:
                kind = response.headers.get("Content-Type", "text/plain").split(";")[0].strip().lower()
                raise self.reply_error(
                    f"{what} answered {path} with HTTP {status} but not JSON ({kind}: {excerpt(raw)}): "
                    f"{self.address_flag} must be the address of the vLLM server itself (http://host:port, as "
                    f"`{self.command}` prints it), not a proxy, login or web page.") from None
        if answered:
            error = self.unreachable_error(f"{what} answered {path} with {failure} on all {attempts} "
                                           "attempts: it fails on this request (see its log); fix or restart it.")
            error.answered = True  # the server is up and failed the request (not: gone, or too slow)
            raise error
        raise self.unreachable_error(f"{what} did not answer {path} after {attempts} attempts ({self.timeout:g} s "
                                     f"timeout each): {failure}. Is `{self.command}` running there? Check its log; "
                                     f"raise {self.timeout_flag} if it is only slow.")


def _cause(error: BaseException) -> BaseException:
    """The OS-level error under requests' and urllib3's wrappers (``ConnectionRefusedError``, ...), else `error`."""
    found = error
    for _ in range(8):
        if type(found).__module__ in ("builtins", "socket", "ssl", "http.client"):
            return found
        reason = getattr(found, "reason", None)
        inner = [arg for arg in found.args if isinstance(arg, BaseException)]
        found = reason if isinstance(reason, BaseException) else inner[-1] if inner else found.__cause__
        if found is None:
            return error
    return error


def _wait(stop: threading.Event | None, seconds: float) -> bool:
    """Sleep `seconds`; True, at once, if `stop` is set meanwhile."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)
