"""`benchmarks/gpu/run.sh --cpu-dry-run`: the GPU run's every step at tiny sizes on this CPU, so the script a GPU
session runs in its first minutes cannot rot unnoticed (issue 32)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from trl_distill.model.precision import cpu_supports_bf16

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed  # its training runs launch torchrun (one process each)
def test_the_gpu_script_runs_every_step_at_tiny_sizes_on_the_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--cpu-dry-run", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    training = report["training"]
    assert set(training) == {"ours_one_process", "ours_torchrun_1", "gkd_torchrun_1"}
    dtype = "torch.bfloat16" if cpu_supports_bf16() else "torch.float32"  # no bf16 emulation: trl_distill refuses it
    for run in training.values():
        assert run["tokens_per_s"] > 0 and run["dtypes"] == {"student": dtype, "teacher": dtype}
    # One process with and without torchrun: the same work, the same losses
    ours = [training[n]["train_loss"] for n in ("ours_one_process", "ours_torchrun_1")]
    assert ours[0] == pytest.approx(ours[1], rel=1e-3)
    assert report["loss"]["liger_skipped"]  # Triton needs a GPU
    results = {r["method"]: r for r in report["loss"]["results"]}
    assert set(results) == {f"{w}_{d}" for w in ("ours", "naive") for d in ("forward_kl", "reverse_kl")}
    for divergence in ("forward_kl", "reverse_kl"):  # the fused loss equals the full-logits one (fp32)
        assert results[f"ours_{divergence}"]["loss"] == pytest.approx(results[f"naive_{divergence}"]["loss"], rel=1e-5)
        assert results[f"ours_{divergence}"]["loss"] > 0.5  # random models: about 1 nat apart
    text = (tmp_path / "gpu_bench.md").read_text()
    assert "| ours_torchrun_1 |" in text and "| ours_forward_kl | 128 |" in text
