"""`make experiment-multi` (benchmarks/quality/multi_teacher_kd.py): the second task, the union of both, and the
comparisons the report makes."""

import re
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).parent.parent / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))
sys.path.insert(0, str(QUALITY.parent))

import arithmetic_task  # noqa: E402
from multi_teacher_kd import README_END, README_START, TASKS  # noqa: E402
from multi_teacher_report import METHODS, markdown, summarize  # noqa: E402

from trl_distill.evaluation.verifiers import resolve_verifiers  # noqa: E402


def test_every_column_of_a_worked_addition_is_right_and_last_number_accepts_it():
    (verifier,) = resolve_verifiers(["last_number"], "answer", None)
    split = arithmetic_task.splits(train=300, test=40, task="addition")
    for row in split["train"] + split["test"]:
        a, b = map(int, re.fullmatch(r"(\d{5})\+(\d{5})=", row["prompt"]).groups())
        columns = re.findall(r" (\d)\+(\d)(?:\+(1))?=(\d+)", row["completion"])
        assert len(columns) == 5 and row["answer"] == str(a + b) and row["completion"].endswith(f" so {a + b}")
        carry = 0
        for i, (x, y, c, total) in enumerate(columns):  # units first; a carry is written only when there is one
            assert (int(x), int(y)) == (a // 10**i % 10, b // 10**i % 10) and int(c or 0) == carry
            assert int(total) == int(x) + int(y) + carry
            carry = int(total) // 10
    assert verifier.score([r["prompt"] for r in split["test"]], [r["completion"] for r in split["test"]],
                          {"answer": [r["answer"] for r in split["test"]]}) == [1.0] * 40
    assert not {r["prompt"] for r in split["test"]} & {r["prompt"] for r in split["train"]}


def test_the_union_interleaves_the_tasks_and_names_each_rows_teacher():
    union = arithmetic_task.union(TASKS, train=50, test=10)
    assert [r["teacher"] for r in union["test"]] == ["mul", "add"] * 10
    assert all(("*" in r["prompt"]) == (r["teacher"] == "mul") for r in union["train"] + union["test"])
    alone = arithmetic_task.splits(train=50, test=10, task="addition")  # each task's rows are its own splits'
    assert [r["prompt"] for r in union["train"] if r["teacher"] == "add"] == [r["prompt"] for r in alone["train"]]
    assert not {r["prompt"] for r in union["test"]} & {r["prompt"] for r in union["train"]}


def run(method: str, seed: int, mul: str, add: str) -> dict:
    passed = mul + add
    return {"method": method, "seed": seed, "passed": passed, "pass@1": passed.count("1") / len(passed),
            "tasks": {"mul": {"pass@1": mul.count("1") / len(mul), "teacher_nll": 0.5},
                      "add": {"pass@1": add.count("1") / len(add), "teacher_nll": 0.25}},
            "curve": [[0, 0.0], [10, 0.5]], "seconds": 10.0}


def test_the_summary_counts_the_seeds_a_two_teacher_student_beats_both_on_the_union():
    outcomes = {"sft": ("0000", "0000"), "mul only": ("1100", "0000"), "add only": ("0000", "1110"),
                "both routed": ("1100", "1100"), "both mixed": ("1000", "1000")}
    runs = [run(m, s, *o) for m, o in outcomes.items() for s in (1, 2)]
    report = {"plan": {"seeds": [1, 2], "test_rows": 4, "teacher_steps": 5, "teacher_batch": 2, "warm_steps": 3,
                       "steps": 4, "batch": 2, "curve_prompts": 8, "eval_every": 2},
              "tasks": TASKS, "runs": runs, "seconds": 60.0, "machine": {"cpus": 2, "torch": "2", "date": "d"},
              "teachers": {t: {"tasks": {"mul": {"pass@1": 1.0}, "add": {"pass@1": 0.0}}} for t in TASKS},
              "warm": [{"seed": s, "tasks": {"mul": {"pass@1": 0.25}, "add": {"pass@1": 0.25}}} for s in (1, 2)]}
    summary = report["summary"] = summarize(report)
    routed = summary["both routed"]
    # routed 4/8 vs mul-only 2/8 and add-only 3/8: paired differences (+1 on two prompts) and (+1, -1 +1 ...)
    assert routed["mul only"]["deltas"] == [pytest.approx(0.25)] * 2 and routed["beats_both"] == 2
    assert routed["add only"]["deltas"] == [pytest.approx(0.125)] * 2 and routed["add only"]["ahead"] == 2
    assert summary["both mixed"]["beats_both"] == 0 and "beats_both" not in summary["sft"]
    assert summary["add only"]["tasks"] == {"mul": 0.0, "add": 0.75} and summary["sft"]["area"] == 0.25
    table = markdown(report)
    assert all(f"| {m} |" in table for m in METHODS)
    assert "| both routed | 50.0, 50.0 | 50.0 | 50.0 | 50.0 | +25.0 pts" in table
    page = (QUALITY.parents[1] / "docs" / "benchmarks.md").read_text()
    assert page.count(README_START) == 1 and page.count(README_END) == 1
