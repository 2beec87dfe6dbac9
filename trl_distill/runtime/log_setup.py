"""One logging set-up for the `trl_distill` loggers, following the HF Trainer's `log_level` / `log_level_replica`:
the main process says what it does (INFO, unless `log_level` says otherwise), the other ranks stay quiet (WARNING,
unless `log_level_replica` says otherwise).

The records go to stderr through one handler of ours, in the form ``trl_distill: <message>``, unless the process
already routes logging somewhere (a handler on the root logger: the user's `logging.basicConfig`, pytest's capture),
where they propagate instead, so no line is printed twice. A level the user set on the `trl_distill` logger
themselves is kept.
"""

from __future__ import annotations

import logging
import sys

ROOT = "trl_distill"
_OURS = "_trl_distill_handler"  # marks our handler, so a second trainer in the process does not add another


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if message.startswith(f"{ROOT}:") else f"{ROOT}: {message}"


def process_log_level(args) -> int:
    """This process's level: `log_level` on the main process (``passive``: INFO), `log_level_replica` on the others
    (``passive``: WARNING), as `TrainingArguments.get_process_log_level` picks between them."""
    main = _level(args.log_level, logging.INFO)
    replica = _level(args.log_level_replica, logging.WARNING)
    return main if args.should_log else replica


def _level(name: str, passive: int) -> int:
    """A `TrainingArguments` log level name (``debug`` ... ``critical``) as a number; ``passive``: `passive`."""
    level = logging.getLevelName(str(name).upper())  # (a number for a known name)
    return level if isinstance(level, int) else passive


def setup_logging(args) -> None:
    """Set the `trl_distill` logger's level for this process and give it a stderr handler when nothing else would
    show its records (idempotent: a later trainer updates the level)."""
    logger = logging.getLogger(ROOT)
    level = process_log_level(args)
    if logger.level == logging.NOTSET or logger.level == getattr(logger, "_trl_distill_level", None):
        logger.setLevel(level)  # (a level the user or a test set on this logger is theirs)
        logger._trl_distill_level = level
    if not any(getattr(h, _OURS, False) for h in logger.handlers) and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Format("%(message)s"))
        setattr(handler, _OURS, True)
        logger.addHandler(handler)
