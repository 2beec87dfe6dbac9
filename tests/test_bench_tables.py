"""The real-shape bench's ratios and tables and the fit bench's search, on given runs (no training: the scripts'
own smoke runs are `tests/test_benchmarks.py` and `tests/test_gpu_script.py`)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fit  # noqa: E402
import real_shapes  # noqa: E402


def _run(tokens_per_s: float, peak: float, teacher: float = 100.0) -> dict:
    return {"metrics": {"tokens_per_s": tokens_per_s, "step_s": 1.0, "peak_rss_mib": peak, "teacher_mib": teacher,
                        "train_loss": 0.5}, "wall_s": 1.0}  # fmt: skip


OOM = {"error": "RuntimeError: DefaultCPUAllocator: can't allocate memory", "out_of_memory": True, "wall_s": 1.0}
RUNS = {
    "1024/bf16/ga1": {"ours_z2_z3": [_run(300, 2000, 50), _run(200, 2000, 50)],
                      "gkd_z2": [_run(150, 5000), _run(200, 5000)],
                      "ours_z3_z3": [_run(250, 2100, 50), _run(250, 2100, 50)],
                      "gkd_z3": [_run(100, 5100, 50), _run(100, 5100, 50)]},
    "4096/bf16/ga1": {"ours_z2_z3": [_run(700, 2700, 50)], "gkd_z2": [OOM], "ours_z3_z3": [_run(650, 2800, 50)],
                      "gkd_z3": [OOM]},
}  # fmt: skip


def test_real_shape_ratios_are_taken_repeat_by_repeat():
    ratios = real_shapes.ratios(RUNS)["1024/bf16/ga1"]
    assert ratios["tokens_vs_gkd_z2"]["per_repeat"] == [2.0, 1.0]
    assert ratios["tokens_vs_gkd_z2"]["median"] == 1.5 and ratios["tokens_vs_gkd_z2"]["met"]
    assert ratios["tokens_vs_zero3_both"]["per_repeat"] == [1.2, 0.8] and not ratios["tokens_vs_zero3_both"]["met"]
    assert ratios["peak_vs_gkd_z2"]["median"] == 0.4 and ratios["peak_vs_gkd_z2"]["met"]
    assert ratios["teacher_bytes_vs_gkd_z2"]["median"] == 0.5


def test_a_contender_out_of_memory_is_named_in_the_tables():
    ratios = real_shapes.ratios(RUNS)["4096/bf16/ga1"]
    against_gkd = ratios["tokens_vs_gkd_z2"]
    assert "median" not in against_gkd and against_gkd["note"] == "gkd_z2 ran out of memory"
    assert ratios["tokens_vs_zero3_both"]["median"] == pytest.approx(700 / 650)
    summary = real_shapes.summarize(RUNS)
    assert summary["4096/bf16/ga1"]["gkd_z2"] == {"ok_repeats": 0, "failed": 1, "out_of_memory": 1}
    report = {"plan": {"vocab_size": 128000, "memory_cap_mib": 10240, "repeats": 2},
              "machine": {"cpu": "x", "cpus": 2, "torch": "t", "trl": "r", "deepspeed": "d",
                          "date": "2026-12-02T00:00"},
              "models": {"teacher_params": 145e6, "student_params": 69e6}, "total_runtime_s": 600,
              "load_average_1min": {"start": 1.0, "end": 2.0}, "summary": summary,
              "ratios": real_shapes.ratios(RUNS)}  # fmt: skip
    table = "\n".join(real_shapes.headline_table(report))
    row = next(line for line in table.splitlines() if line.startswith("| 4096/bf16/ga1 |"))
    assert "700 [700, 700]" in row and row.count("out of memory") == 5  # 2 tokens/s cells, 2 ratios, the peak
    row = next(line for line in table.splitlines() if line.startswith("| 1024/bf16/ga1 |"))
    assert "1.50× [1.00, 2.00]" in row and "**missed**" in row  # vs ZeRO-3 for both: 1.0× < 1.5


@pytest.mark.parametrize(("boundary", "max_layers"), [(1, 64), (5, 64), (37, 64), (64, 64), (80, 96)])
def test_the_fit_search_finds_the_largest_layer_count_that_fits(monkeypatch, boundary, max_layers):
    tried = []

    def fits(name, layers, cfg, models, teachers, out):
        tried.append(layers)
        ok = layers <= boundary
        return {"layers": layers, "teacher_params": layers * 10, "fits": ok, "out_of_memory": not ok}

    monkeypatch.setattr(fit, "fits", fits)
    found = fit.largest("ours_z2_z3", {"max_layers": max_layers}, {}, None, Path("."))
    assert found["largest_layers"] == boundary and found["largest_params"] == boundary * 10
    assert len(tried) == len(set(tried))  # no layer count probed twice
    assert len(tried) <= 2 * max_layers.bit_length() + 1  # doubling, then bisection
    assert found["first_failing_layers"] in (None if boundary == max_layers else boundary + 1,)


def test_no_fit_at_one_layer_is_zero(monkeypatch):
    monkeypatch.setattr(fit, "fits", lambda *a: {"layers": a[1], "teacher_params": 1, "fits": False,
                                                 "out_of_memory": True})  # fmt: skip
    found = fit.largest("gkd_z2", {"max_layers": 64}, {}, None, Path("."))
    assert found["largest_layers"] == 0 and found["first_failing_layers"] == 1 and found["largest_params"] == 0


def test_the_readme_summaries_quote_the_results_they_are_written_from():
    """The README's fit and small-shape tables, from the committed JSON: the numbers of the full tables."""
    import json

    import trainers

    root = Path(__file__).parents[1] / "benchmarks" / "results"
    rep = json.loads((root / "fit.json").read_text())
    rows = rep["result"]["contenders"]
    text = fit.summary(rep)
    for row in rows.values():
        m = row["measured"]
        assert f"| {m['largest_layers']} layers, {m['largest_params'] / 1e6:.0f}M | {row['plan']['largest_layers']} " \
               "layers |" in text
    ratio = rows["ours_z2_z3"]["measured"]["largest_params"] / rows["gkd_z2"]["measured"]["largest_params"]
    assert f"| ours / GKD | {ratio:.2f}× the parameters" in text
    small = json.loads((root / "trainers.json").read_text())
    text = trainers.summary_block(small)
    assert len(text.splitlines()) == 2 + len(trainers.SUMMARY_RATIOS)
    for key in trainers.SUMMARY_RATIOS:
        r = small["ratios"][key]
        assert f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" in text


