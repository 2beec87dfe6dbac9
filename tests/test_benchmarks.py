"""Smoke test of benchmarks/trainers.py: tiny models, one repeat, 3 steps, into a temporary directory.

It checks only that well-formed results come out (keys, positive numbers, ratio fields), not their values.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "trainers.py"
# Every code path of the worker (ours with and without DeepSpeed, GKD with DeepSpeed, the bare loop, gradient
# accumulation);
# the ZeRO-3-for-both runs only change a config file, and leaving them out keeps the test under a minute and a half.
CONTENDERS = ["ours_1p", "bare_1p", "gkd_z2", "ours_z2_z3", "ours_z2_z3_ga8"]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_trainers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench_trainers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--output_dir", str(out), "--only", *CONTENDERS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out, json.loads((out / "trainers.json").read_text())


@pytest.mark.distributed
def test_smoke_results_well_formed(smoke):
    out, report = smoke
    bench = _load_script()
    assert report["smoke"] and report["plan"]["repeats"] == 1
    assert report["models"]["teacher_params"] > report["models"]["student_params"] > 0
    assert sorted(report["summary"]) == sorted(CONTENDERS) == sorted(report["runs"])
    for name, summary in report["summary"].items():
        assert summary["ok_repeats"] == 1 and not summary["errors"], (name, summary["errors"])
        for metric in bench.METRICS:
            stats = summary[metric]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"], (name, metric, stats)
        (run,) = report["runs"][name]
        assert len(run["ranks"]) == bench.CONTENDERS[name][2]
        for rank in run["ranks"]:
            shape = bench.shape(name, report["plan"])
            assert rank["timed_steps"] == shape["steps"] - shape["warmup"] > 0
            assert rank["memory"]["teacher_ready"]["VmHWM"] > 0 and rank["memory"]["after_train"]["VmHWM"] > 0


@pytest.mark.distributed
def test_smoke_ratios_present(smoke):
    _, report = smoke
    bench = _load_script()
    expected = {k for k, (num, den, *_) in bench.RATIOS.items() if num in CONTENDERS and den in (*CONTENDERS, None)}
    assert expected and set(report["ratios"]) == expected
    for key, ratio in report["ratios"].items():
        assert len(ratio["per_repeat"]) == 1 and ratio["per_repeat"][0] > 0, key
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
        assert ("met" in ratio) == (ratio["goal"] is not None)


@pytest.mark.distributed
def test_smoke_markdown_and_plot_from_json(smoke):
    out, report = smoke
    bench = _load_script()
    md = (out / "trainers.md").read_text()
    assert md == bench.markdown(report)  # the table is generated from the JSON
    assert "| setup |" in md and "| ratio (repeat by repeat) |" in md
    assert (out / "trainers.png").stat().st_size > 0


@pytest.mark.distributed
def test_smoke_readme_block_replaced_between_markers(smoke, tmp_path):
    _, report = smoke
    bench = _load_script()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_START}\nold table\n{bench.README_END}\noutro\n")
    assert bench.update_readme(report, readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert text.count("| teacher bytes per rank |") == 1
    assert (ROOT / "docs" / "benchmarks.md").read_text().count(bench.README_START) == 1  # the results page has them
