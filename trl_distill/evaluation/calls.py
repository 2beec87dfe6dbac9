"""Calling a user's reward function as TRL's GRPOTrainer calls it, and its faults as one line.

TRL hands a reward function plain lists: ``prompts``, ``completions``, ``completion_ids`` and every other dataset
column by name, one entry per completion, the Trainer's ``trainer_state``, and ``log_metric`` / ``log_extra``
(`GRPOTrainer._calculate_rewards`). A verifier (`eval_reward_funcs`) and a task reward (`task_reward_funcs`) get the
same, whatever the caller held (a `datasets.Column`, a tuple): ``log_metric(name, value)`` is logged as TRL logs it
(`RewardLogs`); ``log_extra`` is taken and dropped (there is no completions table here). A score is what TRL's
``torch.tensor(scores, dtype=torch.float32)`` takes as one number: a float, an int, a bool (1.0 / 0.0), a numpy or
one-element torch scalar; None leaves the completion out. What the function does wrong is a `RewardFunctionError` of
one line naming it, its flag, when it ran and, where one row is to blame, that row's completion (shortened), or, when
its parameters cannot take those arguments, what it is called with: at set-up `trl-distill` prints it and exits 2,
during training 1 (`cli.errors`), the last complete checkpoint kept.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ExternalError

# Keyword names TRL's reward call fills itself: a dataset column of one of these names is not passed again
CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
# What SFT's preparation adds to a row (what its collators read): not the row's own columns a reward gets
MODEL_COLUMNS = frozenset({"input_ids", "attention_mask", "labels", "completion_mask", "assistant_masks",
                           "position_ids", "seq_lengths", "token_type_ids"})
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


def as_written(columns: dict, eos: str | None) -> dict:
    """Rows' columns (name -> list) as the dataset holds them, as TRL hands them to a reward: without the EOS text
    SFT appends to each `completion` (and `text`) string of rows that are not conversations (a function comparing
    with the reference ``completion`` would find ``' 3</s>'``), and without what SFT's preparation adds
    (`MODEL_COLUMNS`: ``input_ids``, ``labels``, ...)."""
    def unended(value):
        return value[: -len(eos)] if isinstance(value, str) and eos and value.endswith(eos) else value

    return {name: [unended(v) for v in values] if name in ("completion", "text") else values
            for name, values in columns.items() if name not in MODEL_COLUMNS}


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def score_value(score) -> float | None | bool:
    """One score as TRL's GRPOTrainer reads it (``torch.tensor(scores, dtype=torch.float32)``): a float for what that
    takes as one number (a float, an int, a bool as 1.0 / 0.0, a numpy scalar, a one-element tensor), None for None,
    False for what it refuses (a string, a complex, a list, an array or tensor of several values). Kept in float64
    (a finite score TRL's float32 would round is not refused here)."""
    if score is None:
        return None
    if isinstance(score, float):
        return score
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # (torch's on a list of numpy arrays: slow, refused below anyway)
            warnings.simplefilter("ignore")
            value = torch.tensor([score], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return False
    return float(value[0]) if value.shape == (1,) else False


def shortened_repr(value, width: int = 40) -> str:
    """`value`'s repr on one line (an array's rows joined), cut to `width` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 1] + "…"


class RewardLogs:
    """What reward functions log through TRL's ``log_metric(name, value)`` (a scalar per call, averaged over the
    calls of every rank since the last log, under its own name as TRL logs it) and ``log_extra(column, values)``
    (TRL's completions table, which this trainer does not keep: taken and dropped, so a reward that logs runs)."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        del column, values  # no completions table to add a column to

    def kwargs(self) -> dict:
        """The keyword arguments a reward function gets for logging."""
        return {"log_metric": self.log_metric, "log_extra": self.log_extra}

    def take(self, taken: dict, gather_names: Callable | None = None, reduce: Callable | None = None) -> None:
        """Add each metric's mean since the last take to `taken` (collective with several ranks: `gather_names`
        gathers every rank's names as one list, `reduce` sums a tensor over ranks), under its name (beside a key
        `taken` has already: ``log_metric/NAME``); then start over."""
        import torch

        names = sorted(set(gather_names(list(self.metrics)) if gather_names is not None else self.metrics))
        if names:
            local = torch.tensor([[sum(self.metrics.get(n, ())), len(self.metrics.get(n, ()))] for n in names],
                                 dtype=torch.float64)
            totals = reduce(local) if reduce is not None else local
            for name, (total, count) in zip(names, totals.tolist(), strict=True):
                if count:
                    taken[f"log_metric/{name}" if name in taken else name] = total / count
        self.metrics.clear()


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
            scores = self.call(prompts, completions, columns, extra)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - a user function that raises (or calls sys.exit):
            # its name and the error, one line
            self._check_signature(columns, extra, at, fix)
            row = self._blame(prompts, completions, columns, extra)
            on = "" if row is None else f" on the completion {shortened(completions[row])}"
            raise RewardFunctionError(f"{self.label} raised {first_line(error)}{on}{at}: it must score any text the "
                                      f"student may write.{fix}") from None
        try:  # (any sequence TRL iterates: a list, a tuple, an array, a tensor, a generator)
            listed = None if isinstance(scores, str | bytes | dict) or not isinstance(scores, Iterable) \
                else plain(scores)
        except Exception:  # noqa: BLE001 - e.g. a 0-d tensor or array, which cannot be iterated
            listed = None
        if listed is None:
            raise RewardFunctionError(f"{self.label} returned {type(scores).__name__}{at}: it must return a list of "
                                      f"floats (or None), one per completion.{fix}")
        scores = listed
        if len(scores) != len(completions):
            raise RewardFunctionError(f"{self.label} returned {len(scores)} scores for {len(completions)} completions"
                                      f"{at}: it must return one per completion.{fix}")
        out = []
        for completion, score in zip(completions, scores, strict=True):
            value = score_value(score)
            if value is False or value is not None and not math.isfinite(value):
                what = shortened_repr(score) if value is False else f"{value:g}"
                raise RewardFunctionError(f"{self.label} returned {what} for the completion {shortened(completion)}"
                                          f"{at}: scores must be numbers and finite (None leaves a completion "
                                          f"out).{fix}")
            out.append(value)
        return out

    def call(self, prompts: list, completions: list, columns: dict, extra: dict):
        """The function's return for these arguments, each list its own copy (a function that edits its arguments in
        place, as ``completions[i] = c.strip()``, changes neither the next function's nor the counts checked here);
        an ``async def`` function (TRL's GRPOTrainer awaits those) awaited, in a thread of its own (a caller's
        running event loop, as a notebook's, is left alone)."""
        def own(values):
            return list(values) if isinstance(values, list) else values

        scores = self.function(prompts=own(prompts), completions=own(completions),
                               **{k: own(v) for k, v in columns.items()}, **{k: own(v) for k, v in extra.items()})
        if inspect.isawaitable(scores):
            import asyncio
            from concurrent.futures import ThreadPoolExecutor

            async def awaited(awaitable=scores):
                return await awaitable

            with ThreadPoolExecutor(1) as thread:
                scores = thread.submit(asyncio.run, awaited()).result()
        return scores

    def _check_signature(self, columns: dict, extra: dict, at: str, fix: str) -> None:
        """When the call raised: one line if the function's parameters cannot take what TRL passes a reward
        function (a missing ``**kwargs``, a parameter no column fills), not the `TypeError` blamed on a completion."""
        try:
            signature = inspect.signature(self.function)
        except (TypeError, ValueError):  # a callable without a signature Python can read
            return
        passed = dict.fromkeys(("prompts", "completions", *columns, *extra))
        try:
            signature.bind(**passed)
        except TypeError as error:
            why = str(error)
            if "unexpected keyword" in why:
                hint = "take those it does not read with **kwargs, as TRL's reward functions do"
            elif "missing" in why:
                hint = "name a column the rows have, or give the parameter a default"
            else:
                hint = "take them by keyword"
            names = ", ".join(("prompts", "completions", *extra))
            raise RewardFunctionError(f"{self.label} cannot take the arguments of a reward function ({why}){at}: it "
                                      f"is called with {names} and each column of the rows by name "
                                      f"({', '.join(columns) or 'none'}); {hint}.{fix}") from None

    def _blame(self, prompts: list, completions: list, columns: dict, extra: dict) -> int | None:
        """The first row the function raises on when called alone (None: none does; it fails on the batch)."""
        n = len(completions)
        for row in range(n):
            def one(values, row=row):
                return values[row: row + 1] if isinstance(values, list) and len(values) == n else values

            try:
                self.call(one(prompts), one(completions), {k: one(v) for k, v in columns.items()},
                          {k: one(v) for k, v in extra.items()})
            except (Exception, SystemExit):  # noqa: BLE001 - found the row
                return row
        return None
