"""The command line's error boundaries: bad input found while parsing and setting up is one line, never a traceback
(`errors_as_messages`), and so is an expected fault at any later time (`faults_as_messages`: an
`errors.ExternalError`, a full disk, a peer process that stopped answering or went away, Ctrl-C, SIGTERM under
`sigterm_raises`); anything else raised once the work has started is our bug and keeps its traceback. Either way the
process leaves without waiting for its peers at exit (`runtime.distributed.note_failure`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable

from ..errors import ExternalError, stderr_line

# How a full disk reads when a library re-raises it as its own error (torch.save, safetensors' Rust I/O)
_DISK_FULL = ("no space left on device", "disk quota exceeded", "storagefull", "quotaexceeded")
_WRITE_FAILED = ("file write failed", "unexpected pos")  # torch.save's writer, which does not say why
# The names a path being written goes by in the frames that write it (open, torch.save, save_file, the Trainer)
_PATH_NAMES = ("filename", "file", "f", "path", "save_path", "output_file", "save_directory", "output_dir")


TERMINATED_STATUS = 128 + signal.SIGTERM  # 143: a shell's status for a process SIGTERM stopped
RESUME = "resume with --resume_from_checkpoint true"


class Terminated(BaseException):  # noqa: N818 (a signal, as KeyboardInterrupt: no `except Exception` swallows it)
    """SIGTERM reached the process (a scheduler preempting the job, `kill`, a launcher stopping its ranks), raised in
    its main thread by `sigterm_raises`."""


@contextlib.contextmanager
def sigterm_raises():
    """Inside the block SIGTERM raises `Terminated` in this process's main thread, so a boundary below says what the
    run kept, instead of the process dying silently (status -15). Once: a second SIGTERM kills as before, and so
    does one reaching a process forked inside (a DataLoader worker). The previous handler is back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() != owner:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def note_sigterm() -> threading.Event:
    """An event set when SIGTERM arrives, its current handler still called: the HF Trainer's own under
    `--enable_jit_checkpoint`, which saves a checkpoint and stops training as if it had ended. The caller can then say
    so instead of saving the half-trained student as the result."""
    seen = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        return seen

    def handler(signum, frame):
        seen.set()
        previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)
    return seen


def kept_checkpoint(output_dir: str) -> str:
    """What a stopped run leaves to go on from: its newest complete checkpoint (the one `--resume_from_checkpoint
    true` takes) and how to resume it, or that there is none yet."""
    from ..runtime.checkpoints import checkpoints_newest_first, resumable

    newest = next((c for c in checkpoints_newest_first(output_dir) if resumable(c)), None)
    if newest is None:
        return f"no complete checkpoint in {output_dir} yet: the same command starts again from step 0."
    return (f"the last complete checkpoint is {newest} (step {newest.rsplit('-', 1)[1]}): {RESUME} (the same "
            "command).")


@contextlib.contextmanager
def errors_as_messages(prog: str = "trl-distill"):
    """Turn `ValueError`, `TypeError`, `OSError` (missing files, unreadable configs) and `ExternalError` raised in the
    block into ``PROG: error: <first line>`` on stderr and exit status 2, and so a collective that lost its peer
    (one that failed its own set-up: its line says why). Wrap argument parsing and set-up only."""
    try:
        yield
    except (ValueError, TypeError, OSError, ExternalError) as error:
        _note_failure()
        _exit_with(prog, error, 2)
    except Terminated:
        _note_failure()
        stderr_line(f"{prog}: terminated (SIGTERM) while setting up: stopped before the work started.")
        sys.exit(TERMINATED_STATUS)
    except Exception as error:
        _note_failure()
        peer = _peer_failure(error)
        if peer is None:
            raise
        _exit_with(prog, peer, 2)


