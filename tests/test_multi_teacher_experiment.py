"""`make experiment-multi` (benchmarks/quality/multi_teacher_kd.py): the topic split and the summary it reports."""

import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).parent.parent / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

from multi_teacher_kd import METHODS, README_END, README_START, half_of, markdown, summarize  # noqa: E402


def test_a_package_is_in_one_half_and_both_halves_are_used():
    assert half_of("email/parser.py") == half_of("email/mime/text.py") == half_of("email/__init__.py")
    assert half_of("json.py") == half_of("json/decoder.py")  # a module and a package of one name: one topic
    halves = {half_of(f"{name}/x.py") for name in ("email", "json", "asyncio", "http", "xml", "logging", "unittest")}
    assert halves == {"a", "b"}


def test_the_summary_counts_the_seeds_a_two_teacher_student_beats_both():
    ce = {"sft": [5.0, 5.0, 5.0], "teacher_a": [4.5, 4.4, 4.6], "teacher_b": [4.6, 4.3, 4.5],
          "both_routed": [4.4, 4.35, 4.4], "both_mixed": [4.49, 4.2, 4.45]}
    runs = [{"method": m, "seed": s + 1, "heldout_ce": {"union": v}} for m, values in ce.items()
            for s, v in enumerate(values)]
    summary = summarize(runs, [1, 2, 3])
    assert summary["both_routed"]["seeds_beating_both"] == 2  # seed 2: 4.35 is not below teacher_b's 4.3
    assert summary["both_mixed"]["seeds_beating_both"] == 3
    assert summary["teacher_a"]["mean"] == pytest.approx(4.5) and "seeds_beating_both" not in summary["sft"]
    halves = {f"train_{h}": {"pieces": 10, "topics": 2} for h in "ab"}
    report = {"settings": {"steps": 3, "batch": 2, "alpha": 0.5, "divergence": "forward_kl", "seeds": [1, 2, 3],
                           "corpus": {"halves": halves}},
              "teachers": {h: {"heldout_ce": {"union": 4.0, "a": 3.9, "b": 4.1}} for h in "ab"},
              "summary": summary, "wall_seconds": 60}
    table = markdown(report)
    assert "| both_mixed | 4.3800 | 4.4900, 4.2000, 4.4500 | 3/3 seeds |" in table
    assert all(f"| {m} |" in table for m in METHODS)
    page = (QUALITY.parents[1] / "docs" / "benchmarks.md").read_text()
    assert page.count(README_START) == 1 and page.count(README_END) == 1
