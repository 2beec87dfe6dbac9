"""Is the Hugging Face Hub there? One quick probe before a name that is not a local path goes to the hub.

Without a network, `from_pretrained` and `datasets.load_dataset` retry for about a minute before their error. A name
that is not a local path, with ``HF_HUB_OFFLINE`` unset, is checked here first: one request to the endpoint
(``HF_ENDPOINT``, else huggingface.co) with a short deadline. Any HTTP answer, even an error status, means the hub is
reachable and loading goes on as before; no answer is one line naming the name and the fix, in seconds.
"""

from __future__ import annotations

import os
import threading

from ..errors import ExternalError

PROBE_TIMEOUT = 3.0  # seconds for the whole probe: name resolution, connection and the first byte of the answer
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_reachable: set[str] = set()  # endpoints that answered in this process (asked once)


class HubUnreachableError(ExternalError, ConnectionError):
    """A name that is not a local path, while the hub does not answer."""


def offline() -> bool:
    """Whether the user asked the Hugging Face libraries to use their local cache only."""
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE") for name in _OFFLINE_VARIABLES)


def endpoint() -> str:
    """The hub's address, as the Hugging Face libraries take it (``HF_ENDPOINT``, read now)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def unreachable_reason(url: str, timeout: float | None = None) -> str | None:
    """None when `url` answers a HEAD request within `timeout` seconds (any HTTP status), else why not, in a few
    words. The request runs in a thread, so that even a name lookup that hangs is bounded by the deadline."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    outcome: list[str | None] = []

    def probe() -> None:
        from huggingface_hub import get_session  # the hub's own client: its proxies, certificates and factory

        try:
            get_session().head(url, timeout=timeout)  # any status is an answer; the client does not retry
            outcome.append(None)
        except Exception as error:  # refused, unresolvable, timed out: no answer
            outcome.append(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)

    thread = threading.Thread(target=probe, name="trl-distill-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not outcome:
        return f"no answer within {timeout:g} s"
    return outcome[0]


def require_hub(name: str, what: str, kind: str = "directory") -> None:
    """Before `name` (not a local path) is loaded from the hub: raise one line when the hub does not answer and
    ``HF_HUB_OFFLINE`` is unset. `what` names the flag or argument (``--model_name_or_path``), `kind` the local thing
    `name` is not (``directory``, ``file or directory``)."""
    if offline():
        return
    url = endpoint()
    if url in _reachable:
        return
    reason = unreachable_reason(url)
    if reason is None:
        _reachable.add(url)
        return
    raise HubUnreachableError(
        f"{what}: {name!r} is not a local {kind} and the Hugging Face Hub is unreachable ({url}: {reason}): pass a "
        "local path, or set HF_HUB_OFFLINE=1 to use the local cache."
    )
