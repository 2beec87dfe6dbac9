"""The examples run as users run them (few steps): the quickstart, and a stock `Trainer` script made to distil."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_distill.testing import launch

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


def test_bundled_corpus_is_split_by_topic():
    splits = {s: [json.loads(line) for line in (EXAMPLES / f"data/python_reference/{s}.jsonl").open()]
              for s in ("train", "heldout")}
    topics = {s: {row["topic"] for row in rows} for s, rows in splits.items()}
    assert not topics["train"] & topics["heldout"]
    assert len(splits["train"]) > 10 * len(splits["heldout"]) > 0
    assert all(0 < len(row["text"]) <= 480 for rows in splits.values() for row in rows)


@pytest.mark.distributed
def test_quickstart_runs_end_to_end(tmp_path):
    out = tmp_path / "qs"
    subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py"), "--output_dir", str(out), "--teacher_steps", "4",
                    "--distill_steps", "2"], check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["before"]) == {"kl_to_teacher", "top1_agreement", "student_ce", "teacher_ce"}
    assert all(math.isfinite(v) for v in summary["after"].values())
    assert summary["before"]["teacher_ce"] == pytest.approx(summary["after"]["teacher_ce"])  # same teacher
    assert summary["after"]["student_ce"] != summary["before"]["student_ce"]  # the distilled student was saved


@pytest.mark.distributed
def test_drop_in_trainer_script_on_two_processes(tiny_pair, tmp_path):
    out = tmp_path / "out"
    zero2 = str(ROOT / "configs/deepspeed/zero2_student.json")
    launch(EXAMPLES / "drop_in_trainer.py", "--student", tiny_pair["student"], "--teacher", tiny_pair["teacher"],
           "--output_dir", str(out), "--max_steps", "2", "--deepspeed", zero2)
    trained, initial = (AutoModelForCausalLM.from_pretrained(p) for p in (out, tiny_pair["student"]))
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())]
    assert all(moved)


def test_lora_student_example_self_distills_and_merges(tiny_pair, tmp_path):
    out = tmp_path / "lora"
    subprocess.run([sys.executable, str(EXAMPLES / "lora_student.py"), "--student", tiny_pair["student"],
                    "--teacher", "self", "--output_dir", str(out), "--max_steps", "2", "--no_deepspeed"],
                   check=True, capture_output=True, timeout=300)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert sum(p.numel() for p in merged.parameters()) == 37280  # the student's own size: adapters folded in
