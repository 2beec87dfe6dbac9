"""Verifiers: functions that score a student's generated completions, with TRL's reward-function signature
``(prompts, completions, **columns) -> list[float | None]`` (the eval row's dataset columns as keyword arguments),
so a GRPO user's reward functions work unchanged.

Built-ins, by name:

- ``exact_match``: 1.0 when the completion's text, stripped, equals the answer column's value, stripped;
- ``regex_match``: 1.0 when the first match of `eval_answer_pattern` in the completion (its first group, if it has
  one) equals the answer, both stripped;
- ``last_number``: 1.0 when the last number in the completion equals the answer's number (``1,234`` reads 1234).

Any other name is a user function: ``module:function``, or TRL's dotted path ``module.function`` (imported with
the working directory on ``sys.path``, as TRL's GRPO script does). A score of None leaves that completion out of
the verifier's mean (TRL's convention).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable

from .calls import Verifier, first_line, text_of

BUILT_INS = ("exact_match", "regex_match", "last_number")
ANSWER_COLUMNS = ("answer", "solution")  # the built-ins' answer column when `eval_answer_column` is not set
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def find_last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators dropped), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _answers(columns: dict, answer_column: str, n: int) -> list:
    if answer_column not in columns:
        raise ValueError(f"no {answer_column!r} column")
    values = list(columns[answer_column])
    if len(values) != n:
        raise ValueError(f"{len(values)} answers for {n} completions")
    return values


def missing(answer) -> bool:
    """Whether an answer is absent: None (a null the loader filled in), or NaN (a CSV's empty number)."""
    return answer is None or isinstance(answer, float) and math.isnan(answer)


def answer_text(answer) -> str:
    """An answer as the text a completion must hold, stripped: a whole number read as a float (a JSON or CSV column
    of numbers that also holds a fraction is all floats: ``3`` is loaded as 3.0) written as the integer (``"3"``, not
    ``"3.0"``, which no completion ``3`` equals)."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def exact_match(answer_column: str) -> Callable:
    def exact_match(prompts, completions, **columns) -> list[float]:
        answers = _answers(columns, answer_column, len(completions))
        return [None if missing(a) else float(text_of(c).strip() == answer_text(a))
                for c, a in zip(completions, answers, strict=True)]

    return exact_match


def regex_match(answer_column: str, pattern: str, flag: str = "eval_reward_funcs") -> Callable:
    try:
        compiled = re.compile(pattern)
    except re.error as error:  # (not a ValueError: it would be a traceback)
        raise ValueError(f"--eval_answer_pattern {pattern!r} is not a regular expression ({error}), and regex_match "
                         f"in --{flag} extracts the answer with it: fix it, e.g. '####\\s*(\\S+)'.") from None

    def regex_match(prompts, completions, **columns) -> list[float]:
        answers = _answers(columns, answer_column, len(completions))
        scores = []
        for completion, answer in zip(completions, answers, strict=True):
            if missing(answer):  # no reference: not judged (a null in the answer column)
                scores.append(None)
                continue
            found = compiled.search(text_of(completion))
            extracted = None if found is None else (found.group(1) if compiled.groups else found.group(0))
            scores.append(float(extracted is not None and extracted.strip() == answer_text(answer)))
        return scores

    return regex_match


def last_number_match(answer_column: str) -> Callable:
    def last_number(prompts, completions, **columns) -> list[float]:
        answers = _answers(columns, answer_column, len(completions))
        scores = []
        for completion, answer in zip(completions, answers, strict=True):
            if missing(answer):
                scores.append(None)
                continue
            got = find_last_number(text_of(completion))
            want = answer if isinstance(answer, int | float) else find_last_number(str(answer))
            scores.append(float(got is not None and want is not None and math.isclose(got, float(want), abs_tol=1e-9)))
        return scores

    return last_number


def load_function(path: str, flag: str = "eval_reward_funcs") -> Callable:
    """A user function from ``module:function`` or ``module.function``: one clear error naming `flag` (the setting
    that named it) when it cannot be had."""
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attribute:
        kind = "task reward" if flag == "task_reward_funcs" else "verifier"
        raise ValueError(f"Unknown {kind} {path!r} in --{flag}: use a built-in ({', '.join(BUILT_INS)}) "
                         "or a function as module:function (or TRL's module.function).")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        kind = "task reward" if flag == "task_reward_funcs" else "verifier"
        stem = os.path.splitext(os.path.basename(module_name))[0] or "module"
        if module_name.endswith(".py"):  # a file, which `import` cannot name (and would half-import)
            raise ValueError(f"--{flag} {path!r} names a file: name its module, as {stem}:{attribute}, with "
                             f"{os.path.basename(module_name)} in the working directory (or its directory on "
                             "PYTHONPATH).")
        raise ValueError(f"--{flag} {path!r} is a path, not a {kind}: give a Python function as module:function "
                         f"(e.g. my_rewards:accuracy); a reward model, which TRL's reward_funcs may name, is not one "
                         "here.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module beside the script, as TRL's GRPO script finds it
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - any failure of the user's module is the user's, in one
        # line; SystemExit too: a module that is also a script (argparse reading our command line as it imports)
        why = first_line(error)
        if isinstance(error, SystemExit):
            why = (f"SystemExit: {error.code} (the module exits as it is imported: keep a script's argument parsing "
                   "under `if __name__ == \"__main__\":`)")
        raise ValueError(f"--{flag}: cannot import {module_name!r} for {path!r}: {why}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"--{flag}: {module_name!r} has no function {attribute!r} (from {path!r}).")
    return function


def verifier_name(spec: str) -> str:
    """The name a verifier's metrics are logged under: a built-in's name, a function's last part."""
    return spec if spec in BUILT_INS else re.split(r"[:.]", spec)[-1]


def resolve_verifiers(specs: list[str], answer_column: str, pattern: str | None,
                      flag: str = "eval_reward_funcs") -> list[Verifier]:
    """The functions `flag` (``eval_reward_funcs`` or ``task_reward_funcs``) names, in order (the first verifier
    decides pass@k)."""
    verifiers = []
    for spec in specs:
        answer = answer_column if spec in BUILT_INS else None
        if spec == "exact_match":
            function = exact_match(answer_column)
        elif spec == "regex_match":
            if not pattern:
                raise ValueError("The regex_match verifier needs eval_answer_pattern (a regular expression; its "
                                 f"first group, if any, is the answer) in --{flag}, e.g. --eval_answer_pattern "
                                 "'####\\s*(\\S+)'.")
            function = regex_match(answer_column, pattern, flag)
        elif spec == "last_number":
            function = last_number_match(answer_column)
        else:
            function = load_function(spec, flag)
        verifiers.append(Verifier(verifier_name(spec), function, flag, answer))
    names = [v.name for v in verifiers]
    if len(set(names)) != len(names):
        raise ValueError(f"--{flag} names two functions alike ({', '.join(names)}): each is logged under its name; "
                         "list each once.")
    return verifiers


def as_names(value) -> tuple[str, ...]:
    """The functions a `*_reward_funcs` field names: a list of them, one given as a string (a recipe, the API), or
    None (none)."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def uses_answer_column(specs: list[str]) -> bool:
    return any(spec in BUILT_INS for spec in specs)


def answer_column(specs: list[str], given: str | None, names: list[str], what: str) -> str | None:
    """The column the built-in verifiers among `specs` compare with: `given`, else the first of `ANSWER_COLUMNS` in
    `names` (None when no built-in is used); one line when `what` (e.g. "eval_reward_funcs ... the eval split") has
    none."""
    if not uses_answer_column(specs):
        return given
    column = given or next((c for c in ANSWER_COLUMNS if c in names), None)
    if column is None or column not in names:
        wanted = repr(column) if column else " or ".join(map(repr, ANSWER_COLUMNS))
        raise ValueError(f"The built-in verifiers of {what} has no {wanted} column (it has: {', '.join(names)}): add "
                         "one, or name it with --eval_answer_column.")
    return column
