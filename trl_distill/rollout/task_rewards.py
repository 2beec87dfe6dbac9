"""The task reward of the student's own samples (`task_reward_funcs`, the sampled-token objective): each train row's
columns travel with its batch (`TaskColumnsCollator`), and the reward functions score each sampled completion with
them, as TRL's GRPO calls its reward functions (``prompts``, ``completions``, every other column by name,
``completion_ids``, ``trainer_state``, ``log_metric`` and ``log_extra``: `evaluation.calls`). Before anything trains,
each function is tried on the first train rows, their reference completions standing in for the student's samples
(`check_task_rewards`): one that cannot be called so, raises or returns no score per completion is one line then, not
at step 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data.batch import add_extras
from ..evaluation.calls import MODEL_COLUMNS, RewardLogs, as_written, plain
from ..evaluation.generation import before_first_answer, gather_object, reference_completions
from ..evaluation.references import check_references
from ..evaluation.verifiers import answer_column, resolve_verifiers

if TYPE_CHECKING:
    from ..run_plan import TaskRewardPlan


class TaskColumnsCollator:
    """Wraps the trainer's collator: takes the rows' own columns (`names`) off each example and adds them to the
    batch's extras as lists (`task_columns`)."""

    def __init__(self, collator, names: list[str]):
        self.collator, self.names = collator, names

    def __call__(self, examples: list[dict]) -> dict:
        columns = {name: [example.get(name) for example in examples] for name in self.names}
        batch = self.collator([{k: v for k, v in example.items() if k not in self.names} for example in examples])
        add_extras(batch, task_columns=columns)
        return batch


def row_columns(dataset, teacher_columns) -> list[str]:
    """The prepared train dataset's columns that are the rows' own (not what a collator reads)."""
    return [name for name in dataset.column_names if name not in MODEL_COLUMNS | set(teacher_columns)]


def task_verifiers(plan: TaskRewardPlan, columns: list[str]) -> list:
    """The functions `task_reward_funcs` names, the built-ins comparing with the train dataset's answer column."""
    funcs = list(plan.funcs)
    column = answer_column(funcs, plan.answer_column, columns,
                           "task_reward_funcs compare with an answer column, and the train dataset")
    return resolve_verifiers(funcs, column or "answer", plan.answer_pattern, "task_reward_funcs")


def reward_columns(plan: TaskRewardPlan, dataset, teacher_columns, warn: bool = True) -> list[str] | None:
    """The train rows' own columns the reward functions get, their references checked (`evaluation.references`;
    `warn`: this process says what it found); None without a task reward."""
    if not plan.funcs:
        return None
    columns = row_columns(dataset, teacher_columns)
    check_references(task_verifiers(plan, columns), dataset, "the train dataset", warn=warn)
    return columns


def reward_inputs(columns: dict) -> tuple[list | None, bool]:
    """The rows' prompts as a reward function gets them (a conversation's: its turns before the first answer; None
    for rows without any), and whether the rows are conversations, as TRL's GRPOTrainer tells (a ``messages`` row, or
    a prompt that is a list of messages): their completions then reach the functions as one assistant message, as
    TRL's do (``completions[i][0]["content"]``)."""
    prompts = columns.get("prompt")
    if prompts is None and "messages" in columns:
        return [before_first_answer(messages) for messages in columns["messages"]], True
    first = next((p for p in prompts or () if p is not None), None)
    return prompts, isinstance(first, list) and bool(first) and isinstance(first[0], dict) and "role" in first[0]


def check_task_rewards(plan: TaskRewardPlan, dataset, columns: list[str], processing_class, state=None) -> None:
    """Before anything trains (every rank alike): each `task_reward_funcs` function scores the first two prepared
    train rows, called as in training (their prompts, their reference completions standing in for the student's
    samples, the rows' `columns`), so a function with another signature, one that raises on every text or returns no
    score per completion is one line naming it and its flag now, not at step 1. (A streamed dataset is not read
    ahead.)"""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "select") or not len(dataset):
        return
    rows = dataset.select(range(min(2, len(dataset))))
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    values = as_written({name: plain(rows[name]) for name in columns if name in rows.column_names},
                        tokenizer.eos_token)
    prompts, conversational = reward_inputs(values)
    completions, ids = reference_completions(values, len(rows), tokenizer, conversational)
    for verifier in task_verifiers(plan, columns):  # (what they log here is of the references: dropped)
        verifier.score(prompts or [None] * len(rows), completions, values, "on the first rows of the train dataset "
                       "(their reference completions standing in for the student's samples)", completion_ids=ids,
                       trainer_state=state, **RewardLogs().kwargs())


class TaskRewards:
    """`task_reward_funcs` of one run: the reward of each sampled completion, the functions' scores summed (a
    None score counts 0, as TRL sums its rewards); what they log with TRL's ``log_metric``, logged beside."""

    def __init__(self, plan: TaskRewardPlan, tokenizer, columns: list[str]):
        self.verifiers = task_verifiers(plan, columns)
        self.tokenizer = tokenizer
        self.logged = RewardLogs()

    def score(self, columns: dict[str, list], completions: list[torch.Tensor], step: int = 0,
              state=None) -> torch.Tensor:
        """``[B]`` rewards of the sampled `completions` of rows whose own columns are `columns`, at optimizer step
        `step` (the Trainer's `state`: TRL's ``trainer_state``); a function that raises or returns other than a
        finite number (or None) per completion is one line."""
        columns = as_written(columns, self.tokenizer.eos_token)  # (the reference completion without SFT's EOS)
        eos = self.tokenizer.eos_token_id
        ids = [c.tolist() for c in completions]
        texts = [self.tokenizer.decode([t for t in row if t != eos], skip_special_tokens=True) for row in ids]
        prompts, conversational = reward_inputs(columns)
        if conversational:
            texts = [[{"role": "assistant", "content": text}] for text in texts]
        total = torch.zeros(len(completions), dtype=torch.float64)
        for verifier in self.verifiers:
            scores = verifier.score(prompts or [None] * len(texts), texts, columns,
                                    f"at step {step} (on the student's samples)", True, completion_ids=ids,
                                    trainer_state=state, **self.logged.kwargs())
            total += torch.tensor([0.0 if s is None else float(s) for s in scores], dtype=torch.float64)
        return total

    def log_into(self, logs: dict, accelerator, device) -> None:
        """Add the means of what the functions logged (``log_metric``) since the last log, over every rank's calls
        (collective)."""
        if accelerator.num_processes == 1:
            self.logged.take(logs)
            return
        self.logged.take(logs, gather_object,
                         lambda totals: accelerator.reduce(totals.to(device), reduction="sum").cpu())
