"""The on-policy experiment's task and arithmetic (benchmarks/quality): every worked row checks out, test prompts
never meet train, one token per character, and the report's comparisons against their formulas."""

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "quality"))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import arithmetic_task  # noqa: E402
import on_policy_report as report  # noqa: E402

from trl_distill.evaluation.verifiers import resolve_verifiers  # noqa: E402


def test_every_step_of_a_worked_row_is_right_and_last_number_accepts_it():
    (verifier,) = resolve_verifiers(["last_number"], "answer", None)
    split = arithmetic_task.splits(train=500, test=50)
    for row in split["train"] + split["test"]:
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", row["prompt"]).groups())
        for left, op, right, result in re.findall(r"(\d+)([*+])(\d+)=(\d+)", row["completion"]):
            assert (int(left) * int(right) if op == "*" else int(left) + int(right)) == int(result), row
        assert row["answer"] == str(a * b) and row["completion"].endswith(f" so {a * b}")
        assert len(row["completion"]) >= 20  # long answers: the working written out
    assert verifier.score([r["prompt"] for r in split["test"]], [r["completion"] for r in split["test"]],
                          {"answer": [r["answer"] for r in split["test"]]}) == [1.0] * 50
    assert not {r["prompt"] for r in split["test"]} & {r["prompt"] for r in split["train"]}
    assert len({r["prompt"] for r in split["test"]}) == 50


def test_the_tokenizer_reads_one_character_a_token():
    tokenizer = arithmetic_task.tokenizer()
    text = " 47*6=282 47*80=3760 282+3760=4042 so 4042"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == len(text)
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_area_equal_time_and_paired_standard_error():
    curve = [[100, 0.2, None, None], [200, 0.4, None, None], [400, 0.4, None, None]]
    assert report.area(curve) == pytest.approx((100 * 0.3 + 200 * 0.4) / 300)
    run = {"curve": curve, "train_runtime": 80.0, "max_steps": 400}  # 0.2 s a step
    assert report.at_seconds(run, 40.0) == 0.4 and report.at_seconds(run, 39.0) == 0.2
    assert report.at_seconds(run, 10.0) is None
    mean, se = report.paired("1100", "0101")  # differences 1, 0, 0, -1
    assert mean == 0.0 and se == pytest.approx(math.sqrt(0.5) / 2)
