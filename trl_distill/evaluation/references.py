"""The references a verifier or task reward compares with, checked by their values before anything trains.

A loader fills a column that one split (or file) lacks with nulls when another has it: an eval file without the
``answer`` column beside a train file with one reads as an ``answer`` column of None. A function compared with such
a column scores nothing right, in silence (``eval_pass@1 0``). Its reference columns are a built-in's answer column
and the columns a user function names as parameters (TRL's ``def accuracy(completions, solution, **kwargs)``). Null
in every row: refused in one line naming the rows' file (or split) and the column; null in some: one warning with
the count.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import TYPE_CHECKING

from .calls import CALL_NAMES, Verifier

if TYPE_CHECKING:
    from ..run_plan import EvaluationPlan, TaskRewardPlan

logger = logging.getLogger("trl_distill")


def referenced_columns(verifier: Verifier, names: list[str]) -> list[str]:
    """The columns among `names` that `verifier` compares with."""
    if verifier.answer is not None:
        return [verifier.answer] if verifier.answer in names else []
    try:
        parameters = inspect.signature(verifier.function).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in named and p.name in names and p.name not in CALL_NAMES]


def null_count(dataset, column: str, rows: int) -> int:
    """How many of the first `rows` rows of `dataset` hold None in `column`, or NaN (a CSV's empty number), read as
    Arrow, not row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.select_columns([column]).with_format("arrow")[:rows][column]
    nan = pc.sum(pc.is_nan(values)).as_py() if pa.types.is_floating(values.type) else 0
    return values.null_count + (nan or 0)


def check_references(verifiers: list[Verifier], dataset, where: str, rows: int | None = None,
                     warn: bool = True) -> None:
    """`verifiers`' reference columns in the first `rows` rows (default: all) of `dataset`, named `where` (e.g.
    ``"the eval split"``, a file): all null is one line; some null a warning (with `warn`)."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "select_columns") or not verifiers:
        return  # (a streamed dataset is not read ahead)
    names, total = dataset.column_names, len(dataset) if rows is None else min(rows, len(dataset))
    if not total:
        return
    checked = {}
    for verifier in verifiers:
        for column in referenced_columns(verifier, names):
            checked.setdefault(column, []).append(verifier)
    for column, users in checked.items():
        nulls = null_count(dataset, column, total)
        flag, listed = users[0].flag, ", ".join(v.name for v in users)
        compare = f"--{flag}: {listed} compare{'s' if len(users) == 1 else ''} with the {column!r} column"
        if nulls == total:
            fix = ("name the column that holds them with --eval_answer_column" if users[0].answer is not None
                   else f"drop {users[0].name} from --{flag}")
            raise ValueError(f"{compare}, which is null in all {total} rows of {where} (a loader fills in a column "
                             f"that another split or file has): nothing could be judged. Add the values there, or "
                             f"{fix}.")
        if nulls and warn:
            logger.warning("trl_distill: %s, which is null in %d of the %d rows of %s: those rows' completions have "
                           "no reference and score None.", compare, nulls, total, where)


def split_source(name: str, split: str) -> str:
    """The file(s) the split `split` of ``--dataset_name name`` was read from, as a user names them: the data files
    of a directory (as `datasets` assigns them to splits), a saved dataset's split directory, else the name."""
    label = f"the {split!r} split of --dataset_name {name}"
    if os.path.isfile(name):
        return f"{name} ({label})"
    if os.path.isdir(name) and os.path.isdir(os.path.join(name, split)) and \
            os.path.exists(os.path.join(name, split, "state.json")):
        return f"{os.path.join(name, split)} ({label})"
    if os.path.isdir(name):
        try:
            from datasets.data_files import DataFilesDict, get_data_patterns

            files = DataFilesDict.from_patterns(get_data_patterns(name), base_path=name).get(split)
        except Exception:  # noqa: BLE001 - a layout datasets does not infer: the split's name is enough
            files = None
        if files:
            return f"{', '.join(map(str, files))} ({label})"
    return label


def check_loaded_references(evaluation: EvaluationPlan, task_rewards: TaskRewardPlan, name: str,
                            splits: dict) -> None:
    """The command line, as a dataset is loaded (`splits`: split name -> rows or None): each function's references
    in the split it reads (the plan's `evaluation` verifiers: the eval split; its `task_rewards`: the train split),
    all null refused naming the file. (The trainer checks again, naming the split, and warns about a few nulls.)"""
    from .verifiers import answer_column, resolve_verifiers

    wanted = {"eval": ("eval_reward_funcs", evaluation), "train": ("task_reward_funcs", task_rewards)}
    for role, (split, rows) in splits.items():
        flag, plan = wanted[role]
        specs = list(plan.reward_funcs if role == "eval" else plan.funcs)
        if not specs or rows is None or not hasattr(rows, "column_names"):
            continue
        try:
            column = answer_column(specs, plan.answer_column, rows.column_names, "")
        except ValueError:
            continue  # no answer column at all: the trainer says so, with its fix
        verifiers = resolve_verifiers(specs, column or "answer", plan.answer_pattern, flag)
        limit = evaluation.max_prompts if role == "eval" else None
        check_references(verifiers, rows, split_source(name, split), limit, warn=False)