@contextlib.contextmanager
def faults_as_messages(prog: str = "trl-distill", kept: Callable[[], str] | None = None):
    """Around the work itself (training, saving, writing a cache): an `ExternalError`, a disk that is full or over
    quota (however the writing library reports it), a collective whose peer stopped answering within
    `--ddp_timeout` or went away (`errors.PeerLostError`), Ctrl-C or SIGTERM (`Terminated`) is ``PROG: ...`` on one
    line on stderr of the rank that met it and exit status 1 (130 for Ctrl-C, 143 for SIGTERM: their line ends with
    `kept()`, what the run leaves to go on from); every other exception keeps its traceback. Nothing is cleaned up
    here: checkpoints are marked complete only once whole (`runtime.checkpoints`), so the last complete one is what a
    resume finds."""
    try:
        yield
    except ExternalError as error:
        _note_failure()
        _exit_with(prog, error, 1)
    except KeyboardInterrupt:
        _note_failure()
        stderr_line(f"{prog}: interrupted (Ctrl-C): stopped; "
                    f"{kept() if kept else f'the last complete checkpoint is kept ({RESUME}).'}")
        sys.exit(130)
    except Terminated:
        _note_failure()
        stderr_line(f"{prog}: terminated (SIGTERM): stopped; "
                    f"{kept() if kept else f'the last complete checkpoint is kept ({RESUME}).'}")
        sys.exit(TERMINATED_STATUS)
    except Exception as error:
        _note_failure()
        full = disk_full_message(error)
        if full is not None:
            stderr_line(f"{prog}: error: {full}")
            sys.exit(1)
        peer = _peer_failure(error)
        if peer is None:
            raise
        _exit_with(prog, peer, 1)


def disk_full_message(error: BaseException) -> str | None:
    """One line for an error that a full disk (or an exceeded quota) caused, naming the file being written, its
    filesystem and the free space there; None for any other error."""
    chain = _chain(error)
    found = _disk_full(chain)
    if found is None:
        return None
    reason, path = found
    path = os.path.abspath(os.fspath(path or _path_written(chain) or "."))
    mount, existing = _filesystem(path)
    free = shutil.disk_usage(existing).free
    return (f"the disk is full writing {path} ({reason}; the filesystem at {mount} has {free} bytes free): free "
            f"space there or point --output_dir elsewhere; the last complete checkpoint{_last_complete(path)} is "
            "kept.")


def _disk_full(chain: list[BaseException]) -> tuple[str, str | None] | None:
    """``(reason, path or None)`` when an error of `chain` says the disk is full: an `OSError` ENOSPC / EDQUOT, a
    library's error quoting it, or torch's writer failing (it drops the errno) on a filesystem left (nearly) full."""
    for link in chain:
        text = str(link).lower()
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return link.strerror or os.strerror(link.errno), link.filename
        if any(sign in text for sign in _DISK_FULL):
            return ("Disk quota exceeded" if "quota" in text else "No space left on device"), None
        if isinstance(link, RuntimeError) and any(sign in text for sign in _WRITE_FAILED):
            path = _path_written(chain)
            if path is not None and _nearly_full(path):
                return "No space left on device", path
    return None


def _nearly_full(path: str) -> bool:
    usage = shutil.disk_usage(_filesystem(os.path.abspath(path))[1])
    return usage.free < max(1 << 20, usage.total // 1000)


def _chain(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _path_written(chain: list[BaseException]) -> str | None:
    """The path a failed write was writing, from the innermost frame of the traceback that names one."""
    for error in chain:
        frames, tb = [], error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            for name in _PATH_NAMES:
                value = frame.f_locals.get(name)
                if isinstance(value, str | os.PathLike) and os.path.isdir(os.path.dirname(os.path.abspath(value))):
                    return os.fspath(value)
    return None


def _filesystem(path: str) -> tuple[str, str]:
    """``(mount point, nearest existing directory)`` of `path`."""
    existing = path
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    mount = existing
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return mount, existing


def _last_complete(path: str) -> str:
    """`` (checkpoint-N)``: the newest complete checkpoint beside the `checkpoint-N` that `path` is in, if any."""
    from ..runtime.checkpoints import is_complete

    parts = path.split(os.sep)
    inside = [i for i, part in enumerate(parts) if re.fullmatch(r"checkpoint-\d+", part)]
    if not inside:
        return ""
    output_dir = os.sep.join(parts[: inside[-1]]) or os.sep
    names = sorted((name for name in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", name)),
                   key=lambda name: int(name.split("-")[1]), reverse=True)
    newest = next((name for name in names if is_complete(os.path.join(output_dir, name))), None)
    return f" ({newest})" if newest else ""


def _note_failure() -> None:
    if "torch.distributed" in sys.modules:  # a group may exist: leave it at exit without waiting for peers
        from ..runtime.distributed import note_failure

        note_failure()


def _peer_failure(error: BaseException):
    if "torch.distributed" not in sys.modules:
        return None
    from ..runtime.distributed import peer_failure

    return peer_failure(error)


def _exit_with(prog: str, error: BaseException, status: int) -> None:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    stderr_line(f"{prog}: error: {message}")
    sys.exit(status)
