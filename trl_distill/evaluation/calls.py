"""Calling a user's reward function as TRL's GRPOTrainer calls it, and its faults as one line.

TRL hands a reward function plain lists: ``prompts``, ``completions``, ``completion_ids`` and every other dataset
column by name, one entry per completion, and the Trainer's ``trainer_state`` (`GRPOTrainer._calculate_rewards`). A
verifier (`eval_reward_funcs`) and a task reward (`task_reward_funcs`) get the same, whatever the caller held (a
`datasets.Column`, a tuple). What the
function does wrong is a `RewardFunctionError` of one line naming it, its flag, when it ran and, where one row is to
blame, that row's completion (shortened): at set-up `trl-distill` prints it and exits 2, during training 1
(`cli.errors`), the last complete checkpoint kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ExternalError

# Keyword names TRL's reward call fills itself: a dataset column of one of these names is not passed again
CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state")
KEPT = " The last complete checkpoint is kept: fix the function and resume with --resume_from_checkpoint true."


class RewardFunctionError(ExternalError, ValueError):
    """A user's verifier or task reward raised or returned what is not one score per completion (a fault of the
    user's code: one line, never our traceback)."""


def text_of(completion) -> str:
    """A completion's text: the string itself, or a conversational completion's (TRL's) first message's content."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion if isinstance(message, dict))
    return str(completion)


def shortened(completion, width: int = 40) -> str:
    """A completion quoted on one line: its text, whitespace runs as one space, cut to `width` characters."""
    text = " ".join(text_of(completion).split())
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def plain(values) -> list:
    """`values` as a plain list (a `datasets.Column`, a tuple, a tensor's rows): what TRL's rewards receive."""
    return values if isinstance(values, list) else list(values)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


@dataclass(frozen=True)
class Verifier:
    """One named reward function (`flag`: the setting that named it) and, for a built-in, the column it compares
    with (`answer`)."""

    name: str
    function: Callable
    flag: str = "eval_reward_funcs"
    answer: str | None = None

    @property
    def label(self) -> str:
        kind = "Task reward" if self.flag == "task_reward_funcs" else "Verifier"
        return f"{kind} {self.name!r} (--{self.flag})"

    def score(self, prompts, completions, columns: dict, when: str = "", running: bool = False,
              **extra) -> list[float | None]:
        """Its scores of `completions`, checked: one finite number (or None) per completion, else one line that says
        `when` (e.g. ``"at step 3"``) and, `running` (training has written checkpoints), what was kept."""
        prompts, completions = plain(prompts), plain(completions)
        columns = {k: plain(v) for k, v in columns.items() if k not in CALL_NAMES}
        extra = {k: plain(v) if isinstance(v, list | tuple) else v for k, v in extra.items()}
        at = f" {when}" if when else ""
        fix = KEPT if running else ""
        try:
            scores = self.function(prompts=prompts, completions=completions, **columns, **extra)
        except Exception as error:  # noqa: BLE001 - a user function that raises: its name and the error, one line
            row = self._blame(prompts, completions, columns, extra)
            on = "" if row is None else f" on the completion {shortened(completions[row])}"
            raise RewardFunctionError(f"{self.label} raised {first_line(error)}{on}{at}: it must score any text the "
                                      f"student may write.{fix}") from None
        if scores is None or isinstance(scores, str | bytes | dict) or not hasattr(scores, "__len__"):
            raise RewardFunctionError(f"{self.label} returned {type(scores).__name__}{at}: it must return a list of "
                                      f"floats (or None), one per completion.{fix}")
        scores = plain(scores)
        if len(scores) != len(completions):
            raise RewardFunctionError(f"{self.label} returned {len(scores)} scores for {len(completions)} completions"
                                      f"{at}: it must return one per completion.{fix}")
        out = []
        for completion, score in zip(completions, scores, strict=True):
            value = self._number(score)
            if value is False or value is not None and not math.isfinite(value):
                what = repr(score) if value is False else f"{value:g}"
                raise RewardFunctionError(f"{self.label} returned {what} for the completion {shortened(completion)}"
                                          f"{at}: scores must be numbers and finite (None leaves a completion "
                                          f"out).{fix}")
            out.append(value)
        return out

    @staticmethod
    def _number(score) -> float | None | bool:
        """The score as a float, None for None, False for what is not a number."""
        if score is None:
            return None
        if isinstance(score, bool | str | bytes) or not (isinstance(score, int | float) or hasattr(score, "__float__")):
            return False
        try:
            return float(score)
        except (TypeError, ValueError):  # e.g. a tensor of several values
            return False

    def _blame(self, prompts: list, completions: list, columns: dict, extra: dict) -> int | None:
        """The first row the function raises on when called alone (None: none does; it fails on the batch)."""
        n = len(completions)
        for row in range(n):
            def one(values, row=row):
                return values[row: row + 1] if isinstance(values, list) and len(values) == n else values

            try:
                self.function(prompts=one(prompts), completions=one(completions),
                              **{k: one(v) for k, v in columns.items()}, **{k: one(v) for k, v in extra.items()})
            except Exception:  # noqa: BLE001 - found the row
                return row
        return None
