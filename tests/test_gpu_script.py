"""`benchmarks/gpu/run.sh --cpu-dry-run`: the GPU run's every row at tiny sizes on this CPU, so the script a GPU
session runs in its first minutes cannot rot unnoticed (issue 32), and a failing row fails the run, its last lines
printed (issue 55)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_distill.model.precision import cpu_supports_bf16

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
from rows import ROWS  # noqa: E402


def dry_run(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "benchmarks/gpu/run.sh", "--cpu-dry-run", str(out), *options], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.distributed  # its training rows launch torchrun (one process each)
def test_the_gpu_script_runs_every_row_at_tiny_sizes_on_the_cpu(tmp_path):
    proc = dry_run(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    training = report["training"]
    assert list(training) == list(ROWS) and report["failed"] == {}
    dtype = "torch.bfloat16" if cpu_supports_bf16() else "torch.float32"  # no bf16 emulation: trl_distill refuses it
    for name, run in training.items():
        assert run["wall_s"] > 0 and f"{name}: " in proc.stdout
        if name == "cache_write":  # a pass over the rows, no optimizer step
            assert run["rows"] == 2 and run["loss_tokens"] > 0 and run["top_k"] == 8
            continue
        assert run["tokens_per_s"] > 0 and run["timed_steps"] == 1
        assert run["dtypes"]["student"] == dtype and run["dtypes"]["teacher"] in (dtype, None)
    assert training["ours_from_cache"]["dtypes"]["teacher"] is None  # no teacher model in the job
    assert training["ours_from_cache"]["teacher_mib"] == 0
    lo, hi = report["sizes"]["seq_len"] * 3 // 40, report["sizes"]["seq_len"] * 5 // 40
    for name in ("ours_on_policy", "gkd_on_policy", "ours_sampled_token"):  # the prompt and 8 sampled tokens
        assert training[name]["tokens_per_step"] == (lo + hi) / 2 + 8
    # One process with and without torchrun: the same work, the same losses
    ours = [training[n]["train_loss"] for n in ("ours_one_process", "ours_torchrun_1")]
    assert ours[0] == pytest.approx(ours[1], rel=1e-3)
    assert report["loss"]["liger_skipped"]  # Triton needs a GPU
    results = {r["method"]: r for r in report["loss"]["results"]}
    assert set(results) == {f"{w}_{d}" for w in ("ours", "naive") for d in ("forward_kl", "reverse_kl")} | {
        "ourschunk1024_forward_kl", "ourschunk4096_forward_kl"}  # the chunk sizes a GPU run measures
    for chunked in ("ourschunk1024_forward_kl", "ourschunk4096_forward_kl"):  # the same loss at any chunk size
        assert results[chunked]["loss"] == pytest.approx(results["naive_forward_kl"]["loss"], rel=1e-5)
    for divergence in ("forward_kl", "reverse_kl"):  # the fused loss equals the full-logits one (fp32)
        assert results[f"ours_{divergence}"]["loss"] == pytest.approx(results[f"naive_{divergence}"]["loss"], rel=1e-5)
        assert results[f"ours_{divergence}"]["loss"] > 0.5  # random models: about 1 nat apart
    text = (tmp_path / "gpu_bench.md").read_text()
    assert "| ours_torchrun_1 |" in text and "| ours_forward_kl | 128 |" in text and "| gkd_on_policy |" in text
    assert re.search(r"^Wall seconds: \(loss table\) [\d.]+, \(models\) [\d.]+, ours_one_process [\d.]+, .*, "
                     r"ours_from_cache [\d.]+; total [\d.]+$", proc.stdout, re.MULTILINE)  # fmt: skip


@pytest.mark.distributed
def test_a_row_past_its_timeout_fails_the_run_and_prints_its_last_lines(tmp_path):
    """A genuine failure: the row cannot start its trainer in 2 s (its imports alone take longer), so it is killed at
    its timeout; the run says so with the row's output as it fails and in its summary, records it, and exits 1."""
    proc = dry_run(tmp_path, "--rows", "ours_one_process", "--row_timeout_s", "2")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-8000:]
    failure = ("ours_one_process: FAILED (timed out after 2 s (--row_timeout_s); killed)\n"
               "    | train_worker: ours rank 0")
    assert proc.stdout.count(failure) == 2  # as it fails, and in the closing summary
    assert "1 row(s) FAILED:" in proc.stdout
    assert "failed: ours_one_process (" in proc.stderr and "rerun them with --rows ours_one_process" in proc.stderr
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert list(report["training"]) == ["ours_one_process"] and report["loss"] is None  # only the row asked for
    recorded = report["training"]["ours_one_process"]
    assert recorded["error"].startswith("timed out after 2 s") and "train_worker: ours rank 0" in recorded["tail"]
    assert report["failed"]["ours_one_process"]["error"] == recorded["error"]
    assert "| ours_one_process | failed: timed out after 2 s" in (tmp_path / "gpu_bench.md").read_text()
