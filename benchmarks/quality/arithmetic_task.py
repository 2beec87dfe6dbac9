"""Verifiable tasks with long answers, small enough for a CPU: arithmetic written out step by step.

    python benchmarks/quality/arithmetic_task.py --output_dir DATA [--task multiplication --train 60000 --test 1000]

Each row is a prompt ``"47*86="`` and a completion that works it out, partial product by partial product, then the
running sums, then the answer::

    " 47*6=282 47*80=3760 282+3760=4042 so 4042"

(about 40 characters, one token each with `tokenizer()`). The ``answer`` column holds the product; the built-in
``last_number`` verifier (`--eval_reward_funcs last_number`) checks a completion's last number against it. An early
slip (a wrong partial product) carries into every later number, which is what on-policy distillation claims to
help with: the student learns on the states its own mistakes lead to.

The second task (``--task addition``, for the two-teacher experiment) adds two 5-digit numbers column by column,
carries included::

    " 3+1=4 1+2=3 2+0=2 7+6=13 4+8+1=13 so 133234"

Writes ``train.jsonl`` and ``test.jsonl`` (prompt, completion, answer; the test prompts never appear in train) to
--output_dir, which `trl-distill --dataset_name DATA --dataset_test_split test` reads.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


def multiplication_row(rng: random.Random, digits: int = 2) -> dict:
    """One prompt–completion row: two `digits`-digit numbers, their product worked out."""
    low, high = 10 ** (digits - 1), 10**digits
    a, b = rng.randrange(low, high), rng.randrange(low, high)
    parts = [a * int(d) * 10**i for i, d in enumerate(str(b)[::-1])]
    steps = [f"{a}*{int(d) * 10**i}={p}" for i, (d, p) in enumerate(zip(str(b)[::-1], parts, strict=True))]
    total = parts[0]
    for part in parts[1:]:
        steps.append(f"{total}+{part}={total + part}")
        total += part
    return {"prompt": f"{a}*{b}=", "completion": " " + " ".join(steps) + f" so {a * b}", "answer": str(a * b)}


def addition_row(rng: random.Random, digits: int = 5) -> dict:
    """One prompt–completion row: two `digits`-digit numbers added column by column, from the units, with carries."""
    low, high = 10 ** (digits - 1), 10**digits
    a, b = rng.randrange(low, high), rng.randrange(low, high)
    steps, carry = [], 0
    for x, y in zip(str(a)[::-1], str(b)[::-1], strict=True):
        column = int(x) + int(y) + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={column}")
        carry = column // 10
    return {"prompt": f"{a}+{b}=", "completion": " " + " ".join(steps) + f" so {a + b}", "answer": str(a + b)}


TASKS = {"multiplication": (multiplication_row, 2), "addition": (addition_row, 5)}  # name: (row maker, digits)


def rows(count: int, seed: int, digits: int | None = None, exclude: set[str] | None = None,
         task: str = "multiplication") -> list[dict]:
    """`count` rows of `task` from `seed`; prompts in `exclude` are skipped (so a test split never meets train)."""
    make, default_digits = TASKS[task]
    rng, out = random.Random(seed), []
    while len(out) < count:
        row = make(rng, digits or default_digits)
        if exclude is None or row["prompt"] not in exclude:
            out.append(row)
    return out


def splits(train: int, test: int, digits: int | None = None, seed: int = 0,
           task: str = "multiplication") -> dict[str, list[dict]]:
    """Train and test rows of `task`; the test prompts are distinct and never in train."""
    test_rows, seen = [], set()
    for row in rows(test * 4, seed + 1, digits, task=task):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            test_rows.append(row)
        if len(test_rows) == test:
            break
    return {"train": rows(train, seed, digits, exclude=seen, task=task), "test": test_rows}


def union(tasks: dict[str, str], train: int, test: int, seed: int = 0) -> dict[str, list[dict]]:
    """Several tasks' splits interleaved row by row (so any prefix holds every task equally), each row's name in
    the ``teacher`` column: `tasks` maps that name to a task (``{"mul": "multiplication", "add": "addition"}``);
    each task gets `train` and `test` rows."""
    parts = {name: splits(train, test, seed=seed, task=task) for name, task in tasks.items()}
    return {split: [{**parts[name][split][i], "teacher": name} for i in range(count) for name in tasks]
            for split, count in (("train", train), ("test", test))}


def tokenizer():
    """One token per character: the byte-level tokenizer with no merges (a merge like ``"12"`` would hide digits
    from a small model), trained on nothing but the alphabet."""
    from trl_distill.testing import SPECIAL_TOKENS, build_tokenizer

    return build_tokenizer(vocab_size=256 + len(SPECIAL_TOKENS), corpus=["0123456789+*= so"])


def write(directory: Path, train: int, test: int, digits: int | None = None, task: str = "multiplication",
          split_rows: dict[str, list[dict]] | None = None) -> dict[str, Path]:
    """``train.jsonl`` and ``test.jsonl`` in `directory`: `task`'s splits, or the given `split_rows`."""
    from datasets import Dataset

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, split in (split_rows or splits(train, test, digits, task=task)).items():
        paths[name] = directory / f"{name}.jsonl"
        Dataset.from_list(split).to_json(str(paths[name]))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train", type=int, default=60000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--task", choices=sorted(TASKS), default="multiplication")
    parser.add_argument("--digits", type=int, default=None, help="default: 2 for multiplication, 5 for addition")
    args = parser.parse_args(argv)
    paths = write(Path(args.output_dir), args.train, args.test, args.digits, task=args.task)
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)


if __name__ == "__main__":
    main()
