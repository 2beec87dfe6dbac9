"""The line a finished `trl-distill` run ends with says what it saved, as it is: a distilled student, the SFT baseline
(alpha 0, no teacher: nothing was distilled), a student trained on the CE alone beside a teacher, a LoRA adapter (not
a whole model); and `cache-teacher`'s says whether it wrote anything."""

from types import SimpleNamespace

import pytest

from trl_distill.cli import main
from trl_distill.cli.cache_teacher import cache_line
from trl_distill.cli.train import saved_line
from trl_distill.teacher.no_teacher import NoTeacher
from trl_distill.testing import synthetic_prompt_completion


@pytest.mark.parametrize("teacher, alpha, lora, line", [
    (object(), 0.5, False, "Distilled student saved to OUT; its curves: trl-distill report OUT"),
    (object(), 0.5, True, "Distilled student: its LoRA adapter saved to OUT (a whole model: trl-distill merge "
                         "--adapter OUT --output DIR); its curves: trl-distill report OUT"),
    (NoTeacher(), 0.0, False, "SFT baseline (alpha 0, no teacher) saved to OUT; its curves: trl-distill report OUT"),
    (object(), 0.0, False, "Student trained on the cross-entropy alone (alpha 0: the teacher measured, not "
                           "distilled) saved to OUT; its curves: trl-distill report OUT"),
])
def test_the_end_line_says_what_was_trained_and_saved(teacher, alpha, lora, line):
    assert saved_line("OUT", teacher, alpha, lora) == line


def test_an_sft_baseline_with_lora_says_so_through_the_command_line(tiny_pair, tmp_path, capsys):
    """--alpha 0 without a teacher, a LoRA student: one step, then the line names the baseline and its adapter."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    synthetic_prompt_completion(8).to_json(data)
    main(["--model_name_or_path", tiny_pair["student"], "--alpha", "0", "--dataset_name", str(data), "--output_dir",
          str(out), "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "1",
          "--per_device_train_batch_size", "4", "--bf16", "false", "--gradient_checkpointing", "false",
          "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--use_cpu", "true"])
    said = [line for line in capsys.readouterr().out.splitlines() if "saved to" in line]
    assert said == [f"SFT baseline (alpha 0, no teacher): its LoRA adapter saved to {out} (a whole model: trl-distill "
                    f"merge --adapter {out} --output DIR); its curves: trl-distill report {out}"]
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    assert "Distilled" not in capsys.readouterr().err


def manifest(shards: int) -> SimpleNamespace:
    return SimpleNamespace(shards=[{"tokens": 10, "bytes": 30}] * shards, num_shards=shards, num_rows=40, top_k=16)


@pytest.mark.parametrize("kept, line", [
    (0, "Teacher cache written to DIR: 40 rows, 50 loss tokens, top-16, 150 bytes (3.0 per token)"),
    (2, "Teacher cache written to DIR (2 of its 5 shards kept from an earlier run): 40 rows, 50 loss tokens, top-16, "
        "150 bytes (3.0 per token)"),
    (5, "Teacher cache in DIR was already complete, nothing written: 40 rows, 50 loss tokens, top-16, 150 bytes "
        "(3.0 per token)"),
])
def test_cache_teachers_end_line_says_whether_it_wrote(kept, line):
    assert cache_line(manifest(5), "DIR", kept) == line
