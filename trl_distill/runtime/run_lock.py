"""One run per output directory: a lock file in `output_dir`, taken before the student loads, released at the end.

Two runs started into one `output_dir` would both train and both save over each other's checkpoints and model. The
first run writes ``output_dir/.trl_distill_run.lock`` (its host, pid, the pid's start time and its command line,
created atomically); a second run reads it and stops with one line naming the holder. A lock whose holder is gone
is taken over, with a message: on this host when its pid is no longer alive (or is another process now: the start
time differs); from another host when its heartbeat (the holder touches the file every `HEARTBEAT_S`) stops moving
for `STALE_AFTER_S`.

With several processes only global rank 0 reads and writes the lock; every other rank learns its verdict by a
broadcast (the process group is set up first, as the Trainer would next), so a refused run stops on every rank with
the same line and none waits forever.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from ..errors import ExternalError, stderr_line

LOCK_NAME = ".trl_distill_run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # another host's lock whose heartbeat has not moved for this long belongs to a dead run


class RunLockedError(ExternalError):
    """Another live run holds the output directory."""


def _started(pid: int) -> float | None:
    """The start time of process `pid` on this host, None when there is no such (living) process; NaN for a live
    process whose start time we may not read (another user's)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.AccessDenied:
        return float("nan")
    except (psutil.NoSuchProcess, ProcessLookupError, ValueError):
        return None


def _holder_line(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}"
            f"{', since ' + holder['since'] if holder.get('since') else ''}"
            f"{' (' + holder['command'] + ')' if holder.get('command') else ''}")


class RunLock:
    """The lock this process holds on `output_dir` (a no-op on ranks other than 0); `release` ends it."""

    def __init__(self, output_dir: str, token: str | None = None, created_dir: bool = False):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.token, self.created_dir, self.pid = token, created_dir, os.getpid()
        self._stop, self._beating = threading.Event(), None
        if token is not None:
            self._beating = threading.Thread(target=self._beat, name="trl_distill-run-lock", daemon=True)
            self._beating.start()
            atexit.register(self.release)

    def _ours(self) -> bool:
        holder = _read(self.path)
        return holder is not None and holder.get("token") == self.token

    def _beat(self) -> None:
        """Touch the lock file every `HEARTBEAT_S` while it is still ours (what another host checks)."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self._ours():
                    return
                os.utime(self.path)
            except OSError:
                continue

    def release(self) -> None:
        """Remove the lock file if it is still ours, and the output directory if the lock made it and it is empty.
        Safe to call more than once, and in a forked child (which does nothing)."""
        if self.token is None or self._stop.is_set() or os.getpid() != self.pid:
            return
        self._stop.set()
        if self._beating is not threading.current_thread():  # ended before the interpreter finalizes: a daemon
            self._beating.join(2)  # thread running Python then aborts the process (with torch loaded)
        with contextlib.suppress(OSError):
            if self._ours():
                os.remove(self.path)
            if self.created_dir and not os.listdir(self.output_dir):
                os.rmdir(self.output_dir)


def _read(path: str) -> dict | None:
    """The lock file's record; ``{}`` when it is there but unreadable (a record being written, or damaged); None
    when there is none."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _record() -> dict:
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "token": uuid.uuid4().hex}


def _create(path: str, record: dict) -> bool:
    """Create `path` holding `record`, atomically: False when it already exists. (Written to a file of our own,
    then hard-linked into place, so a reader never sees half a record; `O_EXCL` where links are not supported.)"""
    tmp = f"{path}.{record['host']}.{record['pid']}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _same_process(holder: dict, record: dict) -> bool:
    """Whether `holder` is this very process (same host, pid and start time: a pid reused after a restart is not)."""
    if holder.get("host") != record["host"] or holder.get("pid") != record["pid"]:
        return False
    started, recorded = record.get("started"), holder.get("started")
    return started is None or recorded is None or abs(float(recorded) - started) <= 1.0


def _mtime(path: str) -> float | None:
    try:  # opened, so a network filesystem revalidates its cached attributes (close-to-open)
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return None


