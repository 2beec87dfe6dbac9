"""The project's error type for "the world is wrong": a file, a server, a disk, the data or a peer, never our code.

`trl-distill` turns an `ExternalError` raised at any time, set-up or training, into one line on stderr on every rank
(`cli.errors`), with the last complete checkpoint kept; any other exception is our bug and keeps its traceback.
Library users catch it the same way: ``except trl_distill.errors.ExternalError``.
"""

from __future__ import annotations


class ExternalError(Exception):
    """Something outside trl_distill is wrong; the message is one line that names it and the fix."""


class PeerLostError(ExternalError):
    """Another process of the run stopped answering (a collective timed out: frozen, killed, far slower) or went
    away (its connection closed): this rank cannot go on without it. Its own message says why it stopped."""


def stderr_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write: the ranks of a run share one stderr, and `print` writes
    the text and the newline separately, so two ranks' lines could run together (a pipe keeps one write of up to
    4096 bytes whole)."""
    import sys

    sys.stderr.flush()
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