def test_a_merged_run_keeps_the_other_cases_in_the_plans_order():
    def report(runs, date, minutes, load):
        return {"smoke": False, "plan": {"cases": list(runs), "vocab_size": 128000, "memory_cap_mib": 10240,
                                         "repeats": 2},
                "machine": {"cpu": "x", "cpus": 2, "torch": "t", "trl": "r", "deepspeed": "d", "date": date},
                "models": {"teacher_params": 145e6, "student_params": 69e6}, "runs": runs,
                "total_runtime_s": minutes * 60, "load_average_1min": load}  # fmt: skip

    old = report({"4096/bf16/ga1": RUNS["4096/bf16/ga1"]}, "2026-12-02T02:00", 30, {"start": 0.5, "end": 2.0})
    new = report({"1024/bf16/ga1": RUNS["1024/bf16/ga1"]}, "2026-12-02T06:00", 20, {"start": 1.0, "end": 1.5})
    both = real_shapes.merged(old, new)
    assert list(both["runs"]) == both["plan"]["cases"] == ["1024/bf16/ga1", "4096/bf16/ga1"]  # the plan's order
    assert both["summary"]["4096/bf16/ga1"]["gkd_z2"]["out_of_memory"] == 1
    assert both["ratios"]["1024/bf16/ga1"]["tokens_vs_gkd_z2"]["per_repeat"] == [2.0, 1.0]
    assert both["total_runtime_s"] == 50 * 60 and both["load_average_1min"] == {"start": 0.5, "end": 1.5}
    assert "Run in parts: 4096/bf16/ga1 on 2026-12-02T02:00; 1024/bf16/ga1 on 2026-12-02T06:00." in \
        real_shapes.header(both)[0]
    with pytest.raises(SystemExit, match="models"):
        real_shapes.merged(old, {**new, "models": {"teacher_params": 1, "student_params": 1}})
