"""The command line's error boundaries: bad input found while parsing and setting up is one line, never a traceback
(`errors_as_messages`), and so is an expected fault at any later time (`faults_as_messages`: an
`errors.ExternalError`, a full disk); anything else raised once the work has started is our bug and keeps its
traceback."""

from __future__ import annotations

import contextlib
import errno
import sys

from ..errors import ExternalError


@contextlib.contextmanager
def errors_as_messages(prog: str = "trl-distill"):
    """Turn `ValueError`, `TypeError`, `OSError` (missing files, unreadable configs) and `ExternalError` raised in the
    block into ``PROG: error: <first line>`` on stderr and exit status 2. Wrap argument parsing and set-up only."""
    try:
        yield
    except (ValueError, TypeError, OSError, ExternalError) as error:
        _exit_with(prog, error, 2)


@contextlib.contextmanager
def faults_as_messages(prog: str = "trl-distill"):
    """Around the work itself (training, saving, writing a cache): an `ExternalError`, or a disk that is full or
    over quota, is ``PROG: error: <first line>`` on stderr of the rank that met it and exit status 1; every other
    exception keeps its traceback. Nothing is cleaned up here: checkpoints are marked complete only once whole
    (`runtime.checkpoints`), so the last complete one is what a resume finds."""
    try:
        yield
    except ExternalError as error:
        _exit_with(prog, error, 1)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {error.filename}" if error.filename else ""
        print(f"{prog}: error: the disk is full{where} ({error.strerror}): free space there or point --output_dir "
              "elsewhere; the last complete checkpoint is kept.", file=sys.stderr)
        sys.exit(1)


def _exit_with(prog: str, error: BaseException, status: int) -> None:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(status)
