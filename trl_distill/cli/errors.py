"""The command line's one error boundary: bad input found while parsing and setting up is one line, never a
traceback; anything raised once the work has started keeps its traceback."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def errors_as_messages(prog: str = "trl-distill"):
    """Turn `ValueError`, `TypeError` and `OSError` (missing files, unreadable configs) raised in the block into
    ``PROG: error: <first line>`` on stderr and exit status 2. Wrap argument parsing and set-up only."""
    try:
        yield
    except (ValueError, TypeError, OSError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
