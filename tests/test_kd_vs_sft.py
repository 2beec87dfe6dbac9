"""`make experiment` (benchmarks/quality/kd_vs_sft.py): its summary statistics, and a smoke run end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).parent.parent / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

from kd_vs_sft_report import README_END, README_START, markdown, summarize, update_readme  # noqa: E402

METRICS = {"ce", "ppl", "kl_to_teacher", "top1_agreement"}


def _run(method: str, seed: int, final_ce: float) -> dict:
    point = dict(kl_to_teacher=0.5, top1_agreement=0.3)
    return {"method": method, "divergence": "forward_kl", "alpha": 0.0 if method == "sft" else 1.0, "seed": seed,
            "curve": [{"step": 0, "ce": 7.0, "ppl": math.exp(7.0), **point},
                      {"step": 10, "ce": final_ce, "ppl": math.exp(final_ce), **point}]}


def test_summary_pairs_kd_with_sft_seed_by_seed():
    runs = [_run("sft", 1, 5.0), _run("sft", 2, 6.0), _run("kd", 2, 5.5), _run("kd", 1, 5.1)]
    summary = summarize(runs, ["sft", "kd"])
    assert summary["kd"]["final"]["ce"]["mean"] == pytest.approx(5.3)
    assert summary["kd"]["final"]["ce"]["min"] == 5.1 and summary["kd"]["final"]["ce"]["max"] == 5.5
    delta = summary["kd"]["ce_minus_sft"]  # seed 1: +0.1, seed 2: -0.5
    assert delta["mean"] == pytest.approx(-0.2) and delta["seeds_better"] == 1
    assert [p["step"] for p in summary["kd"]["curve"]] == [0, 10]
    assert "ce_minus_sft" not in summary["sft"]


def _check_runs(runs: list[dict], summary: dict, steps: list[int]) -> None:
    assert set(summary) == {"sft", "forward_kl/a0.5"}
    for run in runs:
        assert [point["step"] for point in run["curve"]] == steps  # the initial student, then every checkpoint
        for point in run["curve"]:
            assert METRICS <= set(point) and all(math.isfinite(point[k]) for k in METRICS)
            assert 0.0 <= point["top1_agreement"] <= 1.0 and point["kl_to_teacher"] >= 0.0
    for entry in summary.values():
        assert all(math.isfinite(entry["final"][k][s]) for k in METRICS for s in ("mean", "sd", "min", "max"))
    assert math.isfinite(summary["forward_kl/a0.5"]["ce_minus_sft"]["mean"])


def _check_report(report: dict) -> None:
    assert {"settings", "teacher", "reference_student", "runs", "summary", "teacher_budget", "wall_seconds",
            "machine"} <= set(report)
    methods = report["settings"]["methods"]
    assert [m["name"] for m in methods] == ["sft", "forward_kl/a0.5"]
    assert len(report["runs"]) == len(methods) * len(report["settings"]["seeds"])
    _check_runs(report["runs"], report["summary"], [0, 2, 4])  # --smoke: 4 steps, a checkpoint every 2
    long = report["teacher_budget"]
    assert len(long["runs"]) == 2 and {r["seed"] for r in long["runs"]} == {0}
    _check_runs(long["runs"], long["summary"], [0, 1, 2, 3, 4])  # the teacher's 4 steps, a checkpoint every 1
    teacher = report["teacher"]["heldout"]
    assert teacher["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6) and teacher["top1_agreement"] == 1.0
    assert math.isfinite(report["reference_student"]["heldout"]["ce"])


@pytest.mark.distributed  # starts CLI runs as subprocesses, two at a time
def test_smoke_run_writes_json_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    committed = {p: p.stat().st_mtime_ns for p in (QUALITY / "results").glob("*")}
    cmd = [sys.executable, str(QUALITY / "kd_vs_sft.py"), "--smoke", "--output_dir", str(out),
           "--work_dir", str(tmp_path / "work")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads((out / "kd_vs_sft.json").read_text())
    _check_report(report)
    table = (out / "kd_vs_sft.md").read_text()
    assert "| SFT only (α=0) |" in table and "| forward_kl α=0.5 (+CE) |" in table
    assert table == markdown(report)
    assert (out / "kd_vs_sft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert committed == {p: p.stat().st_mtime_ns for p in (QUALITY / "results").glob("*")}  # left alone
    readme = tmp_path / "README.md"  # the full run writes its table between the README's markers
    readme.write_text(f"intro\n{README_START}\nold table\n{README_END}\nafter\n")
    assert update_readme(report, readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith(f"{README_END}\nafter\n")
    assert "| forward_kl α=0.5 (+CE) |" in text and f"{report['teacher']['heldout']['ce']:.3f}" in text