def _gone(holder: dict, path: str, stale_after: float) -> str | None:
    """Why the run that wrote `holder` is gone, or None when it is (or may be) alive."""
    if not holder:  # unreadable: a record being written lasts microseconds; an old one is damaged
        mtime = _mtime(path)
        return "its record is unreadable" if mtime is None or time.time() - mtime > stale_after else None
    if holder.get("host") == socket.gethostname():
        if not isinstance(holder.get("pid"), int):
            return "its record names no process"
        started = _started(holder["pid"])
        recorded = holder.get("started") if isinstance(holder.get("started"), int | float) else None
        if started is None:
            return f"pid {holder.get('pid')} is no longer running on this host"
        if recorded is not None and abs(started - float(recorded)) > 1.0:  # (False for NaN: alive)
            return f"pid {holder.get('pid')} is another process now"
        return None
    first = _mtime(path)
    if first is None:
        return "its record is gone"
    if time.time() - first > 4 * stale_after:  # long past (beyond any clock skew between hosts)
        return f"its heartbeat stopped {int(time.time() - first)} s ago"
    deadline = time.monotonic() + stale_after  # watch it: a live holder touches it every HEARTBEAT_S
    while time.monotonic() < deadline:
        time.sleep(min(1.0, stale_after / 10))
        if _mtime(path) != first:
            return None
    return f"its heartbeat did not move for {int(stale_after)} s"


def acquire(output_dir: str, stale_after: float = STALE_AFTER_S) -> RunLock:
    """Take the lock on `output_dir` for this process (creating the directory if needed), or raise
    `RunLockedError` naming the live run that holds it. A lock this process already holds is kept; a dead run's is
    taken over, with a message on stderr."""
    created = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    for _ in range(3):  # another run may take over the same stale lock at the same moment: look again
        record = _record()
        if _create(path, record):
            return RunLock(output_dir, record["token"], created)
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        if _same_process(holder, record):
            return RunLock(output_dir)  # this process holds it already (an earlier trainer here): keep that one
        seen = _seen_stale.pop(path, None)
        reason = _gone(holder, path, 0 if seen == holder else stale_after)  # found gone already: not watched again
        if reason is None:
            raise RunLockedError(_locked_message(output_dir, path, holder))
        with contextlib.suppress(FileNotFoundError):
            if _read(path) == holder:
                os.remove(path)
        left_by = _holder_line(holder) if holder else "a run"
        stderr_line(f"trl-distill: taking over the stale lock {path} left by {left_by}: {reason}.")
    raise RunLockedError(f"Could not take the lock {path}: other runs keep taking it. Pass another --output_dir.")


_seen_stale: dict[str, dict] = {}  # lock path -> a holder `refuse_if_locked` found gone (not watched twice)


def _refusal(output_dir: str, stale_after: float = STALE_AFTER_S) -> str | None:
    """The one line refusing `output_dir` when a live run other than this process holds its lock, else None."""
    path = os.path.join(output_dir, LOCK_NAME)
    holder = _read(path)
    if holder is None or _same_process(holder, _record()):
        return None
    if _gone(holder, path, stale_after) is not None:
        _seen_stale[path] = holder
        return None
    return _locked_message(output_dir, path, holder)


def _locked_message(output_dir: str, path: str, holder: dict) -> str:
    return (f"Another run is using output_dir {output_dir!r}: {_holder_line(holder)} holds {path}. Wait for it to "
            "finish, or pass another --output_dir (delete that file only if that run is gone).")


def _collective(args, decide) -> object:
    """`decide()` on global rank 0 (an error message or None), broadcast; every rank raises `RunLockedError` with
    the message. Returns what `decide` returned on this rank (None elsewhere)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    _ = args.device  # sets up the process group (as the Trainer does next anyway)
    state = getattr(args, "distributed_state", None) or PartialState()
    result, verdict, bug = None, [None], None
    if state.is_main_process:
        try:
            result = decide()
        except RunLockedError as error:
            verdict = [str(error)]
        except Exception as error:  # noqa: BLE001 - said on every rank (none waits for rank 0), raised below
            bug = None if isinstance(error, OSError) else error
            verdict = [f"Cannot take the run lock in output_dir {args.output_dir!r} ({error}): pass a writable "
                       "--output_dir."]
        if isinstance(result, str):
            verdict, result = [result], None
    if state.num_processes > 1:
        verdict = broadcast_object_list(verdict, from_process=0)
    if bug is not None:
        raise bug  # our own: its traceback on rank 0 (the other ranks stop with the line)
    if verdict[0] is not None:
        raise RunLockedError(verdict[0])
    return result


def refuse_if_locked(args) -> None:
    """Stop every rank with one line, before anything loads, when a live run holds `args.output_dir` (its lock is
    taken later, `take_run_lock`; a stale one is taken over then). Writes nothing. Collective."""
    _collective(args, lambda: _refusal(args.output_dir))


def take_run_lock(args) -> RunLock:
    """`acquire` on global rank 0, its verdict broadcast to every rank: every rank raises the same
    `RunLockedError` when another run holds `args.output_dir`. Collective; call on every rank."""
    lock = _collective(args, lambda: acquire(args.output_dir))
    return lock if lock is not None else RunLock(args.output_dir)
